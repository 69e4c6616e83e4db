"""Our loop: TrainConfig and its recipe, the training loop (written on the front object only), the run with
its resume decision and --out folder, reports and observation. May import every layer below (front, checkpoints,
models, data, strategies, jobs); never the tools or the CLI."""
