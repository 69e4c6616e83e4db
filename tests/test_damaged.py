"""Issue 33, item 2: a damaged checkpoint loads silently. A bit flipped in a tensor's bytes (model.pt, a checkpoint's
state.pt, a user's mc.save file, an fsdp shard file) is one line naming the file; --resume auto goes on from the next
older checkpoint and says so; a run.json that names no run is said, not ignored; a state.pt cut short, a damaged
model.pt given to --resume and a flipped byte in fsdp's .metadata are named as what they are."""

from __future__ import annotations

import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import light, train
from multicard.checkpoints import files as checkpoint
from multicard.checkpoints import resume
from multicard.errors import UsageError
from multicard.models import LeNet5
from multicard.trainer.config import TrainConfig
from multicard.trainer.start import Start, decide


def flip(path: Path, entry: str = "data/0", at: int = 10) -> None:
    """One bit flipped in the bytes of a zip entry of a torch.save file (a tensor's, for data/N)."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/" + entry))
    raw = bytearray(path.read_bytes())
    name, extra = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    raw[info.header_offset + 30 + name + extra + at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_model_pt_is_one_line_naming_it(tmp_path):
    path = checkpoint.save(nn.Linear(20, 20), tmp_path / "model.pt")
    flip(path)
    torch.load(path, weights_only=True)  # what torch alone does: loads the damaged weights without a word
    with pytest.raises(UsageError) as refused:
        checkpoint.load(nn.Linear(20, 20), path)
    assert str(refused.value) == f"checkpoint {path}: damaged: its data/0 fails its CRC-32, so its bytes are not " \
                                 f"those its save wrote; load an earlier checkpoint, or write this one again"


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_users_damaged_checkpoint_is_one_line_on_load(tmp_path, strategy):
    mc = multicard.Multicard(strategy, "cpu")
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    mc.save(tmp_path / "ckpt.pt", state)
    mc.load(tmp_path / "ckpt.pt", state)  # whole, it loads
    if strategy == "fsdp":
        shard = next((tmp_path / "ckpt.shards-1").glob("__0_*.distcp"))
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        shard.write_bytes(bytes(raw))
        damaged = f"its shard file {shard.name} fails its CRC-32"
    else:
        flip(tmp_path / "ckpt.pt", "data/1")
        damaged = "its data/1 fails its CRC-32"
    with pytest.raises(UsageError, match=rf"^checkpoint {tmp_path / 'ckpt.pt'}: damaged: {damaged}, so its bytes"):
        mc.load(tmp_path / "ckpt.pt", state)
    mc.close()


def test_resume_auto_goes_on_from_the_next_older_sound_checkpoint_and_says_so(tmp_path, capsys):
    train(tmp_path, save_every_steps=1, keep_checkpoints=0)
    older, newer = resume.whole(tmp_path)
    flip(newer / "state.pt")
    with pytest.raises(UsageError, match=r"--resume .*step-00000002/state\.pt: damaged: its state\.pt: its data/0 "
                                         r"fails its CRC-32, so its bytes are not those its save wrote"):
        train(tmp_path / "other", resume=str(newer))  # named by the user: refused, not replaced by another
    capsys.readouterr()
    summary = train(tmp_path, resume="auto")
    assert summary["resumed_from"] == str(older / "state.pt")
    said = capsys.readouterr().out
    assert f"multicard: resuming from {older / 'state.pt'} (epoch 1, 24 samples in, after 1 optimizer steps); not " \
           f"from the newer {newer.name} is damaged (its state.pt: its data/0 fails its CRC-32)" in said


def test_resume_auto_where_every_checkpoint_is_damaged_is_one_line(tmp_path):
    train(tmp_path, save_every_steps=1, keep_checkpoints=0)
    for step in resume.whole(tmp_path):
        flip(step / "state.pt", "data.pkl")
    with pytest.raises(UsageError, match=r"--resume auto: every checkpoint it could go on from in .* is damaged "
                                         r"\(step-00000002 is damaged \(its state\.pt: its data\.pkl fails"):
        train(tmp_path, resume="auto")


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"run": 7}'], ids=["empty", "not-json", "no-run"])
def test_a_run_json_that_names_no_run_is_said(tmp_path, capsys, content):
    train(tmp_path, save_every_steps=1)
    (tmp_path / "checkpoints" / "run.json").write_bytes(content)
    capsys.readouterr()
    train(tmp_path, save_every_steps=1)
    what = {b"": "is empty", b"{not json": "is not JSON"}.get(content, "names no run as multicard writes it")
    assert f"multicard: {tmp_path / 'checkpoints' / 'run.json'} {what}: ignored (it names no run that owns the " \
           f"checkpoints there); this run claims them anew" in capsys.readouterr().out


# -- issue 47, item 3: any damage passed over, whatever the file's first bytes ---------------------------------------
def sparse_zip(path: Path, size: int = 2**40) -> None:
    """A zip whose one stored entry records `size` bytes, every one of them a hole: 1 TB that take 8 KB of disk."""
    name = b"archive/data/0"
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0x21, 0, 0xFFFFFFFF, 0xFFFFFFFF, len(name), 20)
                + name + struct.pack("<HHQQ", 1, 16, size, size))
        f.seek(size, os.SEEK_CUR)
        directory = f.tell()
        f.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0x21, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                            len(name), 28, 0, 0, 0, 0, 0xFFFFFFFF) + name + struct.pack("<HHQQQ", 1, 24, size, size, 0))
        end = f.tell()
        f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, 1, 1, end - directory, directory))
        f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))


def torn(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:4096] = bytes(4096)  # the first page never reached the disk
    path.write_bytes(bytes(raw))


DAMAGE = {  # what a crash, a full disk or a careless hand leaves of a state.pt
    "emptied": lambda p: p.write_bytes(b""),
    "zero-filled": lambda p: p.write_bytes(bytes(p.stat().st_size)),
    "text": lambda p: p.write_text("a note, not a checkpoint\n"),
    "torn-first-page": torn,
    "cut-short": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "flipped-bit": flip,
    "sparse": sparse_zip,
}
WORDS = {  # what the line says of each
    "emptied": "its state.pt is empty", "zero-filled": "zero bytes (a torn or zero-filled write)",
    "text": "not a zip archive as torch.save writes (it begins b'a note, not '", "torn-first-page": "zero bytes",
    "cut-short": "its state.pt", "flipped-bit": "fails its CRC-32", "sparse": "a sparse file, which no save writes",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An --out whose run kept a checkpoint at each of its 4 steps."""
    out = tmp_path_factory.mktemp("saved")
    train(out, save_every_steps=1, keep_checkpoints=0, epochs=2)
    return out


