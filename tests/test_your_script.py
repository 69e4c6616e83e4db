"""A user's own script under multicard, where a strategy could silently diverge from it (issue 22, points 3-6, 8):
attributes and methods of the set-up model, no_backward_sync and nanoGPT's require_backward_grad_sync, nested
collectives, broadcast, rank 0 first, split, outputs gathered in dataset order, a second Multicard, save's arguments,
structures that differ between ranks. ddp over 2 and 3 gloo processes; the rest in this process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import multicard
from conftest import HUNG_S, ROOT
from multicard.errors import UsageError
from multicard.yourloop.collectives import bounds
from multicard.yourloop.multicard import Multicard


class Coder(nn.Module):
    """A model with what real scripts add: a method running its layers outside forward (encode), one that calls
    forward itself (generate), a property with a setter, a helper that runs no layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec = nn.Linear(4, 8), nn.Linear(8, 1)
        self._temperature = 1.0

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))

    def encode(self, x):
        return self.dec(torch.relu(self.enc(x)))

    def generate(self, x):
        return self(x) * self._temperature

    @property
    def temperature(self):
        return self._temperature

    @temperature.setter
    def temperature(self, value):
        self._temperature = float(value)

    def size(self):
        return sum(p.numel() for p in self.parameters())


def error(fn) -> str | None:
    try:
        fn()
    except UsageError as e:
        return str(e)
    return None


def script_job(mc: Multicard, folder: str) -> list[dict]:
    """Every point on every rank; the results of all ranks, gathered."""
    out: dict = {}
    model = mc.setup(Coder())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reductions = []  # one entry per bucket all-reduced (the model is one bucket)
    model.forward_module.register_comm_hook(None, lambda state, bucket: reductions.append(1) or
                                            allreduce_hook(state, bucket))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(mc.rank))  # different data on every rank

    # 3a, 3b: the set-up model only; attributes reach the model that runs forward
    out["no_sync_module"] = error(lambda: mc.no_backward_sync(model.module).__enter__())
    model.x, model.temperature = 1, 2
    out["attrs"] = (model.module.x, model.module._temperature, "x" in vars(model), model.size())
    out["new_layer"] = error(lambda: setattr(model, "head", nn.Linear(1, 1)))

    # 3c: a method running layers outside forward is an error until marked; then it is reduced
    out["encode"] = error(lambda: model.encode(x).sum().backward())
    with torch.no_grad():
        model.encode(x)  # nothing to reduce: allowed
    mc.mark_forward(model, "encode", "generate")
    for method in (model.encode, model.generate, model.encode):
        optimizer.zero_grad()
        method(x).pow(2).mean().backward()
        optimizer.step()
    out["weights"] = {k: v.clone() for k, v in model.state_dict().items()}

    # 6: nanoGPT's switch, 2 steps of 4 micro-steps
    before = len(reductions)
    for _ in range(2):
        for micro in range(4):
            model.require_backward_grad_sync = micro == 3
            model(x).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    out["nanogpt_reductions"] = len(reductions) - before

    # 8: backward-only inside no_backward_sync is still reduced under ddp, and said once; forward inside is not
    said, before = io.StringIO(), len(reductions)
    with contextlib.redirect_stderr(said):
        for _ in range(2):
            loss = model(x).mean()
            with mc.no_backward_sync(model):
                loss.backward()
    out["backward_only"] = (len(reductions) - before, said.getvalue())
    before = len(reductions)
    with mc.no_backward_sync(model):
        model(x).mean().backward()
    out["forward_inside"] = len(reductions) - before
    with model.no_sync():  # a DDP script's own accumulation
        model(x).mean().backward()
    out["ddp_no_sync"] = (len(reductions) - before, model.forward_module.require_backward_grad_sync)
    out["save_module"] = error(lambda: mc.save(f"{folder}/m.pt", model))

    # 4: collectives
    t = torch.full((2,), float(mc.rank + 1))
    out["nested"] = mc.all_reduce({"a": t, "b": [t, 2], "c": (3.0,)})
    out["nested_mean"] = mc.all_reduce([t, mc.rank], "mean")
    out["shape"] = error(lambda: mc.all_reduce({"w": torch.zeros((2, 3) if mc.rank == 0 else (3, 2))}))
    out["gather"] = mc.gather({"t": t, "n": [mc.rank]})
    out["broadcast"] = mc.broadcast({"rank": mc.rank, "t": torch.tensor([mc.rank])}, src=1)
    out["broadcast_tensor"] = mc.broadcast(torch.full((3,), float(mc.rank)), src=mc.world_size - 1)
    cache = Path(folder) / "cache"
    with mc.rank_zero_first():
        out["found_cache"] = cache.exists()
        if mc.rank == 0:
            time.sleep(0.2)  # a slow download: the others must still find it done
            cache.write_text("built")
    out["split"] = mc.split(list(range(10)))
    data = TensorDataset(torch.arange(11.0))
    loader = mc.setup_dataloader(DataLoader(data, batch_size=6), train=False)
    out["ordered"] = mc.gather_in_order(torch.cat([b * 10 for (b,) in loader]), total=len(data))
    padded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, mc.world_size, mc.rank, shuffle=False))
    outputs = [{"v": v} for (b,) in padded for v in b.tolist()]
    out["ordered_padded"] = [o["v"] for o in mc.gather_in_order(outputs, total=len(data))]

    # 5: a second Multicard in this process shares the job; closing it leaves the first one working
    second = Multicard("ddp", f"cpu:{mc.world_size}")
    out["second"] = second.all_reduce(1).item()
    second.close()
    out["after_second"] = mc.all_reduce(1).item()
    return mc.gather(out)


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp(f"script{request.param}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTICARD_CHECK_SHAPES", "1")  # the debugging switch, for the shape mismatch below
        return multicard.launch(script_job, str(folder), strategy="ddp", devices=f"cpu:{request.param}")


