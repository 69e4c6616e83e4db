"""Checkpoints: everything that decides what goes into a checkpoint file and how it is written, checked and read
back. The Multicard (yourloop/) and the trainer (trainer/) call these; nothing here imports either.

- files.py: one file, written atomically and read with weights_only (multicard.save / load), models unwrapped,
  random streams; the entry points for any state_dict.
- sums.py: each file's checksums, recorded at save and checked at load: damage is named, never unpickled.
- shards.py: fsdp's sharded folders (torch.distributed.checkpoint), each rank its part, written through folders
  held open; shards_read.py: read back through an allow-list (nothing a planted file holds runs).
- randoms.py: every rank's random streams into the one file of an mc.save; no save on any rank dropped.
- resume.py: the trainer's checkpoints in --out/checkpoints, read: which are whole, whose, which --resume names.
- trainer_saves.py: the trainer's checkpoints written: claimed for a run, made whole, pruned, nothing deleted that
  is not multicard's.
May import errors, safefs, jobs, strategies, data and models; never yourloop/, the trainer or the tools."""
