"""Issue 39, a fifth hostile round: the whole path to --out (renamed away mid-run for a link to another run's, a
folder above it another user's, and the trust setting that lifts the refusal), damage that falls back and is named
truly, the front object pickled, a job that never hangs (train at a script's top level, SIGTERM to any job), a
closed stdout (`| head`). The other user is played in this process at a hook (a forward that renames --out), or by
what os.stat says; each job of a script runs in a session of its own with a time limit, so a regression fails
instead of hanging the suite, and whatever it left running is killed."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import ROOT, run_cli, tiny_images
from multicard.checkpoints import resume
from multicard.errors import UsageError
from test_damaged import flip, sparse_zip
from test_faults import clean_env, gone, running
from test_hostile3 import tree


def left(tmp_path: Path) -> list[int]:
    """The processes a test's job left running: each is started with TMPDIR at the test's own folder (ranks lead
    sessions of their own, so the launcher's process group does not hold them)."""
    mark, found = f"TMPDIR={tmp_path}".encode(), []
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return running(found)


@pytest.fixture(autouse=True)
def nothing_left(tmp_path):
    """Whatever a test started is gone once it ends, passed or failed."""
    yield
    for pid in left(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def session(command: list[str], tmp_path: Path, cwd: Path | str) -> subprocess.Popen:
    """`command` in a session of its own, with TMPDIR at the test's folder, its output read here as text."""
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(TMPDIR=str(tmp_path)), start_new_session=True)


def started(tmp_path: Path, body: str, *args: str) -> subprocess.Popen:
    """`body` as the script job.py, run in a session of its own."""
    (tmp_path / "job.py").write_text(textwrap.dedent(body))
    return session([sys.executable, str(tmp_path / "job.py"), *args], tmp_path, tmp_path)


def ended(process: subprocess.Popen, within: float) -> tuple[int, str, str]:
    """Its exit status, stdout and stderr; killed with its whole group if it has not ended `within` seconds."""
    try:
        out, err = process.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"still running after {within} s: {err[-2000:]}")
    return process.returncode, out or "", err


def up(process: subprocess.Popen, ranks: int, within: float = 120) -> None:
    """Wait until every rank has said "up" on stdout."""
    deadline, seen = time.monotonic() + within, 0
    while seen < ranks:
        assert time.monotonic() < deadline, "the ranks did not start"
        seen += process.stdout.readline().count("up")  # print writes "up" and "\n" apart: lines may interleave


# -- the whole path to --out -----------------------------------------------------------------------------------------
class Small(nn.Sequential):
    """A model small enough that a run of a few steps costs little (LeNet-5's steps are what other tests time)."""

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))


def light(out: Path, model: nn.Module | None = None, **overrides) -> dict:
    """A run of Small on 48 images, 2 steps an epoch, into `out`."""
    torch.manual_seed(0)
    return multicard.train(model or Small(), tiny_images(48), None, out=str(out), **{
        **dict(quiet=True, strategy="single", devices="cpu", batch_size=24, epochs=1), **overrides})


class Swapping(Small):
    """Small, whose forward plays the other user on rank 0's `at`-th training call (after checkpoint at-1, before
    checkpoint `at`): --out renamed away in the folder above it, and a link to `victim` put in its place."""

    def __init__(self, out: Path, victim: Path, at: int):
        super().__init__()
        self.out, self.victim, self.at, self.calls = str(out), str(victim), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.calls == self.at and self.training and os.environ.get("RANK", "0") == "0":
            os.replace(self.out, self.out + "-moved")
            os.symlink(self.victim, self.out)
        return super().forward(x)


def out_swapped_mid_run(tmp_path: Path, processes: int) -> None:
    """Another multicard run's --out sits beside ours in a shared folder, which we trust; mid-run its other user
    renames our --out away and links theirs in its place. Nothing of theirs changes: our checkpoints, run.json
    and the shown run land in our folder, wherever it went."""
    shared = tmp_path / "shared"
    shared.mkdir()
    light(shared / "theirs", save_every_steps=1, epochs=2)  # its step-3 and step-4 kept
    before = tree(shared / "theirs")
    shared.chmod(0o777)  # a group's folder: any of them may rename what is in it
    try:
        light(shared / "mine", Swapping(shared / "mine", shared / "theirs", at=2), epochs=3, save_every_steps=1,
              trust_dir=str(shared), **({"strategy": "ddp", "devices": f"cpu:{processes}"} if processes > 1 else {}))
    finally:  # however the run ended
        assert tree(shared / "theirs") == before
    assert os.readlink(shared / "mine") == str(shared / "theirs")  # the link stays theirs to remove
    moved = shared / "mine-moved"
    mine = resume.owner(moved)["run"]
    assert [p.name for p in resume.whole(moved, mine)] == ["step-00000005", "step-00000006"]
    assert (moved / "model.pt").is_file() and (moved / ".current").is_symlink()


