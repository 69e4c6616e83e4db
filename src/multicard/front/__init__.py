"""The front object, multicard.Multicard, and what it hands out: the prepared model, precision, this
process's part and the collectives, checkpoints of a user's loop, loggers, memory readings, launch.
May import errors, jobs, strategies, data, models and checkpoints; never the trainer or the tools."""
