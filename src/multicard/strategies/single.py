"""single: one process on the CPU or one card. The base class already is exactly that."""

from .base import Strategy


class Single(Strategy):
    name = "single"
