"""fsdp on the CPU: FSDP2 with gloo and an explicit CPU device mesh, the same fully_shard code NCCL runs on cards; its
checkpoints read into another model or under fsdp from another strategy in one line, and its saves keeping what the user
had beside them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import multicard
from conftest import cuda, rehearsal, tiny_images
from multicard import safefs
from multicard.errors import UsageError
from multicard.models import LeNet5, WideMLP
from multicard.strategies.fsdp import units
from multicard.tools.parity import check
from multicard.trainer.config import TrainConfig

# 96 samples: 4 steps per epoch
PLAIN = dict(quiet=True, augment=False, lr=3e-3, scheduler="step", batch_size=24, epochs=2)


def fsdp_run(out, devices: str, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(96), tiny_images(50, 1), out=str(out), strategy="fsdp",
                           devices=devices, **{**PLAIN, **overrides})


def accuracy_alone(path) -> float:
    """model.pt into a fresh, plain model (weights_only), evaluated on the whole test set in this process."""
    model = LeNet5()
    model.load_state_dict(torch.load(path, weights_only=True))
    x, y = tiny_images(50, 1)[list(range(50))]
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).double().mean().item()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    return fsdp_run(out, "cpu:2", save_every_steps=3, keep_checkpoints=0), out


def test_fsdp_trains_and_writes_a_whole_plain_model(two):
    summary, out = two
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["model"] == "LeNet5"
    assert summary["test_samples"] == 50
    assert summary["test_accuracy"] == pytest.approx(accuracy_alone(out / "model.pt"), abs=1e-9)
    assert summary["test_accuracy"] > 0.5


def test_each_process_holds_about_half(two):
    summary, _ = two
    whole = sum(p.numel() * 4 for p in LeNet5().parameters()) / 2**20
    for held in summary["shard_mb"]:
        assert held["params"] == pytest.approx(whole / 2, rel=0.05)
        assert held["grads"] == pytest.approx(held["params"], rel=0.05)
        assert held["optimizer"] == pytest.approx(2 * held["params"], rel=0.05)  # Adam: two moments


@pytest.mark.slow
def test_checkpoints_hold_shards_and_resume_on_three_processes(two, tmp_path):
    """torch.distributed.checkpoint reshards 2 -> 3; the data order goes on; evaluation on 3 stays exact."""
    summary, out = two
    step = out / "checkpoints" / "step-00000003"
    assert list(step.glob("state.shards-*/.metadata")) and sorted(p.name for p in step.glob("*.pt")) == ["state.pt"]
    assert list(torch.load(step / "state.pt", weights_only=True)["multicard"]["ranks"]) == [1]  # rank 1's streams
    resumed = fsdp_run(tmp_path, "cpu:3", resume=str(step), batch_size=24)
    assert resumed["world_size"] == 3 and resumed["test_samples"] == 50
    a, b = torch.load(out / "model.pt", weights_only=True), torch.load(tmp_path / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert resumed["test_accuracy"] == pytest.approx(accuracy_alone(tmp_path / "model.pt"), abs=1e-9)


def test_a_sharded_checkpoint_under_another_strategy_is_one_line(two):
    _, out = two
    mc = multicard.Multicard("single", "cpu")
    with pytest.raises(UsageError, match="written under fsdp"):
        mc.load(out / "checkpoints" / "step-00000003" / "state.pt", {"model": mc.setup(LeNet5())})


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


def fsdp_saves_job(mc, folder: str) -> dict:
    folder = Path(folder)
    torch.manual_seed(0)  # the same weights in every process: fsdp copies none (the replica check compares them)
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    for _ in range(2):
        mc.save(folder / "ckpt.pt", {"model": model})
    named = torch.load(folder / "ckpt.pt", weights_only=True)["multicard"]["shards"]["folder"]
    mc.barrier()
    if mc.rank == 0:  # a .metadata far beyond what this model's index takes (a pickle ignores the tail)
        with open(folder / named / ".metadata", "r+b") as f:
            f.truncate(64 << 20)
    mc.barrier()
    try:
        mc.load(folder / "ckpt.pt", {"model": model})
        refused = ""
    except UsageError as e:
        refused = str(e)
    return {"named": named, "refused": refused}


@pytest.mark.slow
def test_fsdp_saves_keep_what_the_user_had_beside_the_checkpoint(tmp_path):
    (tmp_path / "ckpt.shards-mybackup").mkdir()
    (tmp_path / "ckpt.shards-mybackup" / "notes.txt").write_text("precious")
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, tmp_path / "ckpt.shards-1")  # planted where the first save's folder would go
    (tmp_path / "ckpt.shards-9").mkdir()
    (tmp_path / "ckpt.shards-9" / "mine.txt").write_text("mine")  # a save's name, but not what DCP writes
    found = multicard.launch(fsdp_saves_job, str(tmp_path), strategy="fsdp", devices="cpu:2")
    assert (tmp_path / "ckpt.shards-mybackup" / "notes.txt").read_text() == "precious"
    assert (tmp_path / "ckpt.shards-9" / "mine.txt").read_text() == "mine"
    assert list(victim.iterdir()) == [] and os.readlink(tmp_path / "ckpt.shards-1") == str(victim)
    assert found["named"] == "ckpt.shards-3"  # shards-1 taken by the link; shards-2, the first save's, dropped
    assert safefs.kind(tmp_path / "ckpt.shards-2") is None
    assert found["refused"].startswith(f"shards folder {tmp_path / 'ckpt.shards-3'}: .metadata: is 67108864 bytes, "
                                       f"more than the ")


@pytest.mark.slow
def test_parity_with_clipping_and_accumulation():
    """First-step gradients (after clipping to the global norm) and final weights as on one process."""
    config = TrainConfig(devices="cpu:2", strategy="fsdp", augment=False, batch_size=16, accumulate=2,
                         clip_grad_norm=0.05, data="synthetic", synthetic_samples=160)
    (result,) = check(config, steps=5)
    assert result.strategy == "fsdp" and result.ok, result.lines()
    assert result.grad_diff < 1e-6


@pytest.mark.slow
def test_parity_on_three_processes():
    config = TrainConfig(devices="cpu:3", strategy="fsdp", augment=False, batch_size=48, data="synthetic",
                         synthetic_samples=480)
    (result,) = check(config, steps=10)
    assert result.processes == 3 and result.ok, result.lines()


@rehearsal
def test_fsdp_on_two_processes_of_a_card_steps_as_one_process():
    """fsdp's reduce-scatter and all-gather on card tensors: over NCCL on 2 cards, over gloo where 2 processes share
    one (gloo's reduce-scatter is an all-reduce, each process keeping its part: the sum must still be averaged)."""
    devices = "0,1" if torch.cuda.device_count() > 1 else "0,0"
    config = TrainConfig(devices=devices, strategy="fsdp", augment=False, batch_size=16, data="synthetic",
                         synthetic_samples=160)
    (result,) = check(config, steps=5)
    assert result.strategy == "fsdp" and result.processes == 2 and result.ok, result.lines()


class SmallWideMLP(WideMLP):
    """wide-mlp sized for 2 CPU cores (width 256, 2 blocks: 0.33M parameters)."""

    def __init__(self):
        super().__init__(width=256, depth=2)


class OtherDataOnRank1(SmallWideMLP):
    """A planted fault: rank 1 trains on other data (its images mirrored)."""

    def forward(self, x):
        return super().forward(x.flip(-1) if os.environ.get("RANK") == "1" else x)


@pytest.mark.parametrize("model, passes", [(SmallWideMLP, True), pytest.param(OtherDataOnRank1, False,
                                                                             marks=pytest.mark.slow)],
                         ids=["correct", "rank-1-on-other-data"])
def test_the_check_passes_wide_mlp_under_fsdp_and_fails_a_rank_on_other_data(monkeypatch, model, passes):
    monkeypatch.setitem(multicard.MODELS, "small-wide-mlp", model)
    config = TrainConfig(model="small-wide-mlp", devices="cpu:2", strategy="fsdp", data="synthetic", batch_size=16)
    (result,) = check(config, steps=3)
    assert result.ok == passes, result.lines()
    if not passes:  # the other data moves the first gradients far past what rounding could (0.17 against 1e-4)
        assert result.grad_diff > 100 * result.grad_bound


def test_the_default_rule_shards_repeated_blocks_innermost_first():
    model = WideMLP(width=16, depth=3)
    assert units(model) == list(model.blocks)
    lenet = LeNet5()
    convs = [m for m in lenet.features if isinstance(m, nn.Conv2d)]
    linears = [m for m in lenet.classifier if isinstance(m, nn.Linear)]
    assert set(units(lenet)) == set(convs + linears)
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2),
                                                                                         nn.Linear(2, 2)))
    assert units(nested) == list(nested)  # the outer repeated blocks; what is inside them stays inside


