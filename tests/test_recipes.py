"""The recipe's knobs (optimizers, schedules, accumulation, clipping, fp16, SyncBatchNorm), each through the trainer
and through the front object, and the parity check that can fail."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import multicard
from conftest import run_cli, tiny_images
from multicard.errors import UsageError
from multicard.jobs.devices import Devices
from multicard.jobs.dist import Job
from multicard.models import LeNet5
from multicard.strategies.ddp import DDP
from multicard.strategies.single import Single
from multicard.tools.parity import check
from multicard.trainer.config import TrainConfig
from multicard.yourloop.multicard import Multicard
from test_dp import CPUBalanced
from test_front import CPUDP

PLAIN = dict(strategy="single", devices="cpu", augment=False, quiet=True, seed=0)


def train(out, data=None, **options) -> tuple[dict, dict]:
    """A LeNet-5 run on tiny images; (summary, the trained weights)."""
    torch.manual_seed(0)
    model = LeNet5()
    summary = multicard.train(model, data or tiny_images(200), tiny_images(40, 1), out=str(out),
                              **{**PLAIN, **options})
    return summary, model.state_dict()


def epochs_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    for key in a:
        assert (a[key].double() - b[key].double()).abs().max().item() <= atol, key


# -- accumulation: the update of the whole batch ------------------------------------------------------------------

SGD = dict(optimizer="sgd", lr=0.05, momentum=0.9, epochs=1, batch_size=64)  # 200 samples: the last step has 8


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"),
                                               pytest.param("ddp", "cpu:2", marks=pytest.mark.slow)])
def test_accumulation_ends_with_the_weights_of_the_whole_batch(tmp_path, strategy, devices):
    whole, w1 = train(tmp_path / "whole", **SGD, strategy=strategy, devices=devices)
    parts, w4 = train(tmp_path / "parts", **SGD, strategy=strategy, devices=devices, accumulate=4)
    assert_same_weights(w1, w4)
    assert parts["optimizer_steps"] == whole["optimizer_steps"] == 4 and parts["accumulate"] == 4
    assert parts["per_process_batch_size"] == whole["per_process_batch_size"]


def test_accumulation_that_does_not_split_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"--batch-size 64 does not split over 3 micro-batches x 2 processes; "
                                         r"use a multiple of 6 \(e.g. 60 or 66\)"):
        train(tmp_path, strategy="ddp", devices="cpu:2", batch_size=64, accumulate=3)


def accumulate_in_a_users_loop(mc: Multicard) -> dict:
    """K=3 micro-batches per step of 12 over 50 samples (the last step: 2), as a user writes it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = mc.setup(model, optimizer)
    loader = mc.setup_dataloader(DataLoader(tiny_images(50), 12, shuffle=True), accumulate=3)
    steps = 0
    for x, y in loader:
        with mc.no_backward_sync(model, enabled=not loader.step_ends):
            mc.backward(nn.functional.cross_entropy(model(x), y) * loader.share)
        if loader.step_ends:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return {"steps": steps, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def test_accumulation_in_a_users_loop_matches_whole_batches():
    accumulated = Multicard(devices="cpu").launch(accumulate_in_a_users_loop)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    mc = Multicard(devices="cpu")
    for x, y in mc.setup_dataloader(DataLoader(tiny_images(50), 12, shuffle=True)):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert accumulated["steps"] == 5
    assert_same_weights(model.state_dict(), accumulated["weights"])


# -- optimizers and schedules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, expected", [
    (dict(optimizer="sgd", momentum=0.5, nesterov=True, weight_decay=1e-4), ("SGD", "momentum", 0.5)),
    (dict(optimizer="adamw", weight_decay=0.01), ("AdamW", "weight_decay", 0.01)),
    (dict(), ("Adam", "lr", 8e-3)),  # the auto rate at the auto batch of 256
])
def test_the_optimizer_flags_build_that_optimizer(tmp_path, options, expected, monkeypatch):
    seen = []
    real = multicard.trainer.run.make_optimizer
    monkeypatch.setattr(multicard.trainer.run, "make_optimizer", lambda *a: seen.append(real(*a)) or seen[-1])
    train(tmp_path, epochs=1, scheduler="none", **options)  # onecycle would set its own momentum and rate
    name, key, value = expected
    assert type(seen[0]).__name__ == name and seen[0].param_groups[0][key] == value


