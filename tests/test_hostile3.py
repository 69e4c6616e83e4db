"""A hostile user's third round (issue 26): an --out holding what multicard did not make (links, FIFOs, huge or
forged files) is never written through, read whole or hung on; a kill while an earlier run's checkpoints are moved
aside never publishes the wrong run. Checkpoints are made by hand where a run is not needed (resume only looks at
their folders, markers and run.json); a FIFO is tried in a child process with a time limit, so a regression
fails instead of hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multicard
from conftest import ROOT, tiny_images
from multicard import safefs
from multicard.checkpoints import resume, saves
from multicard.errors import UsageError
from multicard.models import LeNet5

OLD = "20240101T000000-abcdef"  # an earlier run's id, as multicard makes them


def earlier(out: Path, steps=(1, 2, 3), run: str = OLD, started: str | None = None) -> list[Path]:
    """--out/checkpoints as a run `run` leaves it: step folders with its marker and a state.pt, and run.json."""
    made = []
    for step in steps:
        folder = out / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        torch.save(head(f"{run} {step}", step), folder / "state.pt")
        (folder / ".multicard").write_text(run + "\n")
        made.append(folder)
    (out / "checkpoints" / "run.json").write_text(json.dumps({"run": run, "from": started}))
    return made


def head(note: str, steps: int) -> dict:
    """The smallest state.pt --resume auto takes as a checkpoint of multicard train, with a note to tell it by."""
    return {"config": {"batch_size": 24, "epochs": 1}, "loader": {"epoch": 0, "samples": 0}, "steps": steps,
            "history": [], "note": note}


def note(state: Path) -> str:
    return torch.load(state, weights_only=True)["note"]


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root (links not followed): a file's bytes, a link's target, None for anything else."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else p.read_bytes()
            if safefs.kind(p) == "file" else None for p in sorted(root.rglob("*"))}


def states(out: Path) -> list[str]:
    """The contents of every state.pt under --out, wherever it was moved."""
    return sorted(note(p) for p in out.rglob("state.pt") if safefs.kind(p) == "file")


def train(out: Path, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(48), None, out=str(out), **{
        **dict(quiet=True, strategy="single", devices="cpu", batch_size=24, epochs=1), **overrides})


# -- writes outside --out ------------------------------------------------------------------------------------------
def test_a_planted_part_link_is_never_written_through(tmp_path):
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    (outside / "state.pt").write_text("mine")
    (out / "checkpoints").mkdir(parents=True)
    os.symlink(outside, out / "checkpoints" / "step-00000001.part")
    with pytest.raises(UsageError, match=r"step-00000001\.part: a link multicard did not make is in the way"):
        train(out, save_every_steps=1)
    assert tree(outside) == {"state.pt": b"mine"}
    assert os.readlink(out / "checkpoints" / "step-00000001.part") == str(outside)  # left, not renamed


def test_a_run_folder_link_is_refused_before_anything_moves(tmp_path):
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    earlier(out)
    os.symlink(outside, out / "checkpoints" / f"run-{OLD}")
    before = tree(out)
    with pytest.raises(UsageError, match=rf"run-{OLD}: is a link, not a folder multicard made"):
        saves.claim(out, None)
    assert tree(out) == before and list(outside.iterdir()) == []
    (out / "checkpoints" / f"run-{OLD}").unlink()
    (out / "checkpoints" / f"run-{OLD}").write_text("mine")  # a file under that name: the same one line
    with pytest.raises(UsageError, match=rf"run-{OLD}: is a file, not a folder"):
        saves.claim(out, None)


def test_run_json_is_never_written_through_a_planted_temporary(tmp_path):
    victim, out = tmp_path / "victim", tmp_path / "out"
    victim.write_text("mine")
    earlier(out)
    for name in (f"run.json.{os.getpid()}.tmp", "run.json.tmp", "run.json.part"):  # the names once used, and more
        os.symlink(victim, out / "checkpoints" / name)
    run = saves.claim(out, None)
    assert victim.read_text() == "mine"
    assert safefs.kind(out / "checkpoints" / "run.json") == "file" and resume.owner(out)["run"] == run


@pytest.mark.parametrize("marker", [b"x/../../../somewhere", b"../../escaped", b"\xff\xfe not utf-8", b"a\0b",
                                    b"a" * 300, b"20240101T000000-abcdef/../../x"],
                         ids=["dotdot", "up", "not-utf8", "nul", "long", "id-then-dotdot"])
def test_a_forged_marker_moves_nothing_out_of_out(tmp_path, marker):
    out = tmp_path / "deep" / "out"
    made = earlier(out)
    (made[0] / ".multicard").write_bytes(marker)
    run = saves.claim(out, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep"] and os.listdir(tmp_path / "deep") == ["out"]
    unnamed = out / "checkpoints" / f"run-unnamed-{run}" / "step-00000001" / "state.pt"
    assert note(unnamed) == f"{OLD} 1"  # kept aside under a name multicard makes, not one read from a file
    assert states(out) == [f"{OLD} {s}" for s in (1, 2, 3)]
    assert saves.claim(out, None) != run  # and the next run into that --out is not stopped by it


# -- a kill while an earlier run's checkpoints move aside ----------------------------------------------------------
class Killed(BaseException):
    """What a SIGKILL leaves: nothing after it runs."""


@pytest.mark.parametrize("rewind", [False, True], ids=["fresh", "from-step-1"])
def test_a_kill_at_each_point_of_claim_never_publishes_the_earlier_run_as_the_new_one(tmp_path, monkeypatch,
                                                                                       rewind):
    """Each call of claim that changes the disk (a folder made, a file created, a rename), in turn, is where the
    launcher dies: --resume auto then goes on with the earlier run only where run.json still names it (nothing
    moved yet), else from where the new run began (the beginning, or step 1), never from the earlier run's
    newest. The next start finishes the moves, and no checkpoint is lost."""
    real = {"replace": os.replace, "mkdir": os.mkdir, "open": os.open}
    point = 0
    while True:
        out = tmp_path / f"kill-{point}"
        made = earlier(out)
        resumed = made[0] / "state.pt" if rewind else None
        left = [point]

        def counted(name, left=left):
            def call(*args, **kwargs):
                creates = name != "open" or args[1] & os.O_CREAT
                if creates:
                    left[0] -= 1
                    if left[0] < 0:
                        raise Killed(name)
                return real[name](*args, **kwargs)
            return call

        for name in real:
            monkeypatch.setattr(os, name, counted(name))
        try:
            run = saves.claim(out, resumed)
            done = True
        except Killed:
            done = False
        monkeypatch.undo()
        own, auto = resume.owner(out)["run"], resume.resolve("auto", out)
        if own == OLD:  # killed before the claim: the earlier run is as it was, and auto goes on with it
            assert auto == made[-1] / "state.pt" and all(p.is_dir() for p in made), f"killed at call {point}"
        else:
            assert auto == (resumed.absolute() if rewind else None), f"killed at call {point}"
            assert not done or own == run
        again = saves.claim(out, auto)  # the next start: --resume auto
        assert states(out) == [f"{OLD} {s}" for s in (1, 2, 3)]  # none lost, none doubled
        if own != OLD:
            assert (again == own) == rewind  # from step 1: the same new run goes on; from nothing: a new one
            assert resume.owner(out)["run"] == again
            assert [p.name for p in resume.whole(out)] == (["step-00000001"] if rewind else [])
        if done:
            break
        point += 1
    assert point >= 4  # the run folder aside, run.json's temporary and its rename, and the moves


def test_a_new_run_killed_before_its_first_checkpoint_starts_over_under_auto(tmp_path):
    out = tmp_path / "out"
    earlier(out)
    saves.claim(out, None)
    assert resume.resolve("auto", out) is None


# -- hangs: nothing but a regular file is opened -------------------------------------------------------------------
def bounded(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` in a child process that must end within `timeout` seconds (a FIFO opened for reading would block)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.slow
def test_a_fifo_run_json_is_one_line_not_a_hang(tmp_path):
    earlier(tmp_path)
    (tmp_path / "checkpoints" / "run.json").unlink()
    os.mkfifo(tmp_path / "checkpoints" / "run.json")
    done = bounded(f"from multicard.checkpoints import resume, saves\nfrom multicard.errors import UsageError\n"
                   f"try:\n    resume.resolve('auto', {str(tmp_path)!r})\nexcept UsageError as e:\n    print(e)")
    assert "checkpoints/run.json: is a fifo, not a file multicard wrote" in done.stdout, done.stderr


def test_a_fifo_marker_is_not_read_and_the_checkpoint_kept_aside(tmp_path):
    made = earlier(tmp_path)
    (made[1] / ".multicard").unlink()
    os.mkfifo(made[1] / ".multicard")
    done = bounded(f"from multicard.checkpoints import saves\nprint(saves.claim({str(tmp_path)!r}, None))")
    assert done.returncode == 0, done.stderr
    run = done.stdout.split()[-1]
    assert (tmp_path / "checkpoints" / f"run-unnamed-{run}" / "step-00000002" / "state.pt").is_file()


@pytest.mark.parametrize("what", ["folder", "fifo", "link", "huge"])
def test_run_json_that_is_not_a_small_file_is_one_line(tmp_path, what):
    earlier(tmp_path)
    place = tmp_path / "checkpoints" / "run.json"
    place.unlink()
    if what == "folder":
        place.mkdir()
    elif what == "fifo":
        os.mkfifo(place)
    elif what == "link":
        os.symlink("/dev/zero", place)
    else:
        with open(place, "wb") as f:
            f.truncate(10 * 2**30)  # sparse: 10 GB that take no disk
    with pytest.raises(UsageError, match=r"checkpoints/run\.json: (is a|is \d+ bytes, more than)"):
        saves.claim(tmp_path, None)


def test_a_fifo_in_a_shards_folder_is_one_line_not_a_hang(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "state.shards-1"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=folder, no_dist=True)
    data = next(p for p in folder.iterdir() if p.name != ".metadata")
    data.unlink()
    os.mkfifo(data)  # a shard DCP would open and wait on
    done = bounded(f"from pathlib import Path\nfrom multicard.checkpoints import shards_read\n"
                   f"from multicard.errors import UsageError\n"
                   f"where = Path({str(folder)!r})\nshards_read.metadata(where)\n"
                   f"try:\n    shards_read.plain_files(where)\nexcept UsageError as e:\n    print(e)\n"
                   f"(where / '.metadata').rename(where / 'm')\nimport os\nos.mkfifo(where / '.metadata')\n"
                   f"try:\n    shards_read.metadata(where)\nexcept UsageError as e:\n    print(e)")
    assert f"{data.name} is a fifo, not a file DCP writes" in done.stdout, done.stderr
    assert ".metadata: is a fifo, not a file multicard wrote" in done.stdout, done.stderr


# -- memory: nothing read whole that is larger than its kind ---------------------------------------------------------
@pytest.mark.parametrize("what", ["sparse", "zero"])
def test_a_huge_shards_metadata_is_refused_before_it_is_read(tmp_path, what):
    from multicard.checkpoints import shards_read

    (tmp_path / "s").mkdir()
    if what == "sparse":
        with open(tmp_path / "s" / ".metadata", "wb") as f:
            f.truncate(10 * 2**30)
    else:
        os.symlink("/dev/zero", tmp_path / "s" / ".metadata")
    with pytest.raises(UsageError, match=r"\.metadata: is (\d+ bytes, more than|a link)"):
        shards_read.metadata(tmp_path / "s")


# -- tracebacks become one line ------------------------------------------------------------------------------------
def test_dcps_checkpoint_exception_is_one_line():
    from torch.distributed.checkpoint.api import CheckpointException

    from multicard.checkpoints import shards

    try:
        raise KeyError("layer.weight missing")
    except KeyError as e:
        wrapped = CheckpointException("load failed", {1: (e, None), 0: (ValueError("size mismatch\nmore"), None)})
    assert shards.first_failure(wrapped) == "ValueError: size mismatch"
    assert "\n" not in shards.first_failure(wrapped)


def test_a_sharded_checkpoint_into_another_model_is_one_line(tmp_path):
    def body(mc, model, path, saving):
        model = mc.setup(model)
        state = {"model": model, "optimizer": mc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))}
        mc.save(path, state) if saving else mc.load(path, state)

    multicard.Multicard("fsdp", "cpu:1").launch(body, LeNet5(), tmp_path / "state.pt", True)
    assert (tmp_path / "state.pt").is_file()
    with pytest.raises(UsageError, match=r"its shards in state\.shards-1 cannot be read into this model \(\w+: "):
        multicard.Multicard("fsdp", "cpu:1").launch(body, torch.nn.Sequential(torch.nn.Linear(3, 2)),
                                                    tmp_path / "state.pt", False)


def test_a_ddp_checkpoint_with_optimizers_under_fsdp_is_one_line(tmp_path):
    single = multicard.Multicard("single", "cpu")
    model = single.setup(LeNet5())
    single.save(tmp_path / "state.pt", {"model": model, "optimizer": torch.optim.Adam(model.parameters())})

    def body(mc):
        model = mc.setup(LeNet5())
        mc.load(tmp_path / "state.pt", {"model": model})  # the model alone loads
        mc.load(tmp_path / "state.pt", {"model": model, "optimizer": torch.optim.Adam(model.parameters())})

    with pytest.raises(UsageError, match="written without fsdp, its optimizers' state is whole"):
        multicard.Multicard("fsdp", "cpu:1").launch(body)


@pytest.mark.slow
def test_a_checkpoint_write_stopped_by_a_file_size_limit_is_one_line(tmp_path):
    from multicard.checkpoints import plain as checkpoint

    done = bounded("import resource, torch\nfrom multicard.checkpoints import plain as checkpoint\n"
                   "from multicard.errors import UsageError\n"
                   "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
                   f"try:\n    checkpoint.write_atomic({{'w': torch.zeros(100000)}}, {str(tmp_path / 'state.pt')!r})\n"
                   "except UsageError as e:\n    print(e)")
    assert f"cannot write {tmp_path / 'state.pt'}" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == [] and checkpoint is not None  # no temporary left


def test_too_many_workers_is_one_line():
    from multicard.trainer.config import TrainConfig

    with pytest.raises(UsageError, match=r"--workers 100000: at most \d+ DataLoader worker processes"):
        TrainConfig(workers=100000).validate()
    TrainConfig(workers=4).validate()


def test_synthetic_samples_beyond_memory_is_one_line():
    from multicard import data

    with pytest.raises(UsageError, match=r"--synthetic-samples 1000000000000: .* GiB of memory, more than"):
        data.load("synthetic", synthetic_samples=10**12)
    assert len(data.load("synthetic", synthetic_samples=8)[0]) == 8


@pytest.mark.parametrize("body, words", [
    ("x = 1 / 0\n", r"importing .*net\.py failed: ZeroDivisionError: division by zero \(at .*net\.py:1\)$"),
    ("def broken(:\n", r"importing .*net\.py failed: SyntaxError: .* \(at .*net\.py:1\)$"),
    ("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.layer = torch.nn.Linear(3, 'wide')\n",
     r"building it failed: TypeError: .* \(at .*net\.py:5\)$"),
    ("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        raise RuntimeError('my own')\n",
     r"building it failed: RuntimeError: my own \(at .*net\.py:4\)$"),
], ids=["import", "syntax", "init-typeerror", "init"])
def test_a_model_file_that_fails_shows_the_users_error_in_one_line(tmp_path, body, words, monkeypatch, request):
    import re

    from multicard import models

    name = f"net_{request.node.callspec.id.replace('-', '_')}_{os.getpid()}"  # a module name of its own
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(UsageError) as caught:
        models.build(f"{tmp_path / name}.py:Net")
    assert "\n" not in str(caught.value)
    assert re.search(words.replace("net\\.py", f"{name}\\.py"), str(caught.value)), str(caught.value)


@pytest.mark.parametrize("what", ["fifo", "file", "folder"])
def test_a_part_name_taken_by_something_else_is_one_line(tmp_path, what):
    part = tmp_path / "checkpoints" / "step-00000004.part"
    part.parent.mkdir()
    if what == "folder":  # a folder with something of someone's in it (an empty one holds nothing to lose)
        part.mkdir()
        (part / "notes.txt").write_text("mine")
    else:
        os.mkfifo(part) if what == "fifo" else part.write_text("mine")
    with pytest.raises(UsageError, match=rf"step-00000004\.part: a {what} multicard did not make is in the way"), \
            safefs.Folder.open(part.parent) as checkpoints:
        saves.fresh(checkpoints, part, OLD)
    assert safefs.kind(part) == what


@pytest.mark.parametrize("left", [[], [".multicard.0123456789ab.part"]], ids=["empty", "marker-unrenamed"])
def test_a_part_folder_a_kill_cut_short_before_its_marker_does_not_block_later_runs(tmp_path, left):
    """Killed between making step-N.part and renaming its marker into place: the folder holds only the marker's
    temporary (or nothing). The next run takes it over, and a new run clears it too."""
    part = tmp_path / "checkpoints" / "step-00000001.part"
    part.mkdir(parents=True)
    for name in left:
        (part / name).write_text(OLD + "\n")
    summary = train(tmp_path, save_every_steps=1)
    assert summary["optimizer_steps"] == 2 and safefs.kind(part) is None
    assert [p.name for p in resume.whole(tmp_path)] == ["step-00000001", "step-00000002"]


def test_a_read_only_checkpoints_folder_is_one_line(tmp_path, monkeypatch):
    earlier(tmp_path)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")  # what a chmod -w or chattr +i folder answers (root too)

    monkeypatch.setattr(os, "mkdir", refused)
    with pytest.raises(UsageError, match=rf"run-{OLD}: cannot be made \(Permission denied\)"):
        saves.claim(tmp_path, None)
    monkeypatch.undo()
    monkeypatch.setattr(os, "replace", refused)  # the folders made, run.json not written
    with pytest.raises(UsageError, match=r"cannot write into checkpoints/ \(Permission denied\)"):
        saves.claim(tmp_path, None)
    monkeypatch.undo()
    assert resume.owner(tmp_path)["run"] == OLD


@pytest.mark.parametrize("flags", [dict(batch_size=10**9), dict(batch_size=None, accumulate=100)],
                         ids=["batch", "accumulate"])
def test_a_global_batch_larger_than_the_training_set_is_one_line(tmp_path, flags):
    named = r"--batch-size \d+" if flags["batch_size"] else r"--accumulate 100 \(a global batch of \d+\)"
    with pytest.raises(UsageError, match=named + r": the global batch is larger than the training set "
                                                 r"\(48 samples\); choose at most 48"):
        train(tmp_path, **flags)
    assert not any(tmp_path.iterdir())  # refused before --out is touched


# -- your loop: ranks that pass different structures ---------------------------------------------------------------
def mismatched(mc) -> dict:
    out = {}
    mine = {"rank": mc.rank} if mc.rank == 0 else torch.tensor([7.0, 8.0])  # a dict on 0, a tensor on 1
    out["from_dict"] = mc.broadcast(mine, src=0)
    out["from_tensor"] = mc.broadcast(mine, src=1)
    try:
        mc.gather_in_order(torch.zeros(2, 3) if mc.rank == 0 else [1.0, 2.0])
    except UsageError as e:
        out["tensor_vs_list"] = str(e)
    try:
        mc.gather_in_order({"a": [1], "b": [2]} if mc.rank == 0 else {"a": [1], "c": [2]})
    except UsageError as e:
        out["keys"] = str(e)
    return mc.gather(out)


def test_mismatched_structures_across_ranks_broadcast_as_src_sent_and_gather_in_order_says_both():
    ranks = multicard.launch(mismatched, strategy="ddp", devices="cpu:2")
    for r in ranks:
        assert r["from_dict"] == {"rank": 0} and torch.equal(r["from_tensor"], torch.tensor([7.0, 8.0]))
        assert r["tensor_vs_list"] == ("gather_in_order: rank 0 passed a tensor of rows (3,), rank 1 a list: every "
                                       "process must pass the same structure")
        assert r["keys"] == ("gather_in_order: rank 0 passed {'a': a list, 'b': a list}, rank 1 {'a': a list, 'c': "
                             "a list}: every process must pass the same structure")
