"""The bench's files: bench.json, bench.md and the PNG plot (throughput and scaling, peak memory per card or process,
and what each held of parameters, gradients and optimizer state, on a scale of its own). Imported only when a bench
runs: matplotlib loads here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import safefs
from .bench_report import KINDS, markdown, mb, rows, unit


def plot(report: dict, path: Path) -> list[str]:
    """Writes the PNG; returns each panel's title, then every number written on the held panel (for the tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = rows(report)
    shares = [(i, r) for i, r in enumerate(measured) if r.get("shard_mb") and all(r["shard_mb"])]
    fig, (left, right, *parts) = plt.subplots(1, 3 if shares else 2, figsize=(17 if shares else 12, 5.4),
                                              width_ratios=[1.1, 1, 1] if shares else None)
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
    most = max(len(r["peak_memory_mb"]) for r in measured)
    width = 0.8 / most
    for k in range(most):  # bar k of every row that has a k-th card / process, each row's bars centred on it
        mine = [(i, r["peak_memory_mb"]) for i, r in enumerate(measured) if k < len(r["peak_memory_mb"])]
        right.bar([i + (k - (len(m) - 1) / 2) * width for i, m in mine], [m[k] for _, m in mine], width,
                  label=f"{unit(report)} {k}")
    right.set_xticks(range(len(measured)),
                     [f"{r['strategy']}\nx{r['devices']}" for r in measured], fontsize=8)
    right.set(ylabel=f"peak MB per {unit(report)}", title="peak memory",
              ylim=(0, 1.35 * max(max(r["peak_memory_mb"]) for r in measured)))  # the legend above the bars
    right.legend(fontsize=8)
    if shares:
        held_panel(parts[0], report, shares)
    hw = report["hardware"]
    fig.suptitle(f"multicard bench: {report['config']['model']}; {hw['cpu']} ({hw['cores']} cores), "
                 f"{', '.join(hw['cards']) or 'no GPU'}; torch {report['torch']}; {report['date'][:10]}", fontsize=9)
    heads = [w.partition(": ")[0] for w in report.get("warnings", [])]
    if heads:  # the plot travels without the table: say on it that its numbers are in doubt
        fig.text(0.5, 0.925, "warning: " + "; ".join(heads) + " (see bench.md)", ha="center", fontsize=8,
                 color="firebrick")
    fig.tight_layout(rect=(0, 0, 1, 0.92 if heads else 1))
    fig.savefig(path, dpi=120)
    said = [ax.get_title() for ax in fig.axes] + [t.get_text() for ax in parts for t in ax.texts]
    plt.close(fig)
    return said


def held_panel(ax, report: dict, shares: list[tuple[int, dict]]) -> None:
    """What each process held at the first optimizer step, stacked by kind on a scale of its own (beside a peak of
    hundreds of MB a small model's few MB would not show), each part labelled with its MB where it has room."""
    width = 0.8 / max(len(r["shard_mb"]) for _, r in shares)
    bars = [(i + (k - (len(r["shard_mb"]) - 1) / 2) * width, s) for i, r in shares for k, s in enumerate(r["shard_mb"])]
    highest = max(sum(s[kind] for kind in KINDS) for _, s in bars)
    bottom = [0.0] * len(bars)
    for kind, color in zip(KINDS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        sizes = [s[kind] for _, s in bars]
        ax.bar([x for x, _ in bars], sizes, width * 0.9, bottom=bottom, color=color, edgecolor="white", label=kind)
        for (x, _), low, size in zip(bars, bottom, sizes, strict=True):
            if size > 0.08 * highest:
                ax.text(x, low + size / 2, mb(size), ha="center", va="center", fontsize=7, color="white")
        bottom = [b + v for b, v in zip(bottom, sizes, strict=True)]
    for (x, _), top in zip(bars, bottom, strict=True):  # each process's whole, above its bar
        ax.annotate(mb(top), (x, top), ha="center", va="bottom", fontsize=7, textcoords="offset points",
                    xytext=(0, 2))
    ax.set_xticks([i for i, _ in shares], [f"{r['strategy']}\nx{r['devices']}" for _, r in shares], fontsize=8)
    ax.set(ylabel=f"MB per {unit(report)}", ylim=(0, 1.3 * highest),
           title="held at the first step (each process)")
    ax.legend(fontsize=8, loc="upper right")


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