def test_cosine_with_warmup_logs_the_rate_each_epoch_used(tmp_path):
    train(tmp_path, epochs=4, batch_size=20, lr=0.01, scheduler="cosine", warmup_epochs=1)  # 10 steps an epoch
    lrs = [r["lr"] for r in epochs_of(tmp_path)]
    warmup = sum(0.01 * (s + 1) / 10 for s in range(10)) / 10
    cosine = [sum(0.01 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 30)) for s in range(e * 10, e * 10 + 10)) / 10
              for e in (1, 2, 3)]
    assert lrs == pytest.approx([warmup, *cosine])


def test_step_schedule_is_the_seeds_steplr(tmp_path):
    train(tmp_path, epochs=3, lr=0.01, scheduler="step", lr_step=1, lr_gamma=0.5)
    assert [r["lr"] for r in epochs_of(tmp_path)] == pytest.approx([0.01, 0.005, 0.0025])


def test_onecycle_rises_then_falls(tmp_path):
    train(tmp_path, epochs=4, lr=0.01, scheduler="onecycle", optimizer="sgd")
    lrs = [r["lr"] for r in epochs_of(tmp_path)]
    assert lrs[0] < lrs[1] and lrs[1] > lrs[3] and max(lrs) <= 0.01


def test_the_library_takes_a_users_optimizer_and_scheduler(tmp_path):
    torch.manual_seed(0)
    model = LeNet5()
    sgd = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.8)
    multicard.train(model, tiny_images(64), None, out=str(tmp_path), epochs=3, batch_size=16, optimizer=sgd,
                    scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.1), **PLAIN)
    assert [r["lr"] for r in epochs_of(tmp_path)] == pytest.approx([0.02, 0.002, 0.0002])
    with pytest.raises(UsageError, match="pass a function optimizer -> scheduler"):
        multicard.train(model, tiny_images(64), None, out=str(tmp_path), scheduler=torch.optim.lr_scheduler.StepLR(
            sgd, 1), **PLAIN)


# -- clipping: one norm over the whole model, whatever the strategy ------------------------------------------------

def clipped_norm(mc: Multicard) -> float:
    torch.manual_seed(0)
    model = LeNet5()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = mc.setup(model, optimizer)
    criterion = mc.setup_criterion(nn.CrossEntropyLoss())
    x, y = next(iter(mc.setup_dataloader(DataLoader(tiny_images(24), 24))))
    mc.backward(criterion(model(x), y) * 50)  # a large gradient, so clipping acts
    norm = mc.clip_gradients(model, optimizer, 1.0).item()
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    return norm, after


def test_clipping_takes_the_same_norm_under_every_strategy():
    single = Multicard(Single(Devices("cpu", (0,)))).launch(clipped_norm)
    for mc in (Multicard("ddp", "cpu:2"), Multicard(CPUDP(Devices("cpu", (0,)))),
               Multicard(CPUBalanced(Devices("cpu", (0,))))):
        norm, after = mc.launch(clipped_norm)
        assert norm == pytest.approx(single[0], rel=1e-5) and after == pytest.approx(1.0, rel=1e-4)
    assert single[0] > 1


def test_the_summary_counts_the_clipped_steps(tmp_path):
    summary, _ = train(tmp_path, epochs=1, batch_size=50, clip_grad_norm=1e-3)
    assert summary["clipped_steps"] == summary["optimizer_steps"] == 4


# -- fp16 --------------------------------------------------------------------------------------------------------

def test_fp16_scales_and_counts_a_skipped_step():
    mc = Multicard(devices="cpu", precision="fp16")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # schedulers still wrap the optimizer's step
    model, optimizer = mc.setup(model, optimizer)
    x = torch.randn(8, 4) * 0.1
    mc.backward(model(x).mean() * float("inf"))  # an overflowing step: skipped, and counted
    before = [p.clone() for p in model.parameters()]
    optimizer.step()
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # torch's own note on a skipped first step
        scheduler.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.zero_grad()
    mc.backward(model(x).mean())
    optimizer.step()
    assert not torch.equal(before[0], model.module.weight) and mc.skipped_steps == 1
    assert model(x).dtype == torch.float32 and mc.scaler.get_scale() < 2.0**16


