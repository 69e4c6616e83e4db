"""Issue 33, items 1 and 3 (ours): a user who can write into --out renames a folder multicard has just made and puts
a link to a victim folder in its place (the run folder, step-N.part, a user's fsdp ckpt.shards-N); an --out or
checkpoints folder others can write into, or another user's; an fsdp checkpoint on a full disk; a refused
--resume that still claimed the checkpoints; torch's advice to load a refused pickle with weights_only=False.

The other user is played in this process (same uid), at the moment the race would be won: right after the folder
is made, or while the run writes into it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import tiny_images
from multicard.checkpoints import saves, shards, shards_read
from multicard.errors import UsageError
from multicard.trainer.outdir import Output
from multicard.trainer.report import Report
from test_hostile3 import train


@pytest.fixture
def victim(tmp_path) -> Path:
    """Somebody's folder outside --out, with files the run must never touch."""
    folder = tmp_path / "victim"
    folder.mkdir()
    for name in ("model.pt", "state.pt"):
        (folder / name).write_text(f"the victim's {name}")
    return folder


def untouched(victim: Path) -> bool:
    return sorted(p.name for p in victim.iterdir()) == ["model.pt", "state.pt"] and \
        all((victim / name).read_text() == f"the victim's {name}" for name in ("model.pt", "state.pt"))


def swap(folder: Path, victim: Path) -> None:
    """The other user: the folder renamed away (it stays in its place's folder), a link to the victim put there."""
    os.replace(folder, folder.with_name("moved-away"))
    os.symlink(victim, folder)


# -- the race: a folder multicard made, swapped for a link -----------------------------------------------------------
def test_a_run_folder_swapped_right_after_it_was_made_is_never_written_through(tmp_path, victim, monkeypatch):
    out, made = tmp_path / "out", Output.new_run

    def new_run(self):
        run = made(self)
        swap(Path(run), victim)
        return run

    monkeypatch.setattr(Output, "new_run", new_run)
    with pytest.raises(UsageError, match=r"run folder .*\.run-.*: was replaced after multicard made it"):
        train(out)
    assert untouched(victim) and not (out / ".current").exists() and not (out / "model.pt").exists()


def test_a_run_folder_swapped_while_the_run_writes_is_never_written_through_nor_shown(tmp_path, victim, monkeypatch):
    out, finish = tmp_path / "out", Report.finish

    def finishing(self, *args):
        swap(next(out.glob(".run-*")), victim)  # after the epochs, before model.pt and the summary
        return finish(self, *args)

    monkeypatch.setattr(Report, "finish", finishing)
    with pytest.raises(UsageError, match=r"run folder .*: was replaced while the run wrote into it .*; --out .* left "
                                         r"as it was"):
        train(out)
    assert untouched(victim) and not (out / ".current").exists()
    assert (out / "moved-away" / "model.pt").is_file()  # the run's files are in the folder it made, moved


def test_a_checkpoint_part_folder_swapped_right_after_it_was_made_is_never_written_through(tmp_path, victim,
                                                                                           monkeypatch):
    out, fresh = tmp_path / "out", saves.fresh
    swapped = []

    def freshly(*args):
        made = fresh(*args)
        if not swapped:
            part = next(a for a in args if isinstance(a, Path))
            swap(part, victim)
            swapped.append(part)
        return made

    monkeypatch.setattr(saves, "fresh", freshly)
    with pytest.raises(UsageError, match=r"step-00000001\.part: was replaced while the checkpoint was written into "
                                         r"it .*run again with --resume auto"):
        train(out, save_every_steps=1)
    assert untouched(victim)
    assert sorted(p.name for p in (out / "checkpoints" / "moved-away").iterdir()) == [".multicard", "state.pt"]