def test_out_renamed_away_mid_run_for_a_link_to_another_runs_out_redirects_nothing(tmp_path):
    out_swapped_mid_run(tmp_path, 1)


@pytest.mark.slow  # rank 0 finds --out from its run folder alike in one process (above) and in a spawned one
@pytest.mark.parametrize("processes", [2, 3])
def test_out_renamed_away_mid_run_redirects_nothing_from_spawned_ranks(tmp_path, processes):
    out_swapped_mid_run(tmp_path, processes)


def owned_by_another(monkeypatch, folder: Path, uid: int = 65534) -> None:
    """What os.stat, os.lstat and os.fstat say of `folder`: owned by another user (nobody, 65534)."""
    mine = os.stat(folder)

    def faked(real):
        def said(*args, **kwargs):
            found = real(*args, **kwargs)
            if (found.st_dev, found.st_ino) != (mine.st_dev, mine.st_ino):
                return found
            return os.stat_result((found.st_mode, found.st_ino, found.st_dev, found.st_nlink, uid, found.st_gid,
                                   found.st_size, int(found.st_atime), int(found.st_mtime), int(found.st_ctime)))
        return said

    for name in ("stat", "lstat", "fstat"):
        monkeypatch.setattr(os, name, faked(getattr(os, name)))


@pytest.mark.parametrize("below", ["", "run1", "run1/deeper"])
def test_an_out_in_or_below_another_users_folder_gets_one_verdict_naming_the_way_out(tmp_path, monkeypatch, below):
    vol = tmp_path / "vol"
    vol.mkdir()
    owned_by_another(monkeypatch, vol)
    out = vol / below if below else vol
    with pytest.raises(UsageError) as refused:
        light(out)
    assert str(refused.value) == (
        f"--out {f'{out}: {vol}' if below else vol}: belongs to another user (uid 65534), who could swap what "
        f"multicard makes there for a link elsewhere; use a folder of your own (or chown it to you), or trust it: "
        f"--trust-dir {vol} (or MULTICARD_TRUST_DIR={vol})")
    assert list(vol.iterdir()) == []  # nothing made, nothing written


def test_trusting_the_folder_by_flag_or_variable_lifts_the_refusal(tmp_path, monkeypatch):
    vol = tmp_path / "vol"
    vol.mkdir()
    owned_by_another(monkeypatch, vol)
    light(vol / "run1", trust_dir=[tmp_path / "elsewhere", str(vol)])  # several: a list (paths or str)
    assert (vol / "run1" / "model.pt").is_file()
    monkeypatch.setenv("MULTICARD_TRUST_DIR", str(vol / "run2"))  # a folder inside trusts the folders above it
    light(vol / "run2")
    assert (vol / "run2" / "model.pt").is_file()
    monkeypatch.setenv("MULTICARD_TRUST_DIR", f"{tmp_path / 'elsewhere'}:{vol}")  # the variable: ":" separates, as PATH
    light(vol / "run3")
    assert (vol / "run3" / "model.pt").is_file()


def test_a_folder_with_a_colon_in_its_name_is_trusted_whole_by_the_keyword(tmp_path, monkeypatch):
    """--trust-dir's value is one path, ":" and all: the refusal's way out works as it says, and "a:b" never
    trusts a and b (the variable alone separates by ":"; it would split this name, so the refusal names only the
    flag)."""
    vol = tmp_path / "vol:2026"
    vol.mkdir()
    owned_by_another(monkeypatch, vol)
    with pytest.raises(UsageError) as refused:
        light(vol / "run", trust_dir=f"{tmp_path / 'elsewhere'}:{vol}")  # one path, that leads nowhere
    assert str(refused.value) == (
        f"--out {vol / 'run'}: {vol}: belongs to another user (uid 65534), who could swap what multicard makes there "
        f"for a link elsewhere; use a folder of your own (or chown it to you), or trust it: --trust-dir {vol}")
    light(vol / "run", trust_dir=str(vol))
    light(vol / "run2", trust_dir=vol)  # a path as well
    assert (vol / "run" / "model.pt").is_file() and (vol / "run2" / "model.pt").is_file()
    summary = json.loads((vol / "run" / "summary.json").read_text())
    assert summary["config"]["trust_dir"] == [str(vol)]  # held as a tuple: JSON's list


