"""The set-up model at the seams (issue 40.6 and 40.7): parameters that change what they train (a bias frozen
mid-run, one unfrozen, a layer the forward never uses, a sparse buffer) take one process's steps on N or say one
line; and a set-up Sequential, ModuleList or ModuleDict indexes, counts and iterates as the user's. On 1 and 2
gloo processes, 3 in the slow suite (one job a world size), against the one-process loop computed here."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import multicard
from multicard.errors import UsageError
from multicard.yourloop.multicard import Multicard

X = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))  # a global batch: each rank takes its rows


class Net(nn.Module):
    """Two layers, a third the forward uses only when `spare` is on, and a sparse buffer when `sparse`."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(4, 2)
        if sparse:
            self.register_buffer("mix", (torch.eye(4) * 0.5).to_sparse())
        self.use_spare = False

    def forward(self, x):
        if hasattr(self, "mix"):
            x = torch.sparse.mm(self.mix, x.t()).t()
        out = self.head(torch.tanh(self.body(x)))
        return out + self.spare(x) if self.use_spare else out


def train(mc: Multicard, case: str) -> dict[str, torch.Tensor]:
    """Six steps of `case`; the weights it ends with."""
    torch.manual_seed(0)
    model = Net(sparse=case == "sparse")
    if case != "unused":
        model.use_spare = True
    model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(6):
        if case == "freeze" and step == 3:  # a bias frozen at "epoch 3"
            model.head.bias.requires_grad_(False)
        if case == "unfreeze":
            model.body.weight.requires_grad_(step >= 2)
        optimizer.zero_grad()
        mc.backward(model(mc.local(X)).pow(2).mean())
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items() if v.layout == torch.strided}


CASES = ["freeze", "unfreeze", "sparse"]


def trainable_job(mc: Multicard) -> dict:
    found = {case: train(Multicard("ddp", "cpu"), case) for case in CASES}
    found["unused, found"] = train(Multicard("ddp", "cpu", find_unused_parameters=True), "unused")
    try:
        train(Multicard("ddp", "cpu"), "unused")
        found["unused"] = "not caught"
    except UsageError as e:
        found["unused"] = str(e)
    return mc.gather(found)


def both_job(mc: Multicard) -> list:
    return [*zip(trainable_job(mc), container_job(mc), strict=True)]


@functools.cache
def launched(world: int) -> list:
    """Each rank's (trainable_job's, container_job's) of one job of `world` processes (one job for both tests)."""
    return multicard.launch(both_job, devices=f"cpu:{world}")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_what_trains_may_change_and_n_processes_take_one_process_steps(world):
    one = {case: train(Multicard("single", "cpu"), case) for case in CASES}
    one["unused, found"] = train(Multicard("single", "cpu"), "unused")
    for found, _ in launched(world):
        for case in [*CASES, "unused, found"]:
            for key, value in one[case].items():
                torch.testing.assert_close(found[case][key], value, rtol=1e-5, atol=1e-6, msg=f"{case} {key}")
        assert found["unused"].startswith(
            "parameters spare.weight, spare.bias got no gradient in the last backward (a layer the forward did not "
            "use, or an output the loss left out), and ddp waits for every trainable parameter's: pass "
            "Multicard(find_unused_parameters=True)"), found["unused"]
    assert not torch.equal(one["freeze"]["head.bias"], one["unused, found"]["head.bias"])  # the freeze did act


def container_job(mc: Multicard) -> dict:
    torch.manual_seed(0)
    seq = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    user = seq.module
    found = {"index": seq[0] is user[0] and seq[-1] is user[2], "slice": type(seq[0:2]).__name__,
             "len": len(seq), "iter": [type(m).__name__ for m in seq], "in": user[1] in seq and nn.Tanh() not in seq,
             "bool": bool(seq), "forward": tuple(seq(mc.local(X)).shape)}
    parts = mc.setup(nn.ModuleDict({"enc": nn.Linear(4, 4), "dec": nn.Linear(4, 2)}))
    found["dict"] = (list(parts), "enc" in parts, parts["dec"] is parts.module["dec"], len(parts))
    layers = mc.setup(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    found["list"] = (len(layers), layers[1] is layers.module[1], len(list(iter(layers))))
    layers[0] = nn.ReLU()  # no parameters: set on the user's list, on any number of processes
    try:
        layers[1] = nn.Linear(4, 4)
        found["set"] = "set"
    except UsageError as e:
        found["set"] = str(e)
    plain = mc.setup(nn.Linear(4, 2))
    found["plain"] = (bool(plain), hasattr(type(plain), "__len__"))
    return mc.gather(found)


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_set_up_container_reads_as_yours(world):
    if world == 1:
        with Multicard("single", "cpu") as mc:
            ranks = container_job(mc)
    else:
        ranks = [found for _, found in launched(world)]
    for found in ranks:
        assert found["index"] and found["slice"] == "Sequential" and found["len"] == 3 and found["in"]
        assert found["iter"] == ["Linear", "Tanh", "Linear"] and found["bool"]
        assert found["forward"] == (len(range(0, 12, world)), 2)
        assert found["dict"] == (["enc", "dec"], True, True, 2) and found["list"] == (3, True, 3)
        assert found["plain"] == (True, False)  # a model that is no container stays one
        if world == 1:
            assert found["set"] == "set"
        else:
            assert found["set"] == ("model[1] = Linear(...) after setup: its parameters would not be in the gradient "
                                    "reduction between processes; add it to the model before mc.setup")
