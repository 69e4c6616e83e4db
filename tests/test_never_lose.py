"""Nothing lost, nothing run, nothing left (issue 23, items 1-4): checkpoints that belong to a run, shards whose
metadata cannot run code (nor hang on a FIFO, nor fill memory, nor name a folder elsewhere), an --out where multicard
deletes only what it can prove it wrote, and a publish that a kill at any point leaves showing one whole run."""

from __future__ import annotations

import errno
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import bounded, shown, tiny_images
from multicard.checkpoints import resume, shards, shards_read, trainer_saves
from multicard.errors import UsageError
from multicard.models import LeNet5
from multicard.trainer import outdir
from multicard.trainer.outdir import FILES, Output

LIGHT = dict(quiet=True, batch_size=24, strategy="single", devices="cpu")  # 96 samples: 4 steps per epoch


def run(out: Path, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(96), tiny_images(30, 1), out=str(out),
                           **{**LIGHT, "lr": 3e-3, "epochs": 1, **overrides})


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root (links not followed): a file's bytes, a link's target, None for a folder."""
    found = {}
    for p in sorted(root.rglob("*")):
        found[str(p.relative_to(root))] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() \
            else None
    return found


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """An --out holding a finished run of 3 epochs (checkpoints step-11, step-12 kept)."""
    out = tmp_path_factory.mktemp("earlier")
    run(out, epochs=3, save_every_steps=1)
    return out


def copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- 1. checkpoints belong to a run ------------------------------------------------------------------------------
def test_a_fresh_run_moves_an_earlier_runs_checkpoints_aside_and_keeps_its_own(earlier, tmp_path, capsys):
    out = copy(earlier, tmp_path / "out")
    first = resume.owner(out)["run"]
    assert [resume.run_of(p) for p in resume.whole(out)] == [first, first]
    run(out, lr=1e-3, save_every_steps=1)  # a new run, another rate: its steps 3, 4 are below the old 11, 12
    assert [p.name for p in resume.whole(out)] == ["step-00000003", "step-00000004"]  # its own, not pruned
    second = resume.owner(out)["run"]
    assert second != first and all(resume.run_of(p) == second for p in resume.whole(out))
    assert torch.load(resume.resolve("auto", out), weights_only=True)["run"] == second
    aside = out / "checkpoints" / f"run-{first}"
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000011", "step-00000012"]  # nothing deleted
    assert f"moved to {aside}" in capsys.readouterr().out
    assert resume.resolve(str(aside), out) == aside / "step-00000012" / "state.pt"  # still resumable by name


def test_auto_after_a_fresh_run_killed_before_its_first_checkpoint_starts_over(earlier, tmp_path):
    out = copy(earlier, tmp_path / "out")
    assert resume.resolve("auto", out).parent.name == "step-00000012"
    trainer_saves.claim(out, None)  # what a fresh run's start does; then it is killed
    assert resume.resolve("auto", out) is None  # the newest run started from the beginning: so does auto


def test_going_on_from_the_newest_keeps_the_run_a_rewind_is_a_new_one(earlier, tmp_path):
    out = copy(earlier, tmp_path / "out")
    first = resume.owner(out)["run"]
    newest = resume.resolve("auto", out)
    assert trainer_saves.claim(out, newest) == first and len(resume.whole(out, first)) == 2  # --resume auto, a restart
    older = out / "checkpoints" / "step-00000011" / "state.pt"
    rewound = trainer_saves.claim(out, older)
    assert rewound != first
    assert [p.name for p in resume.whole(out)] == ["step-00000011"]  # read from where it is; step-12 aside
    assert (out / "checkpoints" / f"run-{first}" / "step-00000012" / "state.pt").is_file()
    assert resume.resolve("auto", out) == older.absolute()  # killed before its first checkpoint: where it began


@pytest.mark.slow
def test_a_restart_resumes_this_runs_checkpoint_not_an_earlier_runs(earlier, tmp_path):
    """--max-restarts after a fresh run's process dies (at its step 7): it goes on from its own step 6, not the
    earlier run's step 12 (from which it would have ended at once with that run's model)."""
    from test_resume import DiesOnce

    out = copy(earlier, tmp_path / "out")
    torch.manual_seed(0)
    summary = multicard.train(DiesOnce(str(tmp_path / "died")), tiny_images(96), tiny_images(30, 1), out=str(out),
                              **{**LIGHT, "strategy": "ddp", "devices": "cpu:2", "lr": 1e-3, "epochs": 2,
                                 "save_every_steps": 2, "max_restarts": 1})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    assert summary["resumed_from"].endswith("checkpoints/step-00000006/state.pt")
    assert summary["optimizer_steps"] == 8 and summary["config"]["lr"] == 1e-3


# -- 2. nothing in a checkpoint is unpickled outside an allow-list -------------------------------------------------
class Planted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_shards_metadata_is_refused_and_never_run(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder, marker = tmp_path / "state.shards-1", tmp_path / "ran"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=folder, no_dist=True)
    assert shards_read.metadata(folder).state_dict_metadata.keys() == {"w"}  # a genuine one reads
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(UsageError, match=r"\.metadata is refused \(posix\.system is not among the types"):
        shards_read.metadata(folder)
    target = {"w": torch.zeros(3)}
    with pytest.raises(BaseException, match="posix.system"):  # DCP reads through the same reader
        dcp.load(target, storage_reader=shards_read.reader(folder), planner=shards_read.planner(), no_dist=True)
    assert not marker.exists()


def test_a_planted_value_in_the_shards_is_refused(tmp_path):
    import io

    buffer = io.BytesIO()
    torch.save(Planted(tmp_path / "ran"), buffer)
    buffer.seek(0)
    with pytest.raises(UsageError, match="does not load"):
        shards_read.planner().load_bytes(None, buffer)
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_resume_under_fsdp_with_a_planted_metadata_is_one_line(tmp_path):
    out, marker = tmp_path / "out", tmp_path / "ran"
    fsdp = dict(strategy="fsdp", devices="cpu:2", scheduler="step", augment=False)
    run(out, save_every_steps=2, **fsdp)
    step = resume.whole(out)[-1]
    metadata = next(step.glob("state.shards-*/.metadata"))
    genuine = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(Planted(marker)))
    # refused before anything is unpickled: the file's bytes are not those its save recorded (test_damaged.py); a
    # checkpoint without sums meets the allow-list instead (test_a_planted_shards_metadata_is_refused_and_never_run)
    with pytest.raises(UsageError, match=r"damaged: its shards: its shard file \.metadata fails its CRC-32"):
        run(tmp_path / "again", resume=str(step), epochs=2, **fsdp)
    assert not marker.exists()
    metadata.write_bytes(genuine)  # the genuine one still resumes
    assert run(tmp_path / "again", resume=str(step), epochs=2, **fsdp)["optimizer_steps"] == 8


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


def test_a_shards_folder_named_by_a_checkpoint_is_a_name_beside_it(tmp_path):
    outside = tmp_path / "outside" / "shards"
    outside.mkdir(parents=True)
    path = tmp_path / "out" / "state.pt"
    for forged in ("../../outside/shards", str(outside), "state.shards-1/../../outside", 7):
        with pytest.raises(UsageError, match=r"its shards folder is not one multicard names"):
            shards.load(path, {"folder": forged, "models": ["model"], "optimizers": []}, {"model": nn.Linear(2, 2)},
                        lambda m: m)


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


# -- 3. only what multicard can prove it wrote is deleted ----------------------------------------------------------
def test_a_run_that_fails_its_checks_changes_nothing(earlier, tmp_path):
    out = copy(earlier, tmp_path / "out")
    (out / ".run-mine").mkdir()  # named like multicard's, not marked as its own
    (out / "notes.part").write_text("mine")
    (out / "checkpoints" / "step-1.part").mkdir()
    (out / "checkpoints" / "step-1.part" / "keep.txt").write_text("mine")
    before = tree(out)
    with pytest.raises(UsageError, match="resume with --batch-size 24"):  # refused after --out is held
        run(out, resume="auto", batch_size=48, epochs=3)
    assert tree(out) == before


def test_leftovers_not_marked_as_multicards_are_left_with_a_line(tmp_path, capsys):
    (tmp_path / ".run-mine").mkdir()
    (tmp_path / ".run-mine" / "data").write_text("mine")
    (tmp_path / "notes.part").write_text("mine")
    os.symlink("/etc/hostname", tmp_path / "model.pt.1.part")  # our name, not our target
    run(tmp_path)
    assert (tmp_path / ".run-mine" / "data").read_text() == "mine" and (tmp_path / "notes.part").exists()
    assert os.readlink(tmp_path / "model.pt.1.part") == "/etc/hostname"
    said = capsys.readouterr().out
    assert "left alone: " + str(tmp_path / "notes.part") in said and "model.pt.1.part" in said


@pytest.mark.parametrize("name", ["tensorboard", "model.pt", "summary.json"])
def test_a_users_own_file_under_a_shown_name_refuses_the_run(tmp_path, name):
    (tmp_path / name).mkdir()  # a real folder (a model.pt folder would fail only after the switch)
    (tmp_path / name / "events").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(UsageError, match=rf"{name} there is not multicard's .*nothing was changed"):
        run(tmp_path)
    assert tree(tmp_path) == before


def test_a_checkpoints_link_is_refused_and_nothing_outside_deleted(tmp_path):
    outside = tmp_path / "outside"
    (outside / "step-00000001").mkdir(parents=True)
    (outside / "step-00000001" / "state.pt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "checkpoints")
    with pytest.raises(UsageError, match="checkpoints there is a link"):
        run(out, save_every_steps=1, keep_checkpoints=1)
    assert (outside / "step-00000001" / "state.pt").read_text() == "mine"
    with pytest.raises(UsageError, match="checkpoints: is a link, not a folder multicard made"):
        trainer_saves.hold(out)  # every write and deletion in checkpoints/ goes through it held, never through a link
    assert (outside / "step-00000001" / "state.pt").read_text() == "mine"


class Exchange:
    """The other user, in the process that writes the checkpoints: for the length of every os.open, os.mkdir,
    os.replace, os.rename and os.unlink that process makes, our checkpoints/ is exchanged for a link to another
    run's checkpoints/, and put back after (as renameat2's exchange, watching with inotify, does it for 300 µs)."""

    CALLS = ("open", "mkdir", "replace", "rename", "unlink")

    def __init__(self, ours: Path, theirs: Path):
        self.ours, self.theirs, self.aside = ours, theirs, ours.with_name("checkpoints.exchanged")
        self.real = {name: getattr(os, name) for name in self.CALLS}
        self.lock, self.depth = threading.RLock(), 0

    def install(self) -> None:
        for name, real in self.real.items():
            setattr(os, name, self.around(real))

    def uninstall(self) -> None:
        for name, real in self.real.items():
            setattr(os, name, real)

    def around(self, real):
        def call(*args, **kwargs):
            with self.lock:
                self.depth += 1
                if self.depth == 1:
                    self.real["rename"](self.ours, self.aside)
                    os.symlink(self.theirs, self.ours)
                try:
                    return real(*args, **kwargs)
                finally:
                    if self.depth == 1:
                        self.real["unlink"](self.ours)
                        self.real["rename"](self.aside, self.ours)
                    self.depth -= 1
        return call


class Exchanging(nn.Sequential):
    """A small model whose forward, in rank 0 once our first checkpoint is whole, lets the other user in."""

    def __init__(self, out: Path, theirs: Path):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))
        self.out, self.theirs, self.exchange = str(out), str(theirs), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ours = Path(self.out) / "checkpoints"
        if self.exchange is None and os.environ.get("RANK", "0") == "0" and (ours / "step-00000001").is_dir():
            self.exchange = Exchange(ours, Path(self.theirs) / "checkpoints")
            self.exchange.install()
        return super().forward(x)


def exchanged_at_every_call(tmp_path: Path, **job) -> None:
    """Another run's checkpoints sit beside ours; from our second save on, our checkpoints/ is a link to theirs
    during every call that opens, makes, renames or removes something. Nothing of theirs changes, and every
    checkpoint of ours lands in our own folder."""
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    run(theirs, save_every_steps=1)
    before = tree(theirs / "checkpoints")
    torch.manual_seed(0)
    model = Exchanging(mine, theirs)
    try:
        multicard.train(model, tiny_images(96), None, out=str(mine), **{
            **LIGHT, "epochs": 2, "save_every_steps": 1, "keep_checkpoints": 3, **job})
    finally:  # however the run ended
        if model.exchange is not None:
            model.exchange.uninstall()
        assert tree(theirs / "checkpoints") == before
    own = resume.owner(mine)["run"]
    assert [p.name for p in resume.whole(mine, own)] == [f"step-0000000{s}" for s in (6, 7, 8)]
    assert not (mine / "checkpoints.exchanged").exists() and (mine / "model.pt").is_file()


def test_checkpoints_swapped_for_a_link_at_every_call_of_a_save_redirect_nothing(tmp_path):
    exchanged_at_every_call(tmp_path)


def test_under_fsdp_checkpoints_swapped_at_every_call_of_rank_0_redirect_no_shard(tmp_path):
    exchanged_at_every_call(tmp_path, strategy="fsdp", devices="cpu:2")


@pytest.mark.slow
def test_under_ddp_checkpoints_swapped_at_every_call_of_rank_0_redirect_nothing(tmp_path):
    exchanged_at_every_call(tmp_path, strategy="ddp", devices="cpu:2")


# -- 4. --out all or nothing ---------------------------------------------------------------------------------------
class Killed(BaseException):
    """What a SIGKILL leaves: nothing after it runs (no except, no finally in publish catches a BaseException)."""


def finished(output: Output, tag: str, events: bool) -> Path:
    folder = output.new_run()
    for name in FILES:
        (folder / name).write_text(f"{tag} {name}")
    if events:
        (folder / "tensorboard").mkdir()
        (folder / "tensorboard" / "events").write_text(f"{tag} events")
    return folder


@pytest.mark.parametrize("first", [True, False], ids=["first run", "later run"])
def test_a_kill_at_each_point_of_publish_shows_one_whole_run(tmp_path, monkeypatch, first):
    """Each call publish makes that changes the disk (symlink, rename, unlink, rmtree), in turn, is where the
    process dies: --out then shows the run before (or nothing, for a first run) or the new one, never a mix;
    and the next run's start clears what was left and publishes whole."""
    import shutil

    calls = {"os.symlink": os.symlink, "os.replace": os.replace, "shutil.rmtree": shutil.rmtree,
             "Path.unlink": Path.unlink}
    point = 0
    while True:
        out = tmp_path / f"kill-{point}"
        with Output(str(out)) as output:
            if not first:
                output.publish(finished(output, "old", events=True))
            old = shown(out)
            new_run = finished(output, "new", events=False)
            left = [point]

            def dies(name, real, left=left):
                def call(*args, **kwargs):
                    left[0] -= 1
                    if left[0] < 0:
                        raise Killed(name)
                    return real(*args, **kwargs)
                return call

            for name, real in calls.items():
                owner, attr = (os, name[3:]) if name.startswith("os.") else \
                    (shutil, "rmtree") if name.startswith("shutil") else (Path, "unlink")
                monkeypatch.setattr(owner, attr, dies(name, real))
            try:
                output.publish(new_run)
                done = True
            except Killed:
                done = False
            monkeypatch.undo()
            new = {name: f"new {name}".encode() for name in FILES}
            assert shown(out) in (old, new), f"killed at call {point}"
            assert not (out / "tensorboard").exists() or shown(out) == old  # no events of the old beside new
        with Output(str(out)) as output:  # the next run's start, and its publish
            output.publish(finished(output, "next", events=False))
        assert shown(out) == {name: f"next {name}".encode() for name in FILES}
        assert len(list(out.glob(".run-*"))) == 1 and not list(out.glob("*.part"))
        if done:
            break
        point += 1
    assert point >= 4  # links, the switch, and the cleanup were each a point of death