def damaged_copy(saved: Path, where: Path, kind: str, newest: int) -> list[Path]:
    """A copy of `saved` whose `newest` newest state.pt are damaged as `kind` says; its checkpoints, oldest first."""
    shutil.copytree(saved, where, symlinks=True)
    steps = resume.whole(where)
    for step in steps[len(steps) - newest:]:
        DAMAGE[kind](step / "state.pt")
    return steps


def auto(out: Path, **given) -> Start:
    return decide(TrainConfig(out=str(out), resume="auto", strategy="single", devices="cpu", **given), set(given), 1,
                  LeNet5())


@pytest.mark.parametrize("newest", [1, 2, 4], ids=["newest", "two-newest", "every"])
@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_auto_passes_over_any_damage_naming_each_one(saved, tmp_path, kind, newest):
    steps = damaged_copy(saved, tmp_path / "out", kind, newest)
    if newest == len(steps):
        with pytest.raises(UsageError) as refused:
            auto(tmp_path / "out")
        assert str(refused.value).startswith(f"--resume auto: every checkpoint it could go on from in "
                                             f"{tmp_path / 'out' / 'checkpoints'} is damaged (step-00000004 is ")
        assert WORDS[kind] in str(refused.value) and "\n" not in str(refused.value)
        return
    start = auto(tmp_path / "out")
    assert start.checkpoint == steps[-newest - 1] / "state.pt"
    passed = start.line.split("; not from the newer ", 1)[1].split(", nor ")
    assert [p.split()[0] for p in passed] == [s.name for s in reversed(steps[-newest:])]
    assert all(WORDS[kind] in p for p in passed), passed


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_naming_a_damaged_checkpoint_is_one_line_naming_it(saved, tmp_path, kind):
    path = damaged_copy(saved, tmp_path / "out", kind, 1)[-1] / "state.pt"
    with pytest.raises(UsageError) as refused:
        decide(TrainConfig(out=str(tmp_path / "other"), resume=str(path)), set())
    said = str(refused.value)
    assert said.startswith(f"--resume {path}: ") and "\n" not in said and "resume from another checkpoint" in said
    assert not (tmp_path / "other").exists()


