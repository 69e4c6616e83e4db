"""The one exception a user sees as a single line instead of a traceback."""


class UsageError(Exception):
    """Bad input (a flag, a device id, a data file, a checkpoint): say what is wrong and what to do."""
