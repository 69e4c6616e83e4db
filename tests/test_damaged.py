"""Issue 33, item 2: a damaged checkpoint loads silently. A bit flipped in a tensor's bytes (model.pt, a
checkpoint's state.pt, a user's mc.save file, an fsdp shard file) is one line naming the file; --resume auto goes
on from the next older checkpoint and says so; a run.json that names no run is said, not ignored."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from multicard.checkpoints import plain as checkpoint
from multicard.checkpoints import resume
from multicard.errors import UsageError
from test_hostile3 import train


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