def test_blocks_by_name_and_a_name_not_found():
    model = WideMLP(width=16, depth=2)
    assert units(model, "Block,LayerNorm")[:2] == [model.blocks[0].norm, model.blocks[1].norm]  # inner first
    with pytest.raises(UsageError, match=r"--fsdp-blocks Nope: no module of that class in WideMLP \(its classes"):
        units(model, "Nope")


def test_what_fsdp_refuses():
    with pytest.raises(UsageError, match="fsdp takes precision bf16"):
        multicard.Multicard("fsdp", "cpu", "fp16")
    with multicard.Multicard("fsdp", "cpu") as mc:
        model = LeNet5()
        with pytest.raises(UsageError, match="build the optimizer after model = mc.setup"):
            mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_one_process_fsdp_bf16_trains(tmp_path):
    summary = fsdp_run(tmp_path, "cpu", precision="bf16", epochs=1)
    assert summary["world_size"] == 1 and summary["config"]["precision"] == "bf16"
    assert json.loads((tmp_path / "summary.json").read_text())["test_samples"] == 50


@cuda
def test_fsdp_on_a_card_in_bf16(tmp_path):
    summary = fsdp_run(tmp_path, "cuda:0", precision="bf16", epochs=1)
    assert summary["strategy"] == "fsdp" and summary["devices"][0].startswith("cuda:0")
    assert summary["test_accuracy"] == pytest.approx(accuracy_alone(tmp_path / "model.pt"), abs=0.05)
