"""--out and what multicard finds in it that it did not make: links, FIFOs, forged markers and huge files in
checkpoints/ are never written through, read whole or hung on; a folder multicard has just made swapped for a link
to a victim's, or --out itself renamed away mid-run for a link to another run's, redirects nothing; an --out, its
checkpoints folder or a folder above it that another user owns or others can write into is refused in one line,
unless trusted (--trust-dir, MULTICARD_TRUST_DIR); publish's links and a refused claim leave nothing behind.
Checkpoints are made by hand where a run is not needed (conftest.earlier); a FIFO is tried in a child process with a
time limit, so a regression fails instead of hanging the suite. The other user is played in this process (same uid),
at the moment the race would be won: right after the folder is made, while the run writes into it, at a hook (a
forward that renames --out), or by what os.stat says."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import OLD, Small, bounded, earlier, light, note, run_cli, states, train
from multicard import safefs
from multicard.checkpoints import resume, shards, trainer_saves
from multicard.errors import UsageError
from multicard.trainer.outdir import Output
from multicard.trainer.report import Report
from test_damaged import sparse_zip


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root (links not followed): a file's bytes, a link's target, None for anything else."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else p.read_bytes()
            if safefs.kind(p) == "file" else None for p in sorted(root.rglob("*"))}


# -- writes outside --out ---------------------------------------------------------------------------------------------
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
        trainer_saves.claim(out, None)
    assert tree(out) == before and list(outside.iterdir()) == []
    (out / "checkpoints" / f"run-{OLD}").unlink()
    (out / "checkpoints" / f"run-{OLD}").write_text("mine")  # a file under that name: the same one line
    with pytest.raises(UsageError, match=rf"run-{OLD}: is a file, not a folder"):
        trainer_saves.claim(out, None)


def test_run_json_is_never_written_through_a_planted_temporary(tmp_path):
    victim, out = tmp_path / "victim", tmp_path / "out"
    victim.write_text("mine")
    earlier(out)
    for name in (f"run.json.{os.getpid()}.tmp", "run.json.tmp", "run.json.part"):  # the names once used, and more
        os.symlink(victim, out / "checkpoints" / name)
    run = trainer_saves.claim(out, None)
    assert victim.read_text() == "mine"
    assert safefs.kind(out / "checkpoints" / "run.json") == "file" and resume.owner(out)["run"] == run


@pytest.mark.parametrize("marker", [b"x/../../../somewhere", b"../../escaped", b"\xff\xfe not utf-8", b"a\0b",
                                    b"a" * 300, b"20240101T000000-abcdef/../../x"],
                         ids=["dotdot", "up", "not-utf8", "nul", "long", "id-then-dotdot"])
def test_a_forged_marker_moves_nothing_out_of_out(tmp_path, marker):
    out = tmp_path / "deep" / "out"
    made = earlier(out)
    (made[0] / ".multicard").write_bytes(marker)
    run = trainer_saves.claim(out, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep"] and os.listdir(tmp_path / "deep") == ["out"]
    unnamed = out / "checkpoints" / f"run-unnamed-{run}" / "step-00000001" / "state.pt"
    assert note(unnamed) == f"{OLD} 1"  # kept aside under a name multicard makes, not one read from a file
    assert states(out) == [f"{OLD} {s}" for s in (1, 2, 3)]
    assert trainer_saves.claim(out, None) != run  # and the next run into that --out is not stopped by it


# -- hangs: nothing but a regular file is opened ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_fifo_run_json_is_one_line_not_a_hang(tmp_path):
    earlier(tmp_path)
    (tmp_path / "checkpoints" / "run.json").unlink()
    os.mkfifo(tmp_path / "checkpoints" / "run.json")
    done = bounded(f"from multicard.checkpoints import resume, trainer_saves\nfrom multicard.errors import UsageError\n"
                   f"try:\n    resume.resolve('auto', {str(tmp_path)!r})\nexcept UsageError as e:\n    print(e)")
    assert "checkpoints/run.json: is a fifo, not a file multicard wrote" in done.stdout, done.stderr


def test_a_fifo_marker_is_not_read_and_the_checkpoint_kept_aside(tmp_path):
    made = earlier(tmp_path)
    (made[1] / ".multicard").unlink()
    os.mkfifo(made[1] / ".multicard")
    done = bounded(f"from multicard.checkpoints import trainer_saves as s\nprint(s.claim({str(tmp_path)!r}, None))")
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
        trainer_saves.claim(tmp_path, None)


# -- names multicard uses, taken by something else --------------------------------------------------------------------
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
        trainer_saves.fresh(checkpoints, part, OLD)
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
        trainer_saves.claim(tmp_path, None)
    monkeypatch.undo()
    monkeypatch.setattr(os, "replace", refused)  # the folders made, run.json not written
    with pytest.raises(UsageError, match=r"cannot write into checkpoints/ \(Permission denied\)"):
        trainer_saves.claim(tmp_path, None)
    monkeypatch.undo()
    assert resume.owner(tmp_path)["run"] == OLD


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


# -- the race: a folder multicard made, swapped for a link ------------------------------------------------------------
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
    out, fresh = tmp_path / "out", trainer_saves.fresh
    swapped = []

    def freshly(*args):
        made = fresh(*args)
        if not swapped:
            part = next(a for a in args if isinstance(a, Path))
            swap(part, victim)
            swapped.append(part)
        return made

    monkeypatch.setattr(trainer_saves, "fresh", freshly)
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
        made = shards.new_folder

        def fresh(path, save):
            held = made(path, save)
            swap(path.with_name(Path(getattr(held, "shown", held)).name), folder / "victim")
            shards.new_folder = made
            return held

        shards.new_folder = fresh  # in this process only
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


# -- the whole path to --out ------------------------------------------------------------------------------------------
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


# -- folders others can write into, or another user's; the trust that lifts the refusal -------------------------------
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
