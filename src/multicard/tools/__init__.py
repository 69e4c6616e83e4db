"""Tools on top of the trainer: the bench (strategies side by side) and its report, the parity check
(`multicard check`; with a script, check_script.py, recorder.py inside each rank), and `multicard run`'s start of
the user's own script. The top layer under cli.py: may import every layer below it."""
