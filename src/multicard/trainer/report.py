"""What rank 0 of a training run writes into its run folder and prints: a line per epoch, then the model, the
metrics, the curves and the summary (outdir.Output shows them in --out)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

from tqdm import tqdm

from ..checkpoints import files as checkpoint
from ..errors import say
from ..jobs.trees import rebuild, values
from .config import TrainConfig
from .observe import crowded, curves, straggles

# tqdm's own lock is a multiprocessing one, registered with the resource tracker the job's processes share: a rank
# killed outright (frozen, then SIGKILLed) would leave it behind as a "leaked semaphore" warning. Each process
# writes its own lines, so a lock of its threads is all the bar needs.
tqdm.set_lock(threading.RLock())


def strict(obj):
    """Summary values as strict JSON: a number that is not finite (an empty evaluation's nan) becomes null."""
    return rebuild(obj, (None if isinstance(v, float) and not math.isfinite(v) else v for v in values(obj)))


class Report:
    """What rank 0 writes into this run's folder: a line per epoch (metrics.jsonl, appended as the run goes),
    then the model, curves.png (every epoch, a resumed run's earlier ones too) and the summary. Output.publish
    shows them in --out once the whole run has ended well."""

    def __init__(self, run: Path | None, config: TrainConfig, title: str = ""):
        self.run, self.config, self.active, self.title = run, config, run is not None, title
        self.warned: set[int | str] = set()  # stragglers named once (the epoch line goes on showing the lag)

    def epoch(self, history: list[dict]) -> None:
        """The epochs so far (a resumed run's include those before it), the last one new: metrics.jsonl
        rewritten (a few KB, in this run's own folder), and a line for the new one."""
        if not self.active:
            return
        (self.run / "metrics.jsonl").write_text("".join(json.dumps(strict(r)) + "\n" for r in history))
        record = history[-1]
        if self.config.quiet:
            return
        acc = f"  test acc {record['test_accuracy']:.2%}" if "test_accuracy" in record else ""
        ranks = f"  slowest rank {record['slowest_rank']} +{record['lag']:.0%}" \
            if len(record.get("rank_seconds", ())) > 1 else ""
        say(f"epoch {record['epoch']}/{self.config.epochs}  train loss {record['train_loss']:.4f}{acc}  "
            f"lr {record['lr']:.1e}  {record['samples_per_s']:,.0f} samples/s  {record['seconds']:.1f} s{ranks}")
        if straggles(record):
            self.straggler(record, f" in epoch {record['epoch']}")

    def straggler(self, record: dict, when: str) -> None:
        """A warning naming the slow rank, once per rank; on a machine with fewer cores than processes, one line
        saying so instead (once)."""
        busy = crowded(len(record["rank_seconds"]))
        key = "crowded" if busy else record["slowest_rank"]
        if key not in self.warned:
            self.warned.add(key)
            say(busy if busy else "warning: " + straggling(record, when))

    def finish(self, summary: dict, model_state: dict, history: list[dict]) -> None:
        """The run's files; `history` holds every epoch (a resume of a finished run trains none, and writes its
        files again from the checkpoint's)."""
        (self.run / "metrics.jsonl").write_text("".join(json.dumps(strict(r)) + "\n" for r in history))
        checkpoint.write_atomic(model_state, self.run / "model.pt")
        curves(history, self.run / "curves.png", self.title)
        (self.run / "summary.json").write_text(json.dumps(strict(summary), indent=2, allow_nan=False) + "\n")
        acc = f"test accuracy {summary['test_accuracy']:.2%} on {summary['test_samples']}, " \
            if "test_accuracy" in summary else ""
        memory_line = ", ".join(f"{m:,.0f}" for m in summary["peak_memory_mb"])
        busy = crowded(len(summary["rank_seconds"]))
        used = ", ".join(f"{m:,.0f}" for m in summary["card_used_mb"])
        say(f"done: {acc}{summary['train_samples_per_s']:,.0f} train samples/s, {summary['wall_s']:.1f} s; "
            f"peak memory MB per {'card' if summary['devices'][0] != 'cpu' else 'process'}: [{memory_line}]"
            + (f"; in use per card (NVML): [{used}]" if used else "")
            + (f"; {straggling(summary, ' over the run')}" if straggles(summary) and not busy else ""))
        if straggles(summary) and busy:
            self.straggler(summary, " over the run")


def straggling(record: dict, when: str) -> str:
    """Names the straggler of an epoch's record or of the summary (both hold rank_seconds, slowest_rank, lag)."""
    seconds = record["rank_seconds"]
    return (f"rank {record['slowest_rank']} is a straggler{when}: its own time was {record['lag']:.0%} over the "
            f"median rank's ({', '.join(f'{s:.3g}' for s in seconds)} s per rank)")