def test_no_backward_sync_takes_only_the_set_up_model(ranks):
    assert all("no_backward_sync(model) takes the model mc.setup returned" in r["no_sync_module"] for r in ranks)


def test_attributes_reach_the_model_and_new_layers_are_refused(ranks):
    for r in ranks:
        assert r["attrs"] == (1, 2.0, False, 8 * 4 + 8 + 8 + 1)
        assert "model.head = Linear(...) after setup" in r["new_layer"]


def test_a_method_outside_forward_is_refused_until_marked_then_reduced(ranks):
    assert all("model.encode() runs the model's layers outside its forward" in r["encode"] and
               "mc.mark_forward(model, 'encode')" in r["encode"] for r in ranks)
    first = ranks[0]["weights"]
    assert not torch.equal(first["enc.weight"], Coder().enc.weight)
    for r in ranks[1:]:
        for key, value in first.items():
            assert torch.equal(r["weights"][key], value), key


def test_nanogpts_switch_reduces_once_per_step(ranks):
    assert [r["nanogpt_reductions"] for r in ranks] == [2] * len(ranks)  # 2 steps x 4 micro-steps: not 8


def test_backward_only_inside_no_backward_sync_is_reduced_and_said_once_and_model_no_sync_works(ranks):
    assert ranks[0]["backward_only"][0] == 2
    assert ranks[0]["backward_only"][1].count("reduced the gradients anyway") == 1
    assert all(r["backward_only"][1] == "" for r in ranks[1:])  # rank 0 says it
    assert all(r["forward_inside"] == 0 and r["ddp_no_sync"] == (0, True) for r in ranks)


def test_save_of_a_module_is_one_line_on_every_rank(ranks):
    assert all("state is a Prepared, not a dict" in r["save_module"] for r in ranks)


def test_nested_collectives(ranks):
    n = len(ranks)
    total = n * (n + 1) / 2
    for r in ranks:
        assert torch.equal(r["nested"]["a"], torch.full((2,), total))
        assert torch.equal(r["nested"]["b"][0], torch.full((2,), total)) and r["nested"]["b"][1].item() == 2 * n
        assert isinstance(r["nested"]["c"], tuple) and r["nested"]["c"][0].item() == 3.0 * n
        assert r["nested_mean"][0].tolist() == [total / n] * 2 and r["nested_mean"][1].item() == (n - 1) / 2
        assert [g["n"] for g in r["gather"]] == [[i] for i in range(n)]


