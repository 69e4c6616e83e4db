"""What multicard can see of a script's own habits around the batches it deals, and says in one line where one
would part N processes from one:

- a script that shapes tensors by its batch argument (`recon.view(args.batch_size, 1, 28, 28)`): on N processes
  a batch holds 1/N of the global batch, and torch's error names only the sizes. A shape error that names a
  global batch this process holds fewer rows of gains one line (a note under torch's message) saying so;
- a resumed loader whose first batches are pulled with no forward of a set-up model between them: the script
  skips the batches mc.load already put the loader past (islice, skip_first_batches), so they are skipped twice;
- an evaluation batch with no rows (a process short of samples, as many batches in every process) that the
  script's code cannot take (`x.reshape(len(x), -1)`, pack_padded_sequence): one line naming the rank and why,
  in place of torch's error on some ranks only.
"""

from __future__ import annotations

import re

from ..errors import UsageError, note


class Habits:
    """What one job in this process saw of the script's habits (the job's state holds it): forwards of a set-up
    model, the global batches this process holds fewer rows of, what was said once, and why the evaluation batch
    now served has no rows (with what gives it some), or None."""

    def __init__(self) -> None:
        self.forwards = 0
        self.batches: dict[int, int] = {}  # global batch -> this process's rows of it, where they differ
        self.told: set[str] = set()
        self.empty: tuple[str, str] | None = None

    def forwarded(self) -> None:
        """A set-up model ran its forward (a loop between two batches, not a skip)."""
        self.forwards += 1

    def skipped_twice(self, epoch: int, served: int, counts: str) -> None:
        """Said once, on stderr: a resumed pass's first two batches were pulled with no forward between them."""
        if "skip" in self.told:
            return
        self.told.add("skip")
        note(f"this loader was put back at its place by mc.load ({served} {counts} into epoch {epoch + 1}) "
             f"and its first batches are passed over with no forward of the set-up model: if the script skips the "
             f"batches it had served itself (islice, skip_first_batches, `if i < start: continue`), drop that skip, "
             f"or they are skipped twice")

    def dealt(self, global_batch: int | None, mine: int) -> None:
        """This process holds `mine` rows of each global batch of `global_batch` (a set-up loader, mc.local)."""
        if global_batch is not None and 0 < mine < global_batch:
            self.batches.setdefault(global_batch, mine)

    def served_empty(self, why: tuple[str, str] | None) -> None:
        """The batch being served has no rows (`why`: why, and what gives the rank some), or (None) one has rows
        again. An error while it is out is read as caused by it."""
        self.empty = why

    def emptied(self, error: BaseException) -> UsageError | None:
        """The one line for an error raised while this process holds an evaluation batch with no rows."""
        if self.empty is None or not isinstance(error, (RuntimeError, ValueError, IndexError)):
            return None
        why, fix = self.empty
        return UsageError(f"{why}, and the code that took it failed ({str(error).strip().splitlines()[0]}): let it "
                          f"take an empty batch (x.flatten(1), not x.reshape(len(x), -1); skip what cannot, such as "
                          f"pack_padded_sequence, when len(x) == 0, still calling every collective), or {fix}")

    def explain(self, error: BaseException) -> UsageError | None:
        """An error on an evaluation batch with no rows: its one line (returned). A shape error that names a
        global batch next to a smaller size this process holds (or an invalid view's shape): one line added
        under torch's message, saying which number is the global batch and what to shape by (None returned)."""
        said = self.emptied(error)
        if said is not None:
            return said
        if not isinstance(error, (RuntimeError, ValueError)) or not self.batches or \
                getattr(error, "_multicard_told", False):
            return None
        text = str(error).split("\n")[0]
        numbers = {int(n) for n in re.findall(r"\d+", text)}
        for whole, mine in self.batches.items():
            if whole in numbers and (mine in numbers or "is invalid for input of size" in text):
                error.add_note(f"multicard: {whole} is the global batch (the DataLoader's batch_size, split over the "
                               f"processes): this process holds {mine} of its rows; shape by the rows a batch holds "
                               f"(x.size(0)), or by mc.local_batch({whole})")
                error._multicard_told = True
                return None
        return None