def test_a_resumed_run_never_takes_its_trust_from_the_checkpoint(tmp_path, monkeypatch):
    vol = tmp_path / "vol"
    vol.mkdir()
    owned_by_another(monkeypatch, vol)
    light(vol / "run", trust_dir=[str(vol)], save_every_steps=1)
    with pytest.raises(UsageError, match=f"or trust it: --trust-dir {vol} "):
        light(vol / "run", resume="auto")
    assert light(vol / "run", resume="auto", trust_dir=[str(vol)])["resumed_from"]


def planted(out: Path) -> Path:
    """A stranger's checkpoint in `out`: a state.pt whose one entry records 1 TB, every byte a hole (8 KB of disk)."""
    step = out / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    sparse_zip(step / "state.pt")
    return step / "state.pt"


@pytest.mark.parametrize("owned", ["out", "checkpoints"])
def test_resume_in_a_strangers_out_is_refused_before_any_checkpoint_there_is_read(tmp_path, monkeypatch, owned):
    out = tmp_path / "theirs"
    state = planted(out)
    owned_by_another(monkeypatch, out if owned == "out" else out / "checkpoints")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    with pytest.raises(UsageError) as refused:
        light(out, resume="auto")
    assert str(refused.value).startswith(f"--out {out}{': checkpoints' if owned == 'checkpoints' else ''}: belongs "
                                         f"to another user (uid 65534)")
    assert not [p for p in opened if p.startswith(f"{out / 'checkpoints'}/")]  # nothing in it: its owner first
    assert state.stat().st_size > 2**40  # untouched


def test_a_sparse_checkpoint_in_a_trusted_out_is_passed_over_without_reading_it(tmp_path, monkeypatch, capsys):
    vol = tmp_path / "vol"
    vol.mkdir()
    light(vol / "run", save_every_steps=1, epochs=2)  # step-3 and step-4 kept
    owned_by_another(monkeypatch, vol)
    step = vol / "run" / "checkpoints" / "step-00000005"
    shutil.copytree(vol / "run" / "checkpoints" / "step-00000004", step)
    sparse_zip(step / "state.pt")  # its marker says it is this run's: --resume auto would go on from it
    summary = light(vol / "run", resume="auto", trust_dir=[str(vol)], quiet=False, epochs=2)
    assert summary["resumed_from"] == str(vol / "run" / "checkpoints" / "step-00000004" / "state.pt")
    assert "not from the newer step-00000005 is damaged (its state.pt: 1,099,511,628,026 bytes of which" in \
        capsys.readouterr().out


def test_an_out_below_a_folder_others_can_write_into_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    with pytest.raises(UsageError) as refused:
        light(shared / "run")
    assert str(refused.value) == (
        f"--out {shared / 'run'}: {shared}: other users can write into it (drwxrwxr-x) and could swap what multicard "
        f"makes there for a link elsewhere; run `chmod go-w {shared}` or choose another folder, or trust it: "
        f"--trust-dir {shared} (or MULTICARD_TRUST_DIR={shared})")
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
    light(shared / "run")
    assert (shared / "run" / "model.pt").is_file()


def test_the_refusal_on_the_command_line_names_the_flag_and_a_trust_elsewhere_does_not_lift_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = run_cli("train", "--out", str(shared / "run"), "--trust-dir", str(tmp_path / "elsewhere"), "--data",
                   "synthetic", "--synthetic-samples", "64", timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"multicard: error: --out {shared / 'run'}: {shared}: other users can write into it (drwxrwxrwx) and could "
        f"swap what multicard makes there for a link elsewhere; run `chmod go-w {shared}` or choose another folder, "
        f"or trust it: --trust-dir {shared} (or MULTICARD_TRUST_DIR={shared})"], done.stderr