def test_a_run_resumed_past_a_zero_filled_newest_goes_on_from_the_one_before(saved, tmp_path, capsys):
    steps = damaged_copy(saved, tmp_path / "out", "zero-filled", 1)
    summary = train(tmp_path / "out", resume="auto", save_every_steps=1, keep_checkpoints=0, epochs=2)
    assert summary["resumed_from"] == str(steps[-2] / "state.pt") and summary["optimizer_steps"] == 4
    assert f"not from the newer {steps[-1].name} is damaged (its state.pt begins with" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["emptied", "zero-filled"])
def test_resume_auto_passes_over_a_damaged_fsdp_shard(tmp_path, kind):
    train(tmp_path, strategy="fsdp", save_every_steps=1, keep_checkpoints=0)
    older, newer = resume.whole(tmp_path)
    shard = next(newer.glob("state.shards-*/__0_*.distcp"))
    DAMAGE[kind](shard)
    start = decide(TrainConfig(out=str(tmp_path), resume="auto", strategy="fsdp", devices="cpu"), set(), 1, LeNet5())
    assert start.checkpoint == older / "state.pt"
    assert f"not from the newer {newer.name} is damaged (its shards: its shard file {shard.name} fails its CRC-32)" \
        in start.line


# -- damage that falls back, named truly ------------------------------------------------------------------------------
def test_resume_auto_passes_over_a_state_pt_cut_short_and_says_why(tmp_path, capsys):
    light(tmp_path, save_every_steps=1, keep_checkpoints=0)
    older, newer = resume.whole(tmp_path)
    raw = (newer / "state.pt").read_bytes()
    (newer / "state.pt").write_bytes(raw[:-1])  # one byte short
    capsys.readouterr()
    summary = light(tmp_path, resume="auto")
    assert summary["resumed_from"] == str(older / "state.pt")
    said = capsys.readouterr().out
    assert f"multicard: resuming from {older / 'state.pt'} (epoch 1, 24 samples in, after 1 optimizer steps); not " \
           f"from the newer {newer.name} is unreadable (its state.pt: PytorchStreamReader failed reading zip " \
           f"archive: failed finding central directory)" in said


def test_a_damaged_model_pt_given_to_resume_is_named_as_itself(tmp_path):
    light(tmp_path / "run")
    model = (tmp_path / "run" / "model.pt").resolve()
    flip(model)
    with pytest.raises(UsageError, match=r"^--resume .*model\.pt: damaged: its model\.pt: its data/0 fails its "
                                         r"CRC-32, so its bytes are not those its save wrote"):
        light(tmp_path / "other", resume=str(model))


def test_a_flipped_byte_in_fsdps_metadata_is_damage_naming_the_file(tmp_path):
    mc = multicard.Multicard("fsdp", "cpu")
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    mc.save(tmp_path / "ckpt.pt", {"model": model})
    metadata = tmp_path / "ckpt.shards-1" / ".metadata"
    raw = bytearray(metadata.read_bytes())
    raw[raw.index(b"TensorStorageMetadata") + 3] ^= 0x01  # a class name no longer DCP's: read as planted, before
    metadata.write_bytes(bytes(raw))
    with pytest.raises(UsageError) as refused:
        mc.load(tmp_path / "ckpt.pt", {"model": model})
    assert str(refused.value) == f"shards folder {metadata.parent}: damaged: its .metadata fails its CRC-32, so its " \
                                 f"bytes are not those its save wrote; load an earlier checkpoint, or write this one " \
                                 f"again"
    mc.close()
