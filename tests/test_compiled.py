"""A model compiled before mc.setup (nanoGPT's order: model = torch.compile(model); model = mc.setup(model)) or
after it (the trainer's --compile) keeps your own keys (issue 51.4): the set-up model's state_dict(), mc.state_dict,
mc.save and the trainer's files hold no `_orig_mod.`, and load_state_dict takes your keys (or torch.compile's). In
this process under single; under ddp and fsdp over 2 gloo processes in the slow suite. Kept tiny: compiling takes
seconds on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multicard
from conftest import tiny_images
from multicard.yourloop.multicard import Multicard


def compiled_job(mc: Multicard, tmp: str) -> dict:
    """Each order of compiling and setting up: a step, then what every way of reading the weights gives."""
    found = {}
    for order in ("before", "after"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        keys = list(net.state_dict())
        model = mc.setup(torch.compile(net) if order == "before" else net)
        forward = torch.compile(model) if order == "after" else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mc.backward(forward(mc.local(torch.ones(4, 4))).pow(2).mean())
        optimizer.step()
        whole = mc.state_dict(model)  # fsdp: gathered onto rank 0
        path = f"{tmp}/{order}.pt"
        mc.save(path, {"model": forward, "optimizer": optimizer})
        saved = torch.load(path, weights_only=True)["model"] if not mc.sharded and mc.is_main else None
        mc.barrier()  # (the other ranks go on once rank 0 has their part, before it has written the file)
        mc.load(path, {"model": model, "optimizer": optimizer})  # fsdp: from the shards
        seen = {"state_dict": list(model.state_dict()) == keys, "whole": not mc.is_main or list(whole) == keys,
                "saved": saved is None or list(saved) == keys, "index": model[0] is net[0] and len(model) == 3}
        if not mc.sharded:  # (fsdp's parameters are shards: a whole state_dict goes in through mc.load)
            model.load_state_dict(whole)
            model.load_state_dict({f"_orig_mod.{k}": v for k, v in whole.items()})  # as torch.compile names them
            forward.load_state_dict(forward.state_dict())  # torch.compile(model) after setup: its own keys back
            seen["loaded"] = all(torch.equal(v, whole[k]) for k, v in net.state_dict().items())
            plain = f"{tmp}/{order}.plain.pt"
            mc.save(plain, model.state_dict())  # what a script saves for inference
            seen["plain"] = not mc.is_main or list(torch.load(plain, weights_only=True)) == keys
        found[order] = seen
    return mc.gather(found)


def test_compiled_before_or_after_setup_your_keys_throughout(tmp_path):
    with Multicard("single", "cpu") as mc:
        (found,) = compiled_job(mc, str(tmp_path))
    for order, seen in found.items():
        assert all(seen.values()), (order, seen)
    assert set(found["before"]) == {"state_dict", "whole", "saved", "index", "loaded", "plain"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_on_two_processes_your_keys_throughout(tmp_path, strategy):
    for found in multicard.launch(compiled_job, str(tmp_path), strategy=strategy, devices="cpu:2"):
        for order, seen in found.items():
            assert all(seen.values()), (strategy, order, seen)


@pytest.mark.slow
def test_the_trainers_files_of_a_compiled_model_hold_your_keys_and_resume(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    keys = list(net.state_dict())
    recipe = dict(strategy="single", devices="cpu", batch_size=16, scheduler="none", quiet=True, out=str(tmp_path),
                  save_every=1)
    multicard.train(torch.compile(net), tiny_images(32, 0), None, epochs=1, **recipe)
    assert list(torch.load(tmp_path / "model.pt", weights_only=True)) == keys
    (state,) = tmp_path.glob("checkpoints/step-*/state.pt")
    assert list(torch.load(state, weights_only=True)["model"]) == keys
    summary = multicard.train(torch.compile(net), tiny_images(32, 0), None, epochs=2, resume=str(state), **recipe)
    assert summary["epochs"] == 2 and summary["model"] == "Sequential"
