"""Jobs: find the devices, read the job from the environment (torchrun, SLURM, our launcher), start, join,
watch and end the processes. The bottom layer: imports only errors.py (and torch); nothing here knows a model,
a strategy or a checkpoint."""
