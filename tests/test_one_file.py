"""Issue 34, item 2: one checkpoint file per mc.save. Every rank's random streams go into the file rank 0 writes (no
ckpt.rank1.pt beside it) and come back to each rank on load; a save under `if mc.is_main:` still works and says what it
lacks; checkpoints written with rank files still load (but not a rank file reached through a link)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from multicard.checkpoints import files as checkpoint


def streams_back(mc, path: Path, saved: torch.Tensor) -> float:
    torch.manual_seed(99)  # the streams moved on
    mc.load(path, {"model": nn.Linear(2, 2)})
    return float(torch.equal(torch.get_rng_state(), saved))


def as_written_before(mc, path: Path, streams) -> None:
    """A checkpoint as multicard wrote it before one file held every rank's random streams: each rank's beside
    it (ckpt.rank1.pt)."""
    if mc.rank == 0:
        raw = torch.load(path, weights_only=True)
        del raw["multicard"]["ranks"]
        torch.save(raw, path)
    else:
        torch.save({"save": mc._saves, "world": mc.world_size, "rng": streams, "rank": mc.rank},
                   checkpoint.rank_file(path, mc.rank))


def every_rank_job(mc, folder: str) -> dict:
    folder = Path(folder)
    model = mc.setup(nn.Linear(2, 2))
    for save in (1, 2):  # the second save waits for the others as long as the job's timeout
        torch.manual_seed(10 * save + mc.rank)  # each rank's own streams
        saved, streams = torch.get_rng_state(), checkpoint.rng_state()
        mc.save(folder / "ckpt.pt", {"model": model})
    mc.barrier()
    files = sorted(p.name for p in folder.iterdir())
    back = streams_back(mc, folder / "ckpt.pt", saved)
    mc.barrier()
    as_written_before(mc, folder / "ckpt.pt", streams)  # the same save, as an older version wrote it
    mc.barrier()
    before = streams_back(mc, folder / "ckpt.pt", saved)
    return {"files": files, "back": mc.gather(back), "before": mc.gather(before)}


@pytest.mark.slow
def test_every_ranks_streams_go_into_the_one_file_and_come_back(tmp_path, capfd):
    found = multicard.launch(every_rank_job, str(tmp_path), strategy="ddp", devices="cpu:2")
    assert found["files"] == ["ckpt.pt"]
    assert found["back"] == [1.0, 1.0]
    assert found["before"] == [1.0, 1.0]  # a checkpoint with ckpt.rank1.pt beside it loads as before
    assert "start afresh" not in capfd.readouterr().err


def main_only_job(mc, folder: str) -> list[float]:
    folder = Path(folder)
    model = mc.setup(nn.Linear(2, 2))
    torch.manual_seed(10 + mc.rank)
    saved = torch.get_rng_state()
    for _ in range(2):
        if mc.is_main:  # the habit that deadlocks Lightning Fabric's save
            mc.save(folder / "ckpt.pt", {"model": model})
        mc.barrier()
    return mc.gather(streams_back(mc, folder / "ckpt.pt", saved))


@pytest.mark.slow  # waits 3 s for ranks that never come; the mixed test below covers it in the default suite
def test_a_save_by_rank_0_alone_keeps_its_streams_and_says_the_others_start_afresh(tmp_path, capfd):
    assert multicard.launch(main_only_job, str(tmp_path), strategy="ddp", devices="cpu:2") == [1.0, 0.0]
    err = capfd.readouterr().err
    assert err.count("ckpt.pt: no other rank saved it along with rank 0 within 3 s (a save under `if mc.is_main:`, "
                     "or a file per rank?): it holds rank 0's random streams; a rank that loads it starts its own "
                     "afresh") == 1  # said once, waited once
    assert f"rank 1: {tmp_path / 'ckpt.pt'} holds no random streams of this rank (rank 0 saved without them): " \
           f"they start afresh" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def mixed_job(mc, folder: str) -> dict:
    folder = Path(folder)
    model = mc.setup(nn.Linear(2, 2))
    for epoch in range(3):
        torch.manual_seed(10 * epoch + mc.rank)
        saved = torch.get_rng_state()
        mc.save(folder / "last.pt", {"model": model})  # every rank
        if mc.is_main:  # the best so far, on rank 0 alone: waited for once, never again
            mc.save(folder / "best.pt", {"model": model, "epoch": epoch})
        mc.all_reduce(torch.ones(1))  # the next epoch's collectives: a rank 0 still waiting would stall them
    return {"last": mc.gather(streams_back(mc, folder / "last.pt", saved))}


@pytest.mark.slow
def test_last_on_every_rank_and_best_on_rank_0_alone_neither_stalls_nor_loses_streams(tmp_path, capfd):
    """Saves counted per file name: rank 0's saves of best.pt alone never make it wait for the other ranks'
    last.pt (which would hold up their next collective until the timeout)."""
    found = multicard.launch(mixed_job, str(tmp_path), strategy="ddp", devices="cpu:2", timeout=300)
    assert found["last"] == [1.0, 1.0]
    err = capfd.readouterr().err
    assert err.count("best.pt: no other rank saved it along with rank 0 within 3 s") == 1
    assert "last.pt" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


# -- a rank's part of a checkpoint written before, through a link -----------------------------------------------------
def rank_part_job(mc, folder: str) -> list[float]:
    folder = Path(folder)
    torch.manual_seed(10 + mc.rank)
    saved = torch.get_rng_state()
    streams = checkpoint.rng_state()
    mc.save(folder / "ckpt.pt", {"x": 1})
    as_written_before(mc, folder / "ckpt.pt", streams)
    mc.barrier()
    if mc.rank == 1:  # the part moved away, and a link to it (someone else's) put in its place
        os.replace(folder / "ckpt.rank1.pt", folder / "theirs.pt")
        os.symlink(folder / "theirs.pt", folder / "ckpt.rank1.pt")
    mc.barrier()
    torch.manual_seed(99)
    mc.load(folder / "ckpt.pt")
    restored = torch.zeros(mc.world_size)
    restored[mc.rank] = float(torch.equal(torch.get_rng_state(), saved))
    return mc.all_reduce(restored).tolist()


def test_a_ranks_part_reached_through_a_link_is_not_read(tmp_path, capfd):
    assert multicard.launch(rank_part_job, str(tmp_path), strategy="ddp", devices="cpu:2") == [1.0, 0.0]
    assert "ckpt.rank1.pt is missing or from another save: this rank's random streams start afresh" in \
        capfd.readouterr().err
