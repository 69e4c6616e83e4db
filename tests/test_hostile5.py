"""Issue 26, checked again by hand: paths made of what a file says (run.json's "from", a checkpoint's shards
folder), a rank's part read through a link, fsdp saves of a user's loop that deleted or wrote through what the
user had beside the checkpoint, a predictable name for publish's links, a refused claim that left a run folder,
and fsdp metadata far larger than the model's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from multicard import safefs
from multicard.checkpoints import plain as checkpoint
from multicard.checkpoints import resume, shards
from multicard.errors import UsageError
from multicard.trainer import start
from multicard.trainer.config import TrainConfig
from test_hostile3 import OLD, earlier, train


# -- a path made of what a file says -------------------------------------------------------------------------------
def owned_from(out: Path, started: str) -> None:
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "run.json").write_text(json.dumps({"run": OLD, "from": started}))


def test_run_json_naming_a_checkpoint_elsewhere_is_one_line_not_a_resume_from_there(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    train(elsewhere, save_every_steps=1)
    theirs = next(elsewhere.glob("checkpoints/step-*/state.pt"))
    out = tmp_path / "out"
    owned_from(out, str(theirs))  # planted, or a run that began from --resume elsewhere and wrote nothing yet
    with pytest.raises(UsageError, match=r"--resume auto: the run in .* started from .*, which is not a checkpoint "
                                         r"in --out, and wrote none of its own: to go on from there, give it as "
                                         r"--resume; to start over, leave --resume out"):
        train(out, resume="auto")
    assert not list(out.glob(".run-*")) and not (out / "model.pt").exists()
    # the user who means it says so, and the run goes on from there
    assert train(out, resume=str(theirs))["optimizer_steps"] == 2


def test_run_json_naming_a_checkpoint_in_out_resumes_the_one_found_there(tmp_path):
    made = earlier(tmp_path, steps=(1, 2))
    aside = tmp_path / "checkpoints" / f"run-{OLD}"
    aside.mkdir()
    os.replace(made[0], aside / made[0].name)
    (tmp_path / "checkpoints" / "run.json").write_text(json.dumps(
        {"run": "20250101T000000-123456", "from": str(aside / made[0].name / "state.pt")}))
    assert resume.newest(tmp_path / "checkpoints") == aside / made[0].name / "state.pt"


def test_a_restart_before_the_first_checkpoint_goes_on_from_where_the_run_began(tmp_path):
    """The start is known to the job; run.json's word for it is not needed (nor taken)."""
    elsewhere = tmp_path / "elsewhere"
    train(elsewhere, save_every_steps=1)
    theirs = next(elsewhere.glob("checkpoints/step-*/state.pt"))
    out = tmp_path / "out"
    owned_from(out, str(theirs))
    config = TrainConfig(out=str(out), resume="auto", devices="cpu", strategy="single", batch_size=24, epochs=1)
    again = start.restart(start.Start(config, theirs, ""))
    assert again.checkpoint == theirs and again.line.startswith(f"resuming from {theirs}")


def test_a_shards_folder_named_by_a_checkpoint_is_a_name_beside_it(tmp_path):
    outside = tmp_path / "outside" / "shards"
    outside.mkdir(parents=True)
    path = tmp_path / "out" / "state.pt"
    for forged in ("../../outside/shards", str(outside), "state.shards-1/../../outside", 7):
        with pytest.raises(UsageError, match=r"its shards folder is not one multicard names"):
            shards.load(path, {"folder": forged, "models": ["model"], "optimizers": []}, {"model": nn.Linear(2, 2)},
                        lambda m: m)


# -- a rank's part of a checkpoint, through a link -----------------------------------------------------------------
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


# -- fsdp saves in a user's loop -----------------------------------------------------------------------------------
def fsdp_saves_job(mc, folder: str) -> dict:
    folder = Path(folder)
    torch.manual_seed(0)  # the same weights in every process: fsdp copies none (the replica check compares them)
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    for _ in range(2):
        mc.save(folder / "ckpt.pt", {"model": model})
    named = torch.load(folder / "ckpt.pt", weights_only=True)["multicard"]["shards"]["folder"]
    mc.barrier()
    if mc.rank == 0:  # a .metadata far beyond what this model's index takes (a pickle ignores the tail)
        with open(folder / named / ".metadata", "r+b") as f:
            f.truncate(64 << 20)
    mc.barrier()
    try:
        mc.load(folder / "ckpt.pt", {"model": model})
        refused = ""
    except UsageError as e:
        refused = str(e)
    return {"named": named, "refused": refused}


@pytest.mark.slow
def test_fsdp_saves_keep_what_the_user_had_beside_the_checkpoint(tmp_path):
    (tmp_path / "ckpt.shards-mybackup").mkdir()
    (tmp_path / "ckpt.shards-mybackup" / "notes.txt").write_text("precious")
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, tmp_path / "ckpt.shards-1")  # planted where the first save's folder would go
    (tmp_path / "ckpt.shards-9").mkdir()
    (tmp_path / "ckpt.shards-9" / "mine.txt").write_text("mine")  # a save's name, but not what DCP writes
    found = multicard.launch(fsdp_saves_job, str(tmp_path), strategy="fsdp", devices="cpu:2")
    assert (tmp_path / "ckpt.shards-mybackup" / "notes.txt").read_text() == "precious"
    assert (tmp_path / "ckpt.shards-9" / "mine.txt").read_text() == "mine"
    assert list(victim.iterdir()) == [] and os.readlink(tmp_path / "ckpt.shards-1") == str(victim)
    assert found["named"] == "ckpt.shards-3"  # shards-1 taken by the link; shards-2, the first save's, dropped
    assert safefs.kind(tmp_path / "ckpt.shards-2") is None
    assert found["refused"].startswith(f"shards folder {tmp_path / 'ckpt.shards-3'}: .metadata: is 67108864 bytes, "
                                       f"more than the ")


# -- --out ---------------------------------------------------------------------------------------------------------
def test_publish_makes_its_links_under_names_nobody_can_plant_in_advance(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.pt", ".current", "summary.json"):  # the names links were once made under
        (out / f"{name}.{os.getpid()}.part").mkdir()
    train(out)
    assert (out / "model.pt").is_file() and (out / ".current").is_symlink()
    assert all((out / f"{name}.{os.getpid()}.part").is_dir() for name in ("model.pt", ".current", "summary.json"))


def test_a_refused_claim_leaves_no_run_folder_in_out(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    os.mkfifo(tmp_path / "checkpoints" / "run.json")
    with pytest.raises(UsageError, match=r"run\.json: is a fifo"):
        train(tmp_path, save_every_steps=1)
    assert not list(tmp_path.glob(".run-*"))
    shutil.rmtree(tmp_path / "checkpoints")
