"""Your loop: multicard.Multicard and what it hands out (the set-up model, precision, this process's part and the
collectives, the training step, loggers, memory readings, launch) and the checks that N processes take one
process's steps (replicas, outside_params, alike), all held per job by job_state.py; saving.py: mc.save and mc.load
over checkpoints/. May import errors,
rules, jobs, strategies, data, models and checkpoints; never the trainer or the tools."""