def test_all_reduce_names_a_shape_mismatch(ranks):
    assert all("value['w'] is (" in r["shape"] and "every process must pass the same" in r["shape"] for r in ranks)


def test_broadcast_rank_zero_first_and_split(ranks):
    n = len(ranks)
    for rank, r in enumerate(ranks):
        assert r["broadcast"]["rank"] == 1 and r["broadcast"]["t"].tolist() == [1]
        assert r["broadcast_tensor"].tolist() == [float(n - 1)] * 3
        assert r["found_cache"] == (rank != 0)
    assert [x for r in ranks for x in r["split"]] == list(range(10))
    assert [len(r["split"]) for r in ranks] == {2: [5, 5], 3: [4, 3, 3]}[n]


def test_evaluation_outputs_come_back_in_dataset_order(ranks):
    for r in ranks:
        assert r["ordered"].tolist() == [10.0 * i for i in range(11)]
        assert r["ordered_padded"] == [float(i) for i in range(11)]  # the sampler's repeats dropped


def test_a_second_multicard_shares_the_job(ranks):
    n = len(ranks)
    assert all(r["second"] == n and r["after_second"] == n for r in ranks)


# -- in this process ---------------------------------------------------------------------------------------------
def test_one_process_forwards_attributes_and_runs_methods_as_they_are():
    mc = Multicard("single", "cpu")
    model = mc.setup(Coder())
    model.head = nn.Linear(1, 1)  # nothing is reduced on one process: a new layer is fine, on the model
    assert "head" in model.module._modules and "head" not in model._modules
    model.encode(torch.ones(2, 4)).sum().backward()  # no wrapper to bypass
    model.require_backward_grad_sync = False
    assert model.require_backward_grad_sync is False
    del model.head
    assert not hasattr(model.module, "head")
    with pytest.raises(UsageError, match="not a plain Coder"):
        mc.no_backward_sync(Coder()).__enter__()
    with pytest.raises(UsageError, match="state is a Prepared"):
        mc.save("never.pt", model)
    with pytest.raises(UsageError, match="has no method 'decode'"):
        mc.mark_forward(model, "decode")


def test_a_second_ddp_multicard_reuses_the_group_and_the_last_close_leaves_it():
    first, second = Multicard("ddp", "cpu:1"), Multicard("ddp", "cpu:1")
    assert first.all_reduce(2).item() == 2 and second.all_reduce(3).item() == 3
    first.close()
    assert torch_dist.is_initialized() and second.all_reduce(1).item() == 1
    second.close()
    assert not torch_dist.is_initialized()


