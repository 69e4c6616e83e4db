"""Tools on top of the trainer: the bench (strategies side by side) and its report, and the parity check
(`multicard check`). The top layer under cli.py: may import every layer below it."""