def test_a_run_missing_a_file_is_not_published(tmp_path):
    with Output(str(tmp_path)) as output:
        output.publish(finished(output, "old", events=False))
        before = shown(tmp_path)
        broken = finished(output, "new", events=False)
        (broken / "summary.json").unlink()
        with pytest.raises(UsageError, match="has no summary.json"):
            output.publish(broken)
    assert shown(tmp_path) == before


# -- the --out and checkpoint inputs of item 7 ---------------------------------------------------------------------
@pytest.mark.parametrize("out, said", [
    ("/proc/self/fd", "is inside /proc (proc, a filesystem of the kernel's)"),
    ("/proc/self/no-such/run", "is inside /proc (proc, a filesystem of the kernel's)"),
    ("/sys/kernel/run", "is inside /sys (sysfs, a filesystem of the kernel's)"),
    ("/dev/null", "is a device"),
    ("/dev/null/run", "/dev/null is a device"),
])
def test_an_out_in_a_filesystem_of_the_kernels_or_through_a_device_is_one_line(out, said):
    if not Path(*Path(out).parts[:3]).exists():
        pytest.skip(f"no {Path(*Path(out).parts[:3])} here")
    with pytest.raises(UsageError) as refused:
        Output(out)
    assert str(refused.value) == f"--out {out}: {said}, no place for files; name a folder"