def test_split_bounds_are_contiguous_and_uneven_by_at_most_one():
    assert [bounds(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [bounds(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]


TORCHRUN_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from multicard.yourloop.multicard import Multicard
from test_your_script import script_job

dist.init_process_group("gloo")  # nanoGPT's habit: the script joins the group itself
mc = Multicard()
ranks, main = script_job(mc, {folder!r}), mc.is_main
mc.close()
assert dist.is_initialized()  # the script's group is the script's to destroy
if main:
    first = ranks[0]["weights"]
    print(json.dumps({{"world": len(ranks), "encode": ranks[1]["encode"], "nanogpt": ranks[1]["nanogpt_reductions"],
                       "equal": all(torch.equal(r["weights"][k], v) for r in ranks for k, v in first.items()),
                       "second": ranks[1]["second"]}}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun_with_the_scripts_own_process_group(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent), folder=str(tmp_path)))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=HUNG_S, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world"] == 2 and result["equal"] and result["nanogpt"] == 2 and result["second"] == 2
    assert "model.encode() runs the model's layers outside its forward" in result["encode"]


def fsdp_job(mc: Multicard) -> list:
    torch.manual_seed(0)
    model = mc.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(mc.rank))
    loss = model(x).sum()
    with mc.no_backward_sync(model):  # backward only: fsdp decides in backward
        loss.backward()
    backward_only = model.module[0].weight.grad is None  # no reduce-scatter: the shard has no gradient yet
    model.require_backward_grad_sync = False  # nanoGPT's switch reaches fsdp's
    model(x).sum().backward()
    switched_off = model.module[0].weight.grad is None
    model.require_backward_grad_sync = True
    model(x).sum().backward()
    return mc.gather((backward_only, switched_off, model.module[0].weight.grad is None))


def test_fsdp_skips_by_backward_and_follows_the_switch():
    assert multicard.launch(fsdp_job, strategy="fsdp", devices="cpu:2") == [(True, True, False)] * 2


# -- saving when the cluster says stop: docs/your-loop.md's script (issue 48, item 5) --------------------------------
def stop_example() -> str:
    """The whole script of your-loop.md's "Saving when the cluster says stop"."""
    text = (Path(ROOT) / "docs" / "your-loop.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "mc.stop_requested" in b)


# put before the script: the last rank sends SIGUSR1 to itself alone after its 7th optimizer step, unless the
# checkpoint it would stop at is there already (the run that goes on)
SIGNALLED = """import os, signal
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

_steps = [0]


def _signal_once(optimizer, args, kwargs):
    _steps[0] += 1
    if _steps[0] == 7 and os.environ.get("RANK", "0") == {rank!r} and not Path("stop-ckpt.pt").exists():
        os.kill(os.getpid(), signal.SIGUSR1)


register_optimizer_step_post_hook(_signal_once)
"""


@pytest.mark.parametrize("devices", ["cpu", pytest.param("cpu:2", marks=pytest.mark.slow)])
def test_the_docs_loop_saves_on_a_signal_and_goes_on_bit_identical(tmp_path, devices):
    n = int(devices.partition(":")[2] or 1)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    for name, prefix in (("whole", ""), ("stopped", SIGNALLED.format(rank=str(n - 1)))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "script.py").write_text(prefix + stop_example())

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "multicard", "run", "--quiet", "--devices", devices, "script.py"],
                              cwd=tmp_path / name, env=env, capture_output=True, text=True, timeout=HUNG_S)

    whole = run("whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = run("stopped")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    said = re.fullmatch(r"stopped by SIGUSR1 after step (\d+): stop-ckpt\.pt written\n", stopped.stdout)  # rank 0's
    assert said and (int(said[1]) == 7 if n == 1 else int(said[1]) >= 7)  # 2: the next read at which the ranks met
    assert not (tmp_path / "stopped" / "model.pt").exists()
    again = run("stopped")  # the checkpoint is there: it goes on from step 7 (and sends no signal)
    assert again.returncode == 0 and not again.stdout, again.stderr[-3000:]
    a, b = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("whole", "stopped"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- ranks that pass different structures -----------------------------------------------------------------------------
def mismatched(mc) -> dict:
    out = {}
    mine = {"rank": mc.rank} if mc.rank == 0 else torch.tensor([7.0, 8.0])  # a dict on 0, a tensor on 1
    out["from_dict"] = mc.broadcast(mine, src=0)
    out["from_tensor"] = mc.broadcast(mine, src=1)
    try:
        mc.gather_in_order(torch.zeros(2, 3) if mc.rank == 0 else [1.0, 2.0])
    except UsageError as e:
        out["tensor_vs_list"] = str(e)
    try:
        mc.gather_in_order({"a": [1], "b": [2]} if mc.rank == 0 else {"a": [1], "c": [2]})
    except UsageError as e:
        out["keys"] = str(e)
    return mc.gather(out)


def test_mismatched_structures_across_ranks_broadcast_as_src_sent_and_gather_in_order_says_both():
    ranks = multicard.launch(mismatched, strategy="ddp", devices="cpu:2")
    for r in ranks:
        assert r["from_dict"] == {"rank": 0} and torch.equal(r["from_tensor"], torch.tensor([7.0, 8.0]))
        assert r["tensor_vs_list"] == ("gather_in_order: rank 0 passed a tensor of rows (3,), rank 1 a list: every "
                                       "process must pass the same structure")
        assert r["keys"] == ("gather_in_order: rank 0 passed {'a': a list, 'b': a list}, rank 1 {'a': a list, 'c': "
                             "a list}: every process must pass the same structure")
