"""What multicard can see of a script's own habits around the batches it deals, and says in one line where one
would part N processes from one:

- a script that shapes tensors by its batch argument (`recon.view(args.batch_size, 1, 28, 28)`): on N processes
  a batch holds 1/N of the global batch, and torch's error names only the sizes. A shape error that names a
  global batch this process holds fewer rows of gains one line (a note under torch's message) saying so;
- a resumed loader whose first batches are pulled with no forward of a set-up model between them: the script
  skips the batches mc.load already put the loader past (islice, skip_first_batches), so they are skipped twice.
"""

from __future__ import annotations

import re
import sys
from typing import Any

_forwards = [0]  # forwards of a set-up model in this process
_batches: dict[int, int] = {}  # global batch -> this process's rows of it, where they differ
_told: set[str] = set()  # what was said already (once per process)
_hooked: list = []  # the excepthook found when ours went in


def forwarded() -> None:
    """A set-up model ran its forward (a loop between two batches, not a skip)."""
    _forwards[0] += 1


def forwards() -> int:
    return _forwards[0]


def skipped_twice(epoch: int, served: int, counts: str) -> None:
    """Said once, on stderr: a resumed pass's first two batches were pulled with no forward between them."""
    if "skip" in _told:
        return
    _told.add("skip")
    print(f"multicard: this loader was put back at its place by mc.load ({served} {counts} into epoch {epoch + 1}) "
          f"and its first batches are passed over with no forward of the set-up model: if the script skips the "
          f"batches it had served itself (islice, skip_first_batches, `if i < start: continue`), drop that skip, "
          f"or they are skipped twice", file=sys.stderr, flush=True)


def dealt(global_batch: int | None, mine: int) -> None:
    """This process holds `mine` rows of each global batch of `global_batch` (a set-up loader, mc.local)."""
    if global_batch is not None and 0 < mine < global_batch and global_batch not in _batches:
        _batches[global_batch] = mine
        if not _hooked:  # a script's error that reaches the top gets its line too (torch's own hook, if any, after)
            _hooked.append(sys.excepthook)
            sys.excepthook = _hook


def explain(error: BaseException) -> None:
    """Add one line to a shape error that names a global batch next to a smaller size this process holds (or to
    an invalid view's shape): which number is the global batch, and what to shape by."""
    if not isinstance(error, (RuntimeError, ValueError)) or not _batches or getattr(error, "_multicard_told", False):
        return
    text = str(error).split("\n")[0]
    numbers = {int(n) for n in re.findall(r"\d+", text)}
    for whole, mine in _batches.items():
        if whole in numbers and (mine in numbers or "is invalid for input of size" in text):
            error.add_note(f"multicard: {whole} is the global batch (the DataLoader's batch_size, split over the "
                           f"processes): this process holds {mine} of its rows; shape by the rows a batch holds "
                           f"(x.size(0)), or by mc.local_batch({whole})")
            error._multicard_told = True
            return


def _hook(kind: type, error: BaseException, trace: Any) -> None:
    explain(error)
    _hooked[0](kind, error, trace)