def test_an_out_in_dev_itself_is_refused_by_its_filesystem_type():
    if outdir.filesystem(Path("/dev"), os.stat("/dev").st_dev) != ("devtmpfs", "/dev"):
        pytest.skip("/dev is no devtmpfs here (a container's tmpfs is a place for files)")
    with pytest.raises(UsageError, match=r"^--out /dev/run: is inside /dev \(devtmpfs, a filesystem of the kernel's\), "
                                         r"no place for files; name a folder$"):
        Output("/dev/run")
    assert not Path("/dev/run").exists()


def test_an_out_in_dev_shm_trains_as_anywhere_else(tmp_path):
    """/dev/shm is a tmpfs under /dev: a place for files (scratch many use), not a filesystem of the kernel's."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or outdir.filesystem(shm, os.stat(shm).st_dev) != ("tmpfs", "/dev/shm") \
            or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm here")
    out = shm / f"multicard-test-{os.getpid()}-{tmp_path.name}" / "run"
    try:
        run(out)
        assert set(shown(out)) == set(FILES)
    finally:
        import shutil
        shutil.rmtree(out.parent, ignore_errors=True)


def test_without_mountinfo_the_kernels_folders_are_told_by_their_place_and_dev_shm_is_allowed(monkeypatch):
    """Elsewhere than Linux (no /proc/self/mountinfo): /proc, /sys and /dev are refused, /dev/shm is not."""
    monkeypatch.setattr(outdir, "MOUNTINFO", Path("/no/mountinfo"))
    assert outdir.no_place(Path("/proc/self/fd")) == "is inside /proc (proc, a filesystem of the kernel's)"
    assert outdir.no_place(Path("/sys/run")) == "is inside /sys (sysfs, a filesystem of the kernel's)"
    assert outdir.no_place(Path("/dev/run")) == "is inside /dev (devfs, a filesystem of the kernel's)"
    assert outdir.no_place(Path("/dev/shm/run")) is None
    assert outdir.no_place(Path("/tmp/run")) is None


def test_the_filesystem_is_read_from_mountinfo_by_device_innermost_mount_first(tmp_path, monkeypatch):
    """A mount point with a space (written \\040), and two mounts of one device: the one holding the folder."""
    info = tmp_path / "mountinfo"
    info.write_text("22 27 0:21 / /proc rw - proc proc rw\n"
                    "40 27 0:99 / /mnt/a\\040b rw,relatime - tmpfs tmpfs rw\n"
                    "41 27 0:99 / /mnt/a\\040b/deeper rw,relatime shared:5 - tmpfs tmpfs rw\n")
    monkeypatch.setattr(outdir, "MOUNTINFO", info)
    assert outdir.filesystem(Path("/mnt/a b/deeper/x"), os.makedev(0, 99)) == ("tmpfs", "/mnt/a b/deeper")
    assert outdir.filesystem(Path("/mnt/a b/x"), os.makedev(0, 99)) == ("tmpfs", "/mnt/a b")
    assert outdir.filesystem(Path("/proc/x"), os.makedev(0, 21)) == ("proc", "/proc")
    assert outdir.filesystem(Path("/x"), os.makedev(7, 7)) == ("", "")  # unknown: a place for files


def test_an_out_out_of_space_is_one_line(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with Output(str(tmp_path)) as output:
        monkeypatch.setattr(os, "mkdir", full)
        with pytest.raises(UsageError, match=r"cannot write there \(No space left on device\)"):
            output.new_run()
        monkeypatch.undo()
        done = finished(output, "old", events=False)
        monkeypatch.setattr(os, "symlink", full)
        with pytest.raises(UsageError, match=r"No space left on device\); it still shows the run before"):
            output.publish(done)
    assert shown(tmp_path) == {}


def test_a_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    from multicard.checkpoints import files as checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UsageError, match=r"cannot write .*state.pt \(No space left on device\): free space"):
        checkpoint.write_atomic({"a": 1}, tmp_path / "state.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["config"].update(batch_size="24"), "config.s batch_size or epochs is not a positive"),
    (lambda s: s.update(history="x"), "history is not a list"),
    (lambda s: s["loader"].update(epoch=10**12), "epoch .1000000000000. does not fit"),
    (lambda s: s["loader"].update(samples=1e9), "samples .1000000000.0. is more than"),
    (lambda s: s["loader"].update(samples=10**9), "samples .1000000000. is more than"),
    (lambda s: s.update(steps=-1), "steps .-1. is not a whole number"),
])
def test_a_hand_edited_checkpoint_is_one_line_at_resume(earlier, tmp_path, edit, words):
    state = torch.load(resume.resolve("auto", earlier), weights_only=True)
    edit(state)
    torch.save(state, tmp_path / "state.pt")
    with pytest.raises(UsageError, match=rf"--resume .*state.pt: its {words}.*edited or damaged"):
        resume.head(tmp_path / "state.pt")