def test_the_flag_again_trusts_two_folders_each_named_whole_colons_and_all(tmp_path):
    """--out x:1/to/run, where x:1 is writable by others and its link `to` leads into y:2, writable by others too:
    both folders need trusting, each named by a --trust-dir of its own (each value one path, ":" included)."""
    x, y = tmp_path / "x:1", tmp_path / "y:2"
    for folder in (x, y):
        folder.mkdir()
        folder.chmod(0o777)
    (x / "to").symlink_to(y)
    out = x / "to" / "run"
    with pytest.raises(UsageError, match=f"or trust it: --trust-dir {y}$"):  # one alone does not lift it
        light(out, trust_dir=[x])
    done = run_cli("train", "--out", str(out), "--trust-dir", str(x), "--trust-dir", str(y), "--data", "synthetic",
                   "--synthetic-samples", "64", "--epochs", "1", "--batch-size", "32", "--quiet", timeout=120)
    assert done.returncode == 0, done.stderr
    assert (y / "run" / "model.pt").is_file()
    assert json.loads((y / "run" / "summary.json").read_text())["config"]["trust_dir"] == [str(x), str(y)]


# -- damage that falls back, named truly -----------------------------------------------------------------------------
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


# -- the front object pickles ----------------------------------------------------------------------------------------
class Seen(torch.utils.data.Dataset):
    """A dataset holding the Multicard, as a user hands it to the DataLoader's workers."""

    def __init__(self, mc):
        self.mc = mc

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        self.mc.print(f"a worker of rank {self.mc.rank}")  # rank 0's worker prints, the others do not
        return torch.tensor([self.mc.rank, self.mc.world_size, self.mc.device.type == "cpu"])


def pickled_job(mc, workers: int) -> list:
    model = mc.setup(nn.Linear(2, 1))
    sgd = mc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(4, 2)).sum().backward()
    sgd.step()
    data = pickle.dumps(mc)
    copy = pickle.loads(data)
    loader = torch.utils.data.DataLoader(Seen(mc), batch_size=2, num_workers=workers,
                                         multiprocessing_context="spawn" if workers else None)
    return mc.gather((copy.rank, copy.world_size, copy.device.type, len(data), next(iter(loader)).tolist()))


def test_the_front_object_pickles_without_its_models_and_a_copy_tells_its_rank(capfd):
    mc = multicard.Multicard(devices="cpu")
    [(rank, world, device, size, seen)] = mc.launch(pickled_job, 0)
    assert (rank, world, device) == (0, 1, "cpu") and seen == [[0, 1, 1]] * 2
    assert size < 4096  # the set-up model and optimizer stay behind: a copy compares nothing
    assert capfd.readouterr().out == "a worker of rank 0\n" * 2


@pytest.mark.slow  # each rank spawns a worker that imports torch: the pickling itself is the test above
def test_a_spawned_dataloader_worker_gets_the_front_object_of_its_rank(capfd):
    processes = 3
    said = multicard.launch(pickled_job, 1, devices=f"cpu:{processes}")
    assert [row[:3] for row in said] == [(r, processes, "cpu") for r in range(processes)]
    assert [row[4] for row in said] == [[[r, processes, 1]] * 2 for r in range(processes)]
    assert capfd.readouterr().out == "a worker of rank 0\n" * 2


# -- a job never hangs -----------------------------------------------------------------------------------------------
UNGUARDED = """
    import sys, torch, multicard
    from torch import nn
    from torch.utils.data import TensorDataset
    data = TensorDataset(torch.randn(8192, 16), torch.randint(0, 2, (8192,)))  # pickled, far more than a pipe holds
    try:
        multicard.train(nn.Linear(16, 2), data, None, out="out", devices="cpu:2", strategy="ddp", epochs=1,
                        batch_size=64, quiet=True)
    except multicard.UsageError as e:
        print(f"UsageError: {e}", file=sys.stderr)
        sys.exit(2)
"""


def test_train_at_the_top_level_of_a_script_is_one_line_saying_what_to_add_not_a_hang(tmp_path):
    """Each rank runs the script's top level again and met train there: it ends at once, the launcher says why, and
    --out is as it was (no false "another run is writing there", no hang writing to a rank that is gone)."""
    job = started(tmp_path, UNGUARDED)
    code, _, err = ended(job, 120)
    assert code == 2 and err.splitlines() == [
        "UsageError: job.py calls multicard.launch (or train) at its top level, which every process it starts runs "
        "again: put that call under `if __name__ == \"__main__\":`"], err
    assert list((tmp_path / "out").iterdir()) == []
    assert gone(lambda: left(tmp_path), 10)


