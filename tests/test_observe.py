"""Seeing a run: TensorBoard event files (read back with tensorboard's own reader), curves.png, the straggler
among the ranks, and the plain progress line where no terminal shows the bar."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time

import pytest
import torch

import multicard
from conftest import shown, tiny_images
from multicard.cli import main
from multicard.errors import UsageError
from multicard.models import LeNet5
from multicard.trainer.config import TrainConfig
from multicard.trainer.observe import Progress, curves, straggler
from multicard.trainer.outdir import FILES, Output

# 96 samples, 16 per step: 6 optimizer steps per epoch
TINY = dict(strategy="single", devices="cpu", epochs=2, batch_size=16, lr=4e-3, augment=False, quiet=True, seed=0)
PNG = b"\x89PNG\r\n\x1a\n"


def tiny_run(out, model=None, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(model or LeNet5(), tiny_images(96), tiny_images(30, 1), out=str(out),
                           **{**TINY, **overrides})


def scalars(folder) -> dict[str, list]:
    """{tag: [(step, value), ...]} as TensorBoard itself reads the event files in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    """One small run seen every way: event files, curves.png, and what it printed where stdout and stderr are
    files (no terminal, as in a log or CI), with a progress line as often as it may."""
    out, printed = tmp_path_factory.mktemp("tb"), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        tiny_run(out, tensorboard=True, quiet=False, progress_every=1e-6)
    return out, printed.getvalue()


def test_tensorboard_event_files_hold_steps_and_epochs(tensorboard_run):
    out, _ = tensorboard_run
    assert os.readlink(out / "tensorboard") == ".current/tensorboard"  # published with the run's other files
    tags = scalars(out / "tensorboard")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # per step (every step in a 6-step epoch), at the optimizer step
    assert [step for step, _ in tags["train/loss"]] == list(range(1, 13))
    assert [step for step, _ in tags["train/lr"]] == list(range(1, 13))
    # per epoch, at the step each ended on, the values of metrics.jsonl
    for name in ("train_loss", "test_loss", "test_accuracy", "lr", "samples_per_s", "lag"):
        assert tags[f"epoch/{name}"] == [(6, pytest.approx(metrics[0][name])), (12, pytest.approx(metrics[1][name]))]
    assert [step for step, _ in tags["rank_seconds/0"]] == [6, 12]
    # the step losses are means over the steps since the last point: together, the epoch's loss
    first_epoch = sum(v for _, v in tags["train/loss"][:6]) / 6
    assert first_epoch == pytest.approx(metrics[0]["train_loss"], rel=1e-5)


def test_curves_png_is_shown_with_the_run(tensorboard_run):
    out, _ = tensorboard_run
    assert list(shown(out)) == sorted(FILES)
    raw = (out / "curves.png").read_bytes()
    assert raw.startswith(PNG) and len(raw) > 10_000
    assert os.readlink(out / "curves.png") == ".current/curves.png"


def test_curves_without_a_test_set(tmp_path):
    history = [{"epoch": e, "train_loss": 2.0 / e, "lr": 0.1 * 0.5 ** e} for e in (1, 2, 3)]
    curves(history, tmp_path / "curves.png", "no test set")
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)


def test_a_later_run_without_tensorboard_drops_the_link(tmp_path):
    with Output(str(tmp_path)) as output:
        for with_events in (True, False):
            run = output.new_run()
            for name in FILES:
                (run / name).write_text(name)
            if with_events:
                (run / "tensorboard").mkdir()
            output.publish(run)
            assert (tmp_path / "tensorboard").exists() == with_events
            assert not (tmp_path / "tensorboard").is_symlink() or with_events  # no dangling link either


class Recorder:
    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def close(self):
        self.closed = True