def fsdp_job(mc, folder: str) -> dict:
    """A user's fsdp loop: a save whose shards folder rank 0 made is swapped for a link by the other user; then
    a save onto a disk that fills up under rank 1."""
    folder = Path(folder)
    torch.manual_seed(0)  # the same weights on every rank: fsdp copies none between them (the replica check)
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    said = {}
    if mc.rank == 0:
        made = shards.fresh

        def fresh(path, save):
            held = made(path, save)
            swap(path.with_name(Path(getattr(held, "shown", held)).name), folder / "victim")
            shards.fresh = made
            return held

        shards.fresh = fresh  # in this process only
    for case in ("swapped", "full"):
        if case == "full" and mc.rank == 1:
            import torch.distributed.checkpoint.filesystem as dcp_files

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            dcp_files._write_item = full
        try:
            mc.save(folder / "ckpt.pt", {"model": model})
            said[case] = ""
        except UsageError as e:
            said[case] = str(e)
    return mc.gather(said)


@pytest.mark.slow
def test_fsdp_shards_folder_swapped_and_a_full_disk_are_one_line_on_every_rank(tmp_path, victim, capfd):
    said = multicard.launch(fsdp_job, str(tmp_path), strategy="fsdp", devices="cpu:2")
    assert untouched(victim)
    for rank in said:
        assert rank["swapped"] == f"shards folder {tmp_path / 'ckpt.shards-1'}: was replaced after multicard made it " \
                                  f"(by a user who can write into its folder?); nothing was written there"
        assert rank["full"].startswith(f"cannot write {tmp_path / 'ckpt.shards-2'} (No space left on device: free "
                                       f"space on that filesystem, or choose another place)")
        assert "\n" not in rank["full"]
    assert "Traceback" not in capfd.readouterr().err
    assert not (tmp_path / "ckpt.pt").exists()  # no checkpoint names either folder


# -- folders others can write into -----------------------------------------------------------------------------------
def test_an_out_others_can_write_into_is_refused_unless_sticky(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    with pytest.raises(UsageError, match=rf"--out {out}: other users can write into it \(drwxrwxrwx\) and could swap "
                                         rf"what multicard makes there for a link elsewhere; run `chmod go-w {out}`"):
        train(out)
    assert list(out.iterdir()) == []
    out.chmod(0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
    train(out)
    assert (out / "model.pt").is_file()


def test_a_checkpoints_folder_others_can_write_into_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints").chmod(0o775)
    with pytest.raises(UsageError, match=r"checkpoints: other users can write into it \(drwxrwxr-x\)"):
        train(tmp_path, save_every_steps=1)
    assert list(tmp_path.iterdir()) == [tmp_path / "checkpoints"]


def test_an_out_of_another_user_is_refused(tmp_path, monkeypatch):
    mine, fstat = os.stat(tmp_path), os.fstat

    def theirs(fd):  # what fstat says of --out: owned by nobody (65534)
        found = fstat(fd)
        if (found.st_dev, found.st_ino) != (mine.st_dev, mine.st_ino):
            return found
        return os.stat_result((found.st_mode, found.st_ino, found.st_dev, found.st_nlink, 65534, found.st_gid,
                               found.st_size, int(found.st_atime), int(found.st_mtime), int(found.st_ctime)))

    monkeypatch.setattr(os, "fstat", theirs)
    with pytest.raises(UsageError, match=r"belongs to another user \(uid 65534\), who could swap what multicard makes"):
        train(tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- a refused --resume, and torch's advice --------------------------------------------------------------------------
def test_a_refused_resume_claims_nothing(tmp_path):
    train(tmp_path, save_every_steps=1)
    checkpoints = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match=r"--resume .*step-00000001/state\.pt: its model does not fit the model"):
        multicard.train(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), tiny_images(48), None, out=str(tmp_path),
                        quiet=True, strategy="single", devices="cpu", batch_size=24,
                        resume=str(checkpoints / "step-00000001"))
    assert {p.name: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()} == before


def test_a_planted_value_in_shards_is_refused_without_torchs_advice(tmp_path):
    import io

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    value = io.BytesIO()
    torch.save(Planted(), value)
    value.seek(0)
    with pytest.raises(UsageError) as refused:
        shards_read.planner().load_bytes(None, value)
    assert "system" in str(refused.value) and "weights_only" not in str(refused.value)
    assert "False" not in str(refused.value) and not (tmp_path / "ran").exists()