LIBRARY_JOB = """
    import sys, time, torch, multicard
    from torch import nn
    from torch.utils.data import TensorDataset

    class Slow(nn.Linear):
        def forward(self, x):
            time.sleep(0.05)
            return super().forward(x)

    def job(mc):
        print("up", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        devices = f"cpu:{sys.argv[2]}"
        if sys.argv[1] == "train":
            data = TensorDataset(torch.randn(4608, 16), torch.randint(0, 2, (4608,)))
            multicard.train(Slow(16, 2), data, None, out="out", devices=devices, strategy="ddp", epochs=50,
                            batch_size=96, save_every_steps=2)
        else:
            multicard.launch(job, devices=devices)
"""


def sigterm_ends_the_library_job(tmp_path: Path, how: str, processes: int) -> None:
    job = started(tmp_path, LIBRARY_JOB, how, str(processes))
    if how == "train":  # --out holds an earlier run's files, which the stopped one leaves as they were
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
        deadline = time.monotonic() + 120
        while not list((tmp_path / "out").glob("checkpoints/step-*")):
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint came"
            time.sleep(0.1)
    else:
        up(job, processes)
    before = time.monotonic()
    job.send_signal(signal.SIGTERM)
    code, _, err = ended(job, 60)
    assert code == -signal.SIGTERM, err
    assert err.splitlines()[-1] == "multicard: stopped by SIGTERM; every rank was stopped", err
    assert "Traceback" not in err
    assert time.monotonic() - before < 30  # the ranks get 5 s after SIGTERM, then SIGKILL
    assert gone(lambda: left(tmp_path), 10)
    if how == "train":
        assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == \
            ["checkpoints", "notes.txt"]
        assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and not list((tmp_path / "out").glob(".run-*"))


@pytest.mark.slow
def test_sigterm_ends_a_train_call_and_its_ranks_as_the_signal_would(tmp_path):
    sigterm_ends_the_library_job(tmp_path, "train", 2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["train", "launch"])
def test_sigterm_ends_a_three_process_library_job(tmp_path, how):
    sigterm_ends_the_library_job(tmp_path, how, 3)


# -- a closed stdout -------------------------------------------------------------------------------------------------
TALKS = """
    import multicard
    mc = multicard.Multicard()
    step = 0
    while True:  # until stdout is closed under it
        mc.all_reduce(1.0)
        mc.print(f"line {step}")
        step += 1
"""


def head_of_multicard_run(tmp_path: Path, processes: int) -> None:
    """`multicard run script.py | head -2`: the reader goes after two lines; the job ends as `yes | head -2`
    does (by SIGPIPE, a shell shows 141), without a word on stderr, no rank left."""
    (tmp_path / "job.py").write_text(textwrap.dedent(TALKS))
    job = session([sys.executable, "-m", "multicard", "run", "--quiet", "--devices", f"cpu:{processes}",
                   str(tmp_path / "job.py")], tmp_path, ROOT)
    assert [job.stdout.readline() for _ in range(2)] == ["line 0\n", "line 1\n"]
    job.stdout.close()  # what head does once it has its lines
    code, _, err = ended(job, 60)
    assert code == -signal.SIGPIPE and err == ""
    assert gone(lambda: left(tmp_path), 10)


@pytest.mark.slow
def test_multicard_run_into_a_closed_pipe_ends_quietly_by_sigpipe(tmp_path):
    head_of_multicard_run(tmp_path, 2)


@pytest.mark.slow
def test_multicard_run_of_three_into_a_closed_pipe_ends_quietly_by_sigpipe(tmp_path):
    head_of_multicard_run(tmp_path, 3)


@pytest.mark.slow
def test_multicard_train_into_a_closed_pipe_ends_quietly_by_sigpipe_and_shows_nothing(tmp_path):
    job = session([sys.executable, "-m", "multicard", "train", "--devices", "cpu:2", "--data", "synthetic",
                   "--synthetic-samples", "512", "--epochs", "3", "--out", str(tmp_path / "out")], tmp_path, ROOT)
    assert job.stdout.readline().startswith("multicard: training LeNet5")
    job.stdout.close()
    code, _, err = ended(job, 120)
    assert code == -signal.SIGPIPE and err == ""
    assert gone(lambda: left(tmp_path), 10)
    assert list((tmp_path / "out").iterdir()) == []