def test_the_front_object_logs_on_rank_0(tmp_path):
    recorder = Recorder()
    mc = multicard.Multicard("single", "cpu", loggers=["tensorboard", recorder], log_dir=tmp_path / "logs")
    mc.log({"train/loss": torch.tensor(0.5), "lr": 0.1, "epoch": 3}, step=7)
    with pytest.raises(UsageError, match=r"log: note='hello' is not a number"):
        mc.log({"note": "hello"}, step=8)
    mc.close()
    assert recorder.logged == [(7, {"train/loss": 0.5, "lr": 0.1, "epoch": 3.0})] and recorder.closed
    assert scalars(tmp_path / "logs") == {"train/loss": [(7, 0.5)], "lr": [(7, pytest.approx(0.1))],
                                          "epoch": [(7, 3.0)]}
    with pytest.raises(UsageError, match=r"loggers='wandb': give 'tensorboard' or an object with log"):
        multicard.Multicard("single", "cpu", loggers="wandb")
    multicard.Multicard("single", "cpu").log({"x": 1}, 0)  # no loggers: nothing, and no error


def test_without_tensorboard_installed_it_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    extra = r"needs the tensorboard package: pip install 'multicard\[tensorboard\]'"
    with pytest.raises(UsageError, match=extra):
        TrainConfig(tensorboard=True).validate()
    with pytest.raises(UsageError, match=extra):
        multicard.Multicard("single", "cpu", loggers="tensorboard")
    assert main(["train", "--tensorboard", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.search(f"^multicard: error: --tensorboard {extra}$", err[0]), err
    assert not (tmp_path / "out").exists()


class SlowOnRank1(LeNet5):
    """Rank 1 takes 800 ms more for each training forward: a straggler made on purpose (2.4 s over the median)."""

    def forward(self, x):
        if self.training and os.environ.get("RANK") == "1":
            time.sleep(0.8)
        return super().forward(x)


@pytest.mark.slow
def test_the_slowest_rank_is_named(tmp_path, capfd):
    summary = tiny_run(tmp_path, SlowOnRank1(), strategy="ddp", devices="cpu:2", epochs=1, quiet=False)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    for what in (record, summary):
        assert len(what["rank_seconds"]) == 2 and what["slowest_rank"] == 1 and what["lag"] > 0.2, what
        assert what["rank_seconds"][1] - what["rank_seconds"][0] > 4.2  # 6 steps x 800 ms, less noise
    out = capfd.readouterr().out
    assert re.search(r"epoch 1/1 .* slowest rank 1 \+\d+%", out), out
    assert re.search(r"warning: rank 1 is a straggler in epoch 1: its own time was \d+% over the median", out), out
    assert re.search(r"done: .*; rank 1 is a straggler over the run", out), out


def test_straggler_takes_the_median():
    assert straggler([1.0, 1.0, 1.5]) == (2, pytest.approx(0.5))
    assert straggler([2.0, 1.0, 1.0, 1.0]) == (0, pytest.approx(1.0))
    assert straggler([0.7]) == (0, 0.0)


def test_a_plain_progress_line_when_not_on_a_terminal(tensorboard_run):
    _, printed = tensorboard_run
    lines = [line for line in printed.splitlines() if " step " in line]
    assert len(lines) == 12, printed  # one per batch here: no wait is long enough to skip one
    for epoch, line in zip((1,) * 6 + (2,) * 6, lines, strict=True):
        assert re.fullmatch(rf"multicard: epoch {epoch}/2 step \d/6, [\d,]+ samples/s", line), line
    assert re.search(r"^multicard: wrote .*/curves\.png, .*/tensorboard$", printed, re.M), printed
    with pytest.raises(UsageError, match=r"--progress-every -1: must be a number of 0 or more"):
        TrainConfig(progress_every=-1).validate()


def test_progress_waits_its_interval():
    said = []
    progress = Progress(3600, 5, 100, said.append)
    for step in range(1, 101):
        progress.tick(1, step, 64)
    assert said == []  # an hour has not passed
    progress.last -= 3600
    progress.tick(2, 7, 64)
    assert len(said) == 1 and said[0].startswith("epoch 2/5 step 7/100, ")
