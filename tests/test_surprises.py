"""No surprises (issue 20): a resume that knows the whole run (and of a finished run, says so), a straggler named
only when it matters, flags that do nothing said to do nothing, and a bad flag answered in one line."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

import multicard
from conftest import run_cli, shown, tiny_images
from multicard.cli import main
from multicard.errors import UsageError
from multicard.models import LeNet5
from multicard.trainer.config import TrainConfig, idle
from multicard.trainer.observe import curves
from multicard.trainer.report import Report

FAST = {"OMP_NUM_THREADS": "1"}
SMALL = dict(strategy="single", devices="cpu", quiet=True, batch_size=24, epochs=2)  # 96 samples: 4 steps/epoch


def small_run(out: Path, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(96), tiny_images(30, 1), out=str(out), **{**SMALL, **overrides})


@pytest.fixture(scope="module")
def cosine(tmp_path_factory) -> Path:
    """A finished 2-epoch run with a recipe unlike the defaults, checkpointed every epoch."""
    out = tmp_path_factory.mktemp("cosine")
    small_run(out, optimizer="sgd", scheduler="cosine", lr=0.05, save_every=1)
    return out


def test_resuming_a_finished_run_says_so_and_writes_its_files_again(cosine, capsys):
    before = shown(cosine)
    small_run(cosine, resume="auto")  # nothing else given: the run's own recipe (sgd, cosine, 2 epochs)
    said = capsys.readouterr().out
    assert "the run had finished its 2 epochs (8 optimizer steps): nothing left to train" in said, said
    after = shown(cosine)
    assert after["model.pt"] == before["model.pt"] and after["metrics.jsonl"] == before["metrics.jsonl"]
    assert json.loads(after["summary.json"])["config"]["optimizer"] == "sgd"


def test_a_bare_resume_takes_the_whole_recipe(cosine, tmp_path):
    config = multicard.trainer.recipe.inherit(multicard.checkpoints.resume.resolve("auto", cosine), TrainConfig())
    assert (config.optimizer, config.scheduler, config.epochs, config.save_every, config.lr) == \
        ("sgd", "cosine", 2, 1, 0.05)


@pytest.mark.parametrize("flags, words", [
    (dict(epochs=4), "--epochs 4: the run's cosine schedule is laid over its 2 epochs"),
    (dict(optimizer="adam"), "--optimizer adam: the run in .* has --optimizer sgd, which a resume keeps"),
    (dict(lr=0.1), "--lr 0.1: the run in .* has --lr 0.05"),
    (dict(epochs=1), "--epochs 1: the run in .* has trained 2 epochs already"),
])
def test_a_resume_refuses_what_it_cannot_change_naming_the_flag(cosine, flags, words):
    with pytest.raises(UsageError, match=words):
        small_run(cosine, resume="auto", **flags)


@pytest.mark.slow
def test_more_epochs_extend_a_step_schedule_and_the_change_is_said(tmp_path, capsys):
    small_run(tmp_path / "long", scheduler="step", epochs=3)
    small_run(tmp_path / "cut", scheduler="step", save_every=1)
    capsys.readouterr()
    small_run(tmp_path / "cut", resume="auto", epochs=3, quiet=False)
    said = capsys.readouterr().out
    assert "epoch 3, 0 samples in, after 8 optimizer steps; changed: --epochs 3 (it had 2)" in said, said
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 3 and lrs[-1] > 0
    one = torch.load(tmp_path / "long" / "model.pt", weights_only=True)
    two = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(one.values(), two.values(), strict=True))


@pytest.mark.slow
def test_the_readmes_two_commands_in_order(tmp_path):
    first = ["train", "--data", "synthetic", "--synthetic-samples", "256", "--epochs", "1", "--save-every", "1",
             "--optimizer", "sgd", "--scheduler", "cosine", "--out", "runs/x", "--quiet"]
    assert run_cli(*first, cwd=tmp_path, env=FAST).returncode == 0
    again = run_cli("train", "--resume", "auto", "--out", "runs/x", cwd=tmp_path, env=FAST)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert "the run had finished its 1 epochs" in again.stdout, again.stdout
    more = run_cli("train", "--resume", "auto", "--out", "runs/x", "--epochs", "3", cwd=tmp_path, env=FAST)
    assert more.returncode == 2 and more.stderr.count("\n") == 1 and "--epochs 3: the run's cosine" in more.stderr


def test_curves_of_no_epochs_draw_an_empty_figure(tmp_path):
    curves([], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def epoch(n: int, seconds: list[float]) -> dict:
    slowest = max(range(len(seconds)), key=seconds.__getitem__)
    median = statistics.median(seconds)
    return {"epoch": n, "train_loss": 1.0, "lr": 1e-3, "samples_per_s": 100.0, "seconds": max(seconds),
            "rank_seconds": seconds, "slowest_rank": slowest, "lag": max(seconds) / median - 1}


def test_a_straggler_is_named_only_when_it_lags_in_seconds_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("multicard.jobs.devices.cpu_cores", lambda: 8)
    report = Report(tmp_path, TrainConfig(epochs=3))
    report.epoch([epoch(1, [0.10, 0.13])])  # +30%, 0.03 s: noise
    assert "straggler" not in capsys.readouterr().out
    report.epoch([epoch(1, [0.1, 0.13]), epoch(2, [10.0, 20.0])])  # +33% and 5 s over the median
    assert "warning: rank 1 is a straggler in epoch 2" in capsys.readouterr().out


def test_more_processes_than_cores_say_so_once_instead(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("multicard.jobs.devices.cpu_cores", lambda: 2)
    report = Report(tmp_path, TrainConfig(epochs=4))
    history = []
    for n, seconds in enumerate(([10.0, 10, 10, 19], [19.0, 10, 10, 10], [10.0, 19, 10, 10]), 1):
        history.append(epoch(n, seconds))
        report.epoch(history)
    said = capsys.readouterr().out
    assert "straggler" not in said.replace("no straggler is named", "")
    assert said.count("4 processes share 2 CPU cores") == 1, said


def test_flags_that_do_nothing_here_say_so():
    lines = idle(TrainConfig(save_every_steps=500, save_every=20, sync_bn=True), 1, 16, "LeNet5", False)
    assert lines == ["--save-every-steps 500: no effect, this run has 256 optimizer steps (16 epochs of 16); it "
                     "writes no checkpoint by steps",
                     "--save-every 20: no effect, this run has 16 epochs; it writes no checkpoint by epochs",
                     "--sync-bn: no effect with one process (its BatchNorm statistics are the whole batch's)"]
    assert idle(TrainConfig(sync_bn=True), 2, 16, "LeNet5", False) == ["--sync-bn: no effect, LeNet5 has no "
                                                                       "BatchNorm layer"]
    assert idle(TrainConfig(sync_bn=True, save_every_steps=256, save_every=16), 2, 16, "ResNet8", True) == []
    assert idle(TrainConfig(momentum=0.5, lr_gamma=0.5, compile_mode="max-autotune", fsdp_blocks="Block"), 2, 16,
                "LeNet5", False, "ddp") == [
        "--momentum 0.5: no effect with --optimizer adam (sgd only)",
        "--lr-gamma 0.5: no effect with --scheduler onecycle (step only)",
        "--compile-mode max-autotune: no effect without --compile",
        "--fsdp-blocks Block: no effect under ddp (fsdp only)"]
    assert idle(TrainConfig(optimizer="sgd", momentum=0.5, scheduler="step", lr_gamma=0.5), 1, 16, "LeNet5",
                False) == []


def test_a_run_says_which_flags_do_nothing(tmp_path, capsys):
    small_run(tmp_path, epochs=1, save_every_steps=500, sync_bn=True, quiet=False)
    said = capsys.readouterr().out
    assert "--save-every-steps 500: no effect, this run has 4 optimizer steps" in said, said
    assert "--sync-bn: no effect with one process" in said


@pytest.mark.parametrize("argv, line", [
    (["train", "--lr", "abc"], "multicard train: --lr abc: not a number (or auto) (see multicard train --help)"),
    (["train", "--epochs", "2.5"], "multicard train: --epochs 2.5: not a whole number (see multicard train --help)"),
    (["train", "--optimizer", "lion"], "multicard train: --optimizer lion: choose one of adam, adamw, sgd "
                                       "(see multicard train --help)"),
    (["train", "--lr"], "multicard train: --lr: needs a value (see multicard train --help)"),
    (["bench", "--repeats", "x"], "multicard bench: --repeats x: not a whole number (see multicard bench --help)"),
    (["check", "--steps", "2.5"], "multicard check: --steps 2.5: not a whole number (see multicard check --help)"),
    ([], "multicard: name a command: train, run, check, bench or env (see multicard --help)"),
    (["check", "--tensorboard", "--save-every", "1", "--epochs", "5"],
     "multicard check: --tensorboard: not a flag of multicard check (see multicard check --help)"),
    (["check", "--epochs", "5"], "multicard check: --epochs: not a flag of multicard check "
                                 "(see multicard check --help)"),
])
def test_a_bad_flag_is_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"multicard {multicard.__version__}\n"


def test_help_shows_fsdp_and_no_empty_default():
    for argv in (["--help"], ["run", "--help"], ["train", "--help"]):
        result = run_cli(*argv)
        assert result.returncode == 0 and "fsdp" in result.stdout and "(default: )" not in result.stdout, argv


def test_the_command_line_tells_a_flag_given_from_its_default():
    from multicard.cli import config_from, given, parser

    assert given(parser().parse_args(["train"])) == {}
    typed = parser().parse_args(["train", "--epochs", "16", "--no-augment", "--batch-size", "auto"])
    assert given(typed) == {"epochs": 16, "augment": False, "batch_size": None}  # 16 is the default, yet given
    assert config_from(typed) == TrainConfig(augment=False)
