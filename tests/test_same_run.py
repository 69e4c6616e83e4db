"""A run is a function of (seed, data, config) alone: the default recipe (Adam, one-cycle, augmentation on) ends
with the same weights however the run is cut — 1, 2 or 3 processes, 1 or 4 micro-batches a step, killed and
resumed on another number of processes — within the float rounding of the gradient reduction's order.

Each comparison would fail with augmentation drawn from each process's own random stream (the weights then
differ by ~1e-2 here: other rotations, scalings and shifts), since which process, micro-batch or resumed
attempt serves a sample then decides its transform."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

import multicard
from conftest import assert_same, cuda, sharded, tiny_images
from multicard.data.images import ImageData
from multicard.jobs.failures import RankFailed
from multicard.models import LeNet5
from test_resume import DiesOnce

# 96 samples, a global batch of 24 (splits over 1, 2 and 3 processes and into 4 micro-batches): 4 steps an epoch
RECIPE = dict(quiet=True, batch_size=24, epochs=2)
# measured (2026-11-23, 2-core AMD EPYC, torch 2.13.0+cpu): the runs below end 7.6e-7 (2 processes; killed and
# resumed on 3), 1.0e-6 (4 micro-batches) and 1.5e-6 (3 processes) from the one-process run: ddp and accumulation
# sum the gradients in another order than one backward does. With per-process augmentation: 1.4e-2 (each of them).
ROUNDING = 1e-5


def augmented(n: int, seed: int) -> ImageData:
    images = tiny_images(n, seed)
    return ImageData(*images.tensors, images.mean, images.std, augment=True)


def run(out: Path, build: Callable[[], torch.nn.Module] = LeNet5, **overrides) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the same initial weights in every run
    multicard.train(build(), augmented(96, 0), augmented(30, 1), out=str(out), **{**RECIPE, **overrides})
    return torch.load(out / "model.pt", weights_only=True)


def apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The run on one process, in whole batches."""
    return run(tmp_path_factory.mktemp("one"), strategy="single", devices="cpu")


def test_augmentation_is_keyed_by_seed_epoch_and_sample():
    data = augmented(8, 0)
    data.set_epoch(3, seed=5)
    whole = data[torch.arange(8)][0]
    assert torch.equal(data[[6, 2]][0], whole[[6, 2]])  # the batch it comes in does not matter
    assert torch.allclose(data[6][0], whole[6], atol=1e-6)  # nor being fetched alone
    data.set_epoch(4)
    assert not torch.allclose(data[[6]][0], whole[[6]], atol=1e-3)  # another epoch, another transform
    data.set_epoch(3, seed=6)
    assert not torch.allclose(data[[6]][0], whole[[6]], atol=1e-3)  # another seed too


@cuda
def test_on_a_card_the_draws_are_made_there_without_a_host_sync():
    data = augmented(8, 0)
    data.set_epoch(2, seed=1)
    on_card = data.to(torch.device("cuda"))  # a copy on the card follows the original's key
    index = torch.tensor([5, 1, 6], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        images, _ = on_card[index]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same(images, data[[5, 1, 6]][0], atol=1e-5, rtol=1e-5)


def test_loader_workers_draw_the_epoch_set_before_the_pass():
    data = augmented(12, 0)
    passes = {}
    for workers in (0, 2):  # workers take a copy of the dataset at each pass: with the key set just before it
        loader = sharded(data, 4, workers=workers)
        for epoch in (0, 1):
            data.set_epoch(epoch, seed=0)
            loader.set_epoch(0)  # the same order both times: only the augmentation's epoch moves
            passes[workers, epoch] = torch.cat([x for x, _ in loader])
    assert torch.equal(passes[0, 0], passes[2, 0]) and torch.equal(passes[0, 1], passes[2, 1])
    assert not torch.allclose(passes[0, 0], passes[0, 1], atol=1e-3)


def test_micro_batches_do_not_change_the_weights(one, tmp_path):
    assert apart(one, run(tmp_path, strategy="single", devices="cpu", accumulate=4)) <= ROUNDING


@pytest.mark.parametrize("processes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_number_of_processes_does_not_change_the_weights(one, tmp_path, processes):
    assert apart(one, run(tmp_path, strategy="ddp", devices=f"cpu:{processes}")) <= ROUNDING


@pytest.mark.slow
def test_a_run_killed_on_two_processes_and_resumed_on_three_ends_the_same(one, tmp_path):
    out, marker = tmp_path / "run", str(tmp_path / "killed")
    with pytest.raises(RankFailed):
        run(out, partial(DiesOnce, marker, at=6), strategy="ddp", devices="cpu:2", save_every_steps=1)
    assert os.path.exists(marker)
    resumed = run(out, partial(DiesOnce, marker, at=6), strategy="ddp", devices="cpu:3", resume="auto")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["resumed_from"].endswith("step-00000005/state.pt")
    assert apart(one, resumed) <= ROUNDING
