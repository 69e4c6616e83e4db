"""The one exception a user sees as a single line instead of a traceback."""


class UsageError(Exception):
    """Bad input (a flag, a device id, a data file, a checkpoint): say what is wrong and what to do."""

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook) shows: the one line, without the frames that led to it."""
        return [f"UsageError: {self}"]
