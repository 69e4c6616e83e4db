"""The bench's report: derived numbers (scaling, parity, speed-up, what sharding saves) and the terminal and
markdown tables (bench_files.py writes bench.json, bench.md and the PNG plot). Imported only when a bench runs or
`multicard env` names the CPU; torch loads only inside build()."""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

PARITY_NOTE = ("loss parity: |final train loss - single x1's| / single x1's, after the same epochs from the same "
               "initial weights, data order and global batch (not computed for the plain loop and the fast path, "
               "whose batch or data order differ)")
HELD_NOTE = ("held: MB of parameters / gradients / optimizer state in each process at the first optimizer step "
             "(memory.shard_bytes: of a DTensor only the local shard, each storage once), beside the peak, which "
             "also counts activations, buffers and, under fsdp, the blocks gathered whole while they compute; "
             "held vs whole: the most any process of the cell held, over what one process holds of the whole "
             "model and its optimizer (a 1-device cell)")
KINDS = ("params", "grads", "optimizer")
SCALING_NOTE = ("scaling: samples/s over N x those of the same strategy on 1 device; ? above 100%: N devices "
                "doing more than N times the work of one, see the warnings")
SPREAD_LIMIT = 0.10  # timed epochs of one cell further apart than this (of their median): the median is not sure
SPREAD_NOTE = (f"spread: (fastest - slowest timed epoch) / median, '-' from a single timed epoch; * above "
               f"{SPREAD_LIMIT:.0%}: the epochs disagree, the median is uncertain by about that much")
LOAD_NOTE = ("load/cores: the machine's 1-minute load average (the higher of just before and just after the cell; it "
             "counts this bench's own threads too) over the cores the cell ran on; ! above them: other work took "
             "cores from the cell, whose rates are then low and uneven")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The multicard checkout's commit, "-dirty" when it has uncommitted changes; None for an installed copy."""
    root = Path(__file__).resolve().parents[3]  # tools, multicard, src, the checkout
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12", "--exclude=*"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def command() -> str:
    name = Path(sys.argv[0]).name
    return shlex.join(["python -m multicard" if name == "__main__.py" else name, *sys.argv[1:]])


def held(cell: dict) -> list[float] | None:
    """MB of parameters + gradients + optimizer state in each of a cell's processes; None where not measured
    (bench.json files from before the column)."""
    shards = cell.get("shard_mb")
    return [sum(s[k] for k in KINDS) for s in shards] if shards and all(shards) else None


