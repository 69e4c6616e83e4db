"""Checkpoints on disk: plain unwrapped state_dicts (multicard.save / load, read with weights_only) and fsdp's
sharded folders (torch.distributed.checkpoint, its metadata read through an allow-list). May import errors,
jobs, strategies, data and models; never the front object or the trainer."""
