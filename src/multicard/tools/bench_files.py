"""The bench's files: bench.json, bench.md and the PNG plot (throughput and scaling beside peak memory per card or
process). Imported only when a bench runs: matplotlib loads here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import safefs
from .bench_report import held, markdown, rows, unit


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.4))
    counts = sorted({c["devices"] for c in report["cells"]} | {1})
    strategies = list(dict.fromkeys(c["strategy"] for c in report["cells"]))
    step = 0.025 * (max(counts) - min(counts) or 1)  # each strategy a little aside, so error bars do not overlap
    dodge = {s: step * (i - (len(strategies) - 1) / 2) for i, s in enumerate(strategies)}
    for marker, strategy in zip("osD^v", strategies, strict=False):
        mine = [c for c in report["cells"] if c["strategy"] == strategy]
        rate = f" ({mine[0]['samples_per_s']:,.0f}/s)" if len(counts) == 1 else ""  # one count: labels would overlap
        median = [c["samples_per_s"] for c in mine]  # error bars: the slowest to the fastest timed epoch
        bars = [[m - c["rate_min"] for m, c in zip(median, mine, strict=True)],
                [c["rate_max"] - m for m, c in zip(median, mine, strict=True)]]
        left.errorbar([c["devices"] + dodge[strategy] for c in mine], median, yerr=bars, fmt=marker + "-",
                      markersize=8, capsize=5, alpha=0.8, label=strategy + rate)
    ideal = next((c for c in report["cells"] if c["strategy"] == "single"),
                 next((c for c in report["cells"] if c["devices"] == 1), None))
    if ideal and len(counts) > 1:  # what N devices would do if each did what one did
        shared = "" if report["hardware"]["cards"] else " (the processes share its cores)"
        left.plot(counts, [n * ideal["samples_per_s"] for n in counts], "k--", linewidth=1, alpha=0.6,
                  label=f"ideal: N \u00d7 {ideal['strategy']} x1{shared}")
    for key, style, name in (("fast", ":", "single fast path"), ("baseline", "--", "plain DataLoader loop")):
        if key in report:  # one-device references: levels to read the strategies against, shaded min to max
            r, color = report[key], "green" if key == "fast" else "grey"
            left.axhline(r["samples_per_s"], color=color, linestyle=style,
                         label=f"{name} ({r['samples_per_s']:,.0f}/s)")
            left.axhspan(r["rate_min"], r["rate_max"], color=color, alpha=0.12, linewidth=0)
    for n in counts if len(counts) > 1 else []:  # the labels at one count fanned out in the points' order
        here = sorted((c for c in report["cells"] if c["devices"] == n), key=lambda c: c["samples_per_s"])
        for rank, c in enumerate(here):
            mark = (" *" if c.get("noisy") else "") + (" !" if c.get("busy") else "")
            left.annotate(f"{c['samples_per_s']:,.0f}{mark}", (n + dodge[c["strategy"]], c["samples_per_s"]),
                          fontsize=7, textcoords="offset points", xytext=(8, -3 + 9 * (rank - (len(here) - 1) / 2)))
    left.set(xticks=counts, xlabel="devices" if report["hardware"]["cards"] else "CPU processes",
             ylabel="training samples/s (median epoch; bars: min to max)", title="throughput and scaling")
    values = [r["rate_max"] for r in rows(report)] + [r["rate_min"] for r in rows(report)]
    if ideal and len(counts) > 1:
        values.append(max(counts) * ideal["samples_per_s"])
    if max(values) / max(min(values), 1e-9) > 20:
        left.set_yscale("log")
    else:
        left.set_ylim(0, 1.12 * max(values))  # room above the top point for its label
    left.grid(alpha=0.3)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)  # below: never over a line
    measured = rows(report)
    most = max(len(r["peak_memory_mb"]) for r in measured)
    width = 0.8 / most
    for k in range(most):  # bar k of every row that has a k-th card / process, each row's bars centred on it
        mine = [(i, r["peak_memory_mb"]) for i, r in enumerate(measured) if k < len(r["peak_memory_mb"])]
        right.bar([i + (k - (len(m) - 1) / 2) * width for i, m in mine], [m[k] for _, m in mine], width,
                  label=f"{unit(report)} {k}")
    for k in range(most):  # inside each process's bar, hatched: what it held of params, grads and optimizer state
        mine = [(i, r, held(r)) for i, r in enumerate(measured) if held(r) and k < len(held(r))]
        right.bar([i + (k - (len(r["peak_memory_mb"]) - 1) / 2) * width for i, r, _ in mine],
                  [h[k] for _, _, h in mine], width, fill=False, hatch="//", edgecolor="black", linewidth=0,
                  label="held: params + grads + optimizer" if k == 0 and mine else None)
    right.set_xticks(range(len(measured)),
                     [f"{r['strategy']}\nx{r['devices']}" for r in measured], fontsize=8)
    right.set(ylabel=f"peak MB per {unit(report)}", title="peak memory",
              ylim=(0, 1.35 * max(max(r["peak_memory_mb"]) for r in measured)))  # the legend above the bars
    right.legend(fontsize=8)
    hw = report["hardware"]
    fig.suptitle(f"multicard bench: {report['config']['model']}; {hw['cpu']} ({hw['cores']} cores), "
                 f"{', '.join(hw['cards']) or 'no GPU'}; torch {report['torch']}; {report['date'][:10]}", fontsize=9)
    heads = [w.partition(": ")[0] for w in report.get("warnings", [])]
    if heads:  # the plot travels without the table: say on it that its numbers are in doubt
        fig.text(0.5, 0.925, "warning: " + "; ".join(heads) + " (see bench.md)", ha="center", fontsize=8,
                 color="firebrick")
    fig.tight_layout(rect=(0, 0, 1, 0.92 if heads else 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, out: Path) -> list[Path]:
    """bench.json, bench.md and bench.png in `out` (each written whole, then moved into place)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md", out / "bench.png"]
    for path, text in zip(paths[:2], (json.dumps(report, indent=2) + "\n", markdown(report) + "\n"), strict=True):
        safefs.write_file(path, text.encode())
    tmp = paths[2].with_name("bench.part.png")
    plot(report, tmp)
    os.replace(tmp, paths[2])
    return paths