def spread(rates: list[float]) -> float | None:
    """(fastest - slowest) / median of a cell's timed epochs; None from one epoch, which has no spread."""
    return (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else None


def honesty(cell: dict) -> None:
    """A row's spread of its timed epochs (min, max, relative spread, whether it is large) and whether the machine
    was busy while it ran (load above its cores; None where not measured: a bench.json from before the fields)."""
    rates = cell.get("epoch_samples_per_s") or [cell["samples_per_s"]]  # only a median: no spread to tell
    cell["rate_min"], cell["rate_max"], cell["spread"] = min(rates), max(rates), spread(rates)
    cell["noisy"] = cell["spread"] is not None and cell["spread"] > SPREAD_LIMIT
    loads = [v for v in (cell.get("load_before"), cell.get("load_after")) if v is not None]
    # the load average counts the cell's own threads too, but multicard gives it no more than its cores: above
    # them, other work was running
    cell["busy"] = max(loads) > cell["cores"] if loads and cell.get("cores") else None


def warnings(results: dict) -> list[str]:
    """What the numbers cannot be trusted for, each a short headline, ': ', then why and what to do."""
    out = []
    busy = [r for r in rows(results) if r.get("busy")]
    if busy:
        what = ", ".join(f"{r['strategy']} x{r['devices']} {max(r['load_before'], r['load_after']):.1f}"
                         for r in busy)
        out.append(f"machine busy: the 1-minute load average was above the {busy[0]['cores']} cores in {len(busy)} "
                   f"of {len(rows(results))} cells ({what}); other work took cores from them, so their rates and "
                   f"every ratio built on them (scaling, speed-up) are off; rerun on a quiet machine")
    noisy = [r for r in rows(results) if r.get("noisy")]
    if noisy:
        what = ", ".join(f"{r['strategy']} x{r['devices']} {r['spread']:.0%}" for r in noisy)
        out.append(f"large spread: the timed epochs differ by more than {SPREAD_LIMIT:.0%} of their median in "
                   f"{what}; read those medians as that uncertain; rerun with more --repeats on a quiet machine")
    one = {c["strategy"]: c for c in results["cells"] if c["devices"] == 1}
    for cell in results["cells"]:
        first, efficiency = one.get(cell["strategy"]), cell.get("scaling_efficiency")
        if cell["devices"] == 1 or not first or efficiency is None or efficiency <= 1:
            continue
        name = f"{cell['strategy']} x{cell['devices']}"
        spreads = [cell.get("spread"), first.get("spread")]
        if None in spreads:
            out.append(f"{name} scaling {efficiency:.0%} unverified: above 100% from a single timed epoch, which "
                       f"has no spread to judge it by; more than {cell['devices']}x the one-device rate is almost "
                       f"always noise; rerun with --repeats 3 or more on a quiet machine")
            continue
        margin = sum(spreads)  # a ratio of two medians: their relative uncertainties add
        if efficiency > 1 + margin:
            out.append(f"{name} scaling {efficiency:.0%} is noise: above 100% by more than the two cells' spread "
                       f"({margin:.0%}); {cell['devices']} devices cannot do more than {cell['devices']}x the work "
                       f"of one unless each one's share of the data and model newly fits its cache; most likely the "
                       f"machine's load changed between the cells; not a speed-up; rerun on a quiet machine")
        else:  # still worth saying: the table shows the number as if it were measured
            out.append(f"{name} scaling {efficiency:.0%} within the noise: the two cells' spread ({margin:.0%}) is "
                       f"larger than its {efficiency - 1:.0%} above 100%: no evidence of better than ideal scaling, "
                       f"not a speed-up; rerun on a quiet machine with more --repeats")
    return out


def derive(results: dict) -> None:
    """Fill in scaling efficiency (against the same strategy on one device), loss parity (against single x1),
    speed-up over the plain loop, the share of the whole model each process holds, the spread of each row's timed
    epochs and whether the machine was busy, in place; then the warnings about all of it."""
    cells, baseline = results["cells"], results.get("baseline")
    one = {c["strategy"]: c for c in cells if c["devices"] == 1}
    reference = one.get("single")
    for cell in cells:
        first = one.get(cell["strategy"])
        cell["scaling_efficiency"] = cell["samples_per_s"] / (cell["devices"] * first["samples_per_s"]) \
            if first else None
        cell["loss_parity"] = abs(cell["loss"] - reference["loss"]) / reference["loss"] if reference else None
    for extra in (results[k] for k in ("baseline", "fast") if k in results):
        extra["scaling_efficiency"] = extra["loss_parity"] = None
    # the whole model and its optimizer state, as one process holds it: single x1 first, else any 1-process cell
    ones = [c for c in [reference, *cells, baseline, results.get("fast")] if c and c.get("world_size") == 1]
    whole = next((max(held(c)) for c in ones if held(c)), None)
    for cell in rows(results):
        cell["speedup_vs_baseline"] = cell["samples_per_s"] / baseline["samples_per_s"] if baseline else None
        cell["held_vs_whole"] = max(held(cell)) / whole if whole and held(cell) else None
        honesty(cell)
    results["spread_limit"] = SPREAD_LIMIT
    results["warnings"] = warnings(results)


def build(args: argparse.Namespace, results: dict, cards: int, cores: int, seconds: float) -> dict:
    import torch

    derive(results)
    config = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
    names = [torch.cuda.get_device_name(i) for i in range(cards)]
    return {"config": config, "torch": torch.__version__, "multicard_commit": commit(),
            "hardware": {"cpu": cpu_name(), "cores": cores, "cards": names},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command(),
            "sweep_seconds": round(seconds, 1), **results}


def rows(report: dict) -> list[dict]:
    """Every measured row in table order: the plain loop, the strategy cells, the fast path."""
    return [r for r in [report.get("baseline"), *report["cells"], report.get("fast")] if r]


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = ("cell", "devices", "batch", "samples/s", "spread", "load/cores", "ms/step", "scaling", "vs plain loop",
          "peak MB per {unit}", "held MB params", "grads", "optimizer", "held vs whole", "imbalance", "final loss",
          "loss parity")


def nvml(report: dict) -> bool:
    """Whether NVML was read in this sweep (cards, and nvidia-ml-py there): then the table has its column."""
    return any(r.get("card_used_mb") for r in rows(report))


def header(report: dict) -> list[str]:
    names = [h.format(unit=unit(report)) for h in HEADER]
    at = HEADER.index("peak MB per {unit}") + 1
    return names[:at] + ["NVML MB per card"] + names[at:] if nvml(report) else names


def mb(value: float) -> str:
    """MB to read at a glance: whole MB from 100 up, else enough decimals for a small model's shards."""
    return format(value, ",.0f" if value >= 100 else ".1f" if value >= 1 else ".2f")


def shards_text(r: dict) -> list[str]:
    """The held columns of a row: each kind's MB per process ("-" where not measured), then held vs whole."""
    shards = r.get("shard_mb")
    if not shards or not all(shards):
        return ["-"] * len(KINDS) + ["-"]
    return [" / ".join(mb(s[k]) for s in shards) for k in KINDS] + [fmt(r.get("held_vs_whole"), ".0%")]


def honesty_text(r: dict) -> list[str]:
    """The spread and load/cores columns, marked * (large spread) and ! (busy machine); .get: bench.json files
    from before these fields have none of them."""
    spread = fmt(r.get("spread"), ".0%") + (" *" if r.get("noisy") else "")
    loads = [v for v in (r.get("load_before"), r.get("load_after")) if v is not None]
    busy = f"{max(loads):.1f}/{r['cores']}" + (" !" if r.get("busy") else "") if loads and r.get("cores") else "-"
    return [spread, busy]


def cells_text(report: dict) -> list[list[str]]:
    out, with_nvml = [], nvml(report)
    for r in rows(report):  # .get: bench.json files written before the NVML column have no card_used_mb
        used = [" / ".join(f"{m:,.0f}" for m in r.get("card_used_mb", [])) or "-"] if with_nvml else []
        out.append([r["strategy"], str(r["devices"]), str(r["batch_size"]), fmt(r["samples_per_s"], ",.0f"),
                    *honesty_text(r), fmt(r["ms_per_step"], ".2f"),
                    fmt(r["scaling_efficiency"], ".0%") + (" ?" if (r["scaling_efficiency"] or 0) > 1 else ""),
                    fmt(r["speedup_vs_baseline"], ".2f") + ("x" if r["speedup_vs_baseline"] else ""),
                    " / ".join(f"{m:,.0f}" for m in r["peak_memory_mb"]), *used, *shards_text(r),
                    fmt(r["imbalance"], ".2f"),
                    fmt(r["loss"], ".4f"), fmt(r["loss_parity"], ".1e")])
    return out


def unit(report: dict) -> str:
    return "card" if report["hardware"]["cards"] else "process"


def heading(report: dict) -> list[str]:
    hw = report["hardware"]
    cards = ", ".join(hw["cards"]) or "no GPU"
    c = report["config"]
    return [f"hardware: {hw['cpu']}, {hw['cores']} cores, {cards}; torch {report['torch']}",
            f"command: {report['command']}", f"date: {report['date']} (sweep took {report['sweep_seconds']} s); "
            f"multicard {report.get('multicard_commit') or 'installed copy, commit unknown'}",
            f"model {c['model']} on {c['samples']} synthetic samples per epoch; 1 warm-up + {c['repeats']} timed "
            f"epochs, median reported; fast path: data on the device, batch {c['fast_batch']}, {c['precision']}"
            + (", torch.compile" if c["compile"] else "")]


def table(report: dict) -> str:
    names = header(report)
    body = cells_text(report)
    widths = [max(len(r[i]) for r in [names, *body]) for i in range(len(names))]

    def line(r: list[str]) -> str:  # the first column left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))

    notes = [SPREAD_NOTE, LOAD_NOTE, SCALING_NOTE, HELD_NOTE, PARITY_NOTE]
    warned = [f"WARNING {w}" for w in report.get("warnings", [])]  # last: what the eye meets after the sweep
    return "\n".join([*heading(report), "", line(names), *(line(r) for r in body), "", *notes, *warned])


def markdown(report: dict) -> str:
    names = header(report)
    lines = [f"- {h}" for h in heading(report)] + [""]
    for w in report.get("warnings", []):  # above the table: read before the numbers
        head, _, why = w.partition(": ")
        lines += [f"**Warning: {head}.** {why}", ""]
    lines += ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(v.replace("*", "\\*") for v in r) + " |" for r in cells_text(report)]
    memory = "torch.cuda peak allocated per card" if report["hardware"]["cards"] else \
        "peak resident memory (RSS) per process"
    if nvml(report):
        memory += ("; NVML: memory in use on each card at the end of the cell (tensors, the allocator's reserve, "
                   "the CUDA context and anything else on the card)")
    many = "cards" if report["hardware"]["cards"] else "processes"
    spread = SPREAD_NOTE.replace("*", "\\*")  # markdown would read a bare * as the start of emphasis
    return "\n".join(lines + ["", f"{spread}. {LOAD_NOTE}. {SCALING_NOTE}. Memory: {memory}; imbalance = max / "
                               f"mean over a cell's {many}. {HELD_NOTE}. {PARITY_NOTE}."])
