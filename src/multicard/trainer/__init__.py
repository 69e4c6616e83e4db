"""Our loop: TrainConfig and its recipe (a resumed run's too), the training loop (written on the Multicard only),
the run with its resume decision and --out folder (its checkpoints: checkpoints/resume.py and trainer_saves.py), reports
and observation. May import every layer below (yourloop, checkpoints, models, data, strategies, jobs); never the
tools or the CLI."""
