"""The one exception a user sees as a single line instead of a traceback, and the lines said without stopping."""

import sys


class UsageError(Exception):
    """Bad input (a flag, a device id, a data file, a checkpoint): say what is wrong and what to do."""

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook) shows: the one line, without the frames that led to it."""
        return [f"UsageError: {self}"]


def say(line: str) -> None:
    """A line for the user that goes on (a checkpoint moved aside, one skipped): above a progress bar, never
    through it."""
    from tqdm import tqdm  # only where something is said

    tqdm.write(f"multicard: {line}")


def note(line: str) -> None:
    """A line for the user on stderr, at once (a warning, a rank's last word before it ends)."""
    print(f"multicard: {line}", file=sys.stderr, flush=True)