def test_fp16_training_reports_its_skipped_steps(tmp_path):
    summary, _ = train(tmp_path, epochs=2, batch_size=20, precision="fp16")
    assert summary["skipped_steps"] >= 0 and summary["test_accuracy"] > 0.5
    assert summary["config"]["precision"] == "fp16"


def test_an_unknown_precision_is_refused_not_trained_in_fp32(tmp_path):
    with pytest.raises(UsageError, match="--precision fp8: choose one of fp32, bf16, fp16"):
        multicard.train(LeNet5(), tiny_images(16), None, TrainConfig(precision="fp8"), out=str(tmp_path))


# -- divergence and throughput ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_recipe_flags_on_the_command_line(tmp_path):
    out = run_cli("train", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.5", "--nesterov", "--weight-decay",
                  "1e-4", "--scheduler", "cosine", "--warmup-epochs", "0.5", "--accumulate", "2", "--clip-grad-norm",
                  "5", "--precision", "bf16", "--data", "synthetic", "--synthetic-samples", "256", "--epochs", "2",
                  "--batch-size", "64", "--quiet", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["optimizer_steps"] == 8 and summary["accumulate"] == 2
    assert {k: summary["config"][k] for k in ("optimizer", "momentum", "nesterov", "scheduler", "warmup_epochs",
                                               "clip_grad_norm", "precision")} == {
        "optimizer": "sgd", "momentum": 0.5, "nesterov": True, "scheduler": "cosine", "warmup_epochs": 0.5,
        "clip_grad_norm": 5.0, "precision": "bf16"}
    first, second = epochs_of(tmp_path)
    assert 0 < second["lr"] < first["lr"] < 0.05  # a half-epoch's warm-up, then the cosine down


@pytest.mark.slow  # the library's line: test_train.py; here through a fresh interpreter's CLI
def test_a_loss_that_blows_up_is_one_line_naming_lr(tmp_path):
    out = run_cli("train", "--lr", "100", "--data", "synthetic", "--synthetic-samples", "256", "--epochs", "2",
                  "--quiet", "--out", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "training diverged; try a smaller --lr (this run: 100)" in out.stderr.splitlines()[-1]


def test_throughput_leaves_out_the_first_epoch(tmp_path):
    summary, _ = train(tmp_path, epochs=3)
    rows = epochs_of(tmp_path)[1:]
    assert summary["train_samples_per_s"] == pytest.approx(sum(r["samples_per_s"] * r["seconds"] for r in rows)
                                                           / sum(r["seconds"] for r in rows))
    assert summary["throughput_epochs"] == "all but the first"
    assert summary["first_epoch_samples_per_s"] == epochs_of(tmp_path)[0]["samples_per_s"]


# -- SyncBatchNorm and the parity check that can fail -------------------------------------------------------------

def sum_not_average(state, bucket):
    """A planted bug: the gradients summed over the processes, where DDP averages them."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


class SummingDDP(DDP):
    def wrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = super().wrap_model(model)
        wrapped.register_comm_hook(None, sum_not_average)
        return wrapped


CHECK = dict(data="synthetic", synthetic_samples=256, batch_size=32)


def test_the_check_fails_on_a_summed_gradient_and_names_it():
    (result,) = check(TrainConfig(**CHECK), steps=4, strategies=[SummingDDP(Devices("cpu", (0, 1)), Job())])
    assert not result.ok and result.grad_ratio == pytest.approx(2, rel=1e-3)
    assert result.weight_bound == result.tolerance  # LeNet-5 does not amplify rounding: no allowance
    assert result.grad_bound == result.tolerance
    assert any("gradients differ from the first step" in line and "summed over the 2 processes" in line
               for line in result.lines())


@pytest.mark.slow
def test_batchnorm_passes_the_check_with_sync_bn_and_fails_without():
    config = TrainConfig(model="resnet8", devices="cpu:2", **{**CHECK, "batch_size": 16})  # 3x32x32: its own data
    (without,) = check(config, steps=3)
    assert not without.ok and any("--sync-bn" in line for line in without.lines())
    (synced,) = check(replace(config, sync_bn=True, accumulate=2, clip_grad_norm=0.5), steps=3)  # with the knobs
    assert synced.ok, synced.lines()


@pytest.mark.slow
def test_resnet8_with_sync_bn_passes_the_check_and_a_summed_gradient_still_fails():
    """`multicard check --model resnet8 --data synthetic --steps 3 --sync-bn`: a 1e-7 nudge of its weights moves
    its first-step gradients by ~1e-4 (BatchNorm on random labels), so a correct run's gradients, 1.25e-4 apart,
    failed an absolute 1e-4; they are held to 10x the nudge's effect now, as the weights are. A sum instead of
    an average still fails: it moves the gradients by their own size (~0.1), far past that."""
    devices = Devices("cpu", (0, 1))
    right, summed = check(TrainConfig(model="resnet8", data="synthetic", sync_bn=True), steps=3,
                          strategies=[DDP(devices, Job()), SummingDDP(devices, Job())])
    # with the plain loader's data order (issue 22) this batch moves the gradients by 5e-8 only, so the bound is
    # the tolerance itself here; the raised bound's line shows wherever the nudge moves them further
    assert right.ok and right.grad_bound >= right.tolerance, right.lines()
    assert right.grad_bound == right.tolerance or any("may differ by up to" in line for line in right.lines())
    assert not summed.ok and summed.grad_diff > summed.grad_bound and summed.grad_ratio == pytest.approx(2, rel=1e-2)


@pytest.mark.parametrize("tolerance", [float("nan"), -1.0, float("inf")])
def test_the_check_refuses_a_tolerance_that_is_no_bound(tolerance):
    with pytest.raises(UsageError, match="--tolerance"):
        check(TrainConfig(**CHECK), steps=1, tolerance=tolerance)


# -- the auto recipe (docs/recipes.md) ------------------------------------------------------------------------------

@pytest.mark.parametrize("given, processes, batch, lr", [
    (dict(), 1, 256, None),
    (dict(), 3, 255, None),  # 256 rounded down to 3 processes
    (dict(accumulate=2), 3, 252, None),  # ... and to 2 micro-batches of each
    (dict(batch_size=64), 1, 64, None),  # a given batch stays; the rate follows it by sqrt(64 / 256)
    (dict(batch_size=64, lr=0.01), 2, 64, 0.01),  # a given rate stays
    (dict(optimizer="sgd"), 1, 256, None),
])
def test_the_auto_recipe_settles_batch_and_rate_for_the_job(given, processes, batch, lr):
    from multicard.trainer.config import BATCH, LR
    config = TrainConfig(**given).settled(processes)
    expected = lr if lr is not None and "lr" in given else LR[config.optimizer] * math.sqrt(batch / BATCH)
    assert config.batch_size == batch and config.lr == pytest.approx(expected)
    assert TrainConfig(**given).batch_size == given.get("batch_size")  # settling makes a new config


@pytest.mark.slow
def test_the_auto_batch_splits_where_a_fixed_one_would_not(tmp_path):
    summary, _ = train(tmp_path, epochs=1, strategy="ddp", devices="cpu:3")
    assert summary["global_batch_size"] == 255 and summary["per_process_batch_size"] == 85
    assert summary["config"]["lr"] == pytest.approx(multicard.trainer.config.LR["adam"] * math.sqrt(255 / 256))


def test_auto_and_numbers_on_the_command_line():
    from multicard.cli import config_from, parser
    args = parser().parse_args(["train", "--batch-size", "auto", "--lr", "0.01"])
    assert config_from(args).batch_size is None and config_from(args).lr == 0.01
    assert "(default: auto)" in parser()._subparsers._group_actions[0].choices["train"].format_help()


@pytest.mark.slow
def test_the_check_takes_its_own_batch_where_the_run_has_auto():
    (result,) = check(TrainConfig(devices="cpu:2", data="synthetic", synthetic_samples=128), steps=2)  # 2 x 64
    assert result.ok and result.steps == 2
