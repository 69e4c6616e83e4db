"""Where multicard's closed world meets what a user brings (issue 50.4-50.6): the batches it fingerprints hold
anything (zero rows, zero-size dimensions, NaN, any dtype) and alike ones pass while different ones are still
caught, on 2 gloo processes; under ddp a model whose parameters are all frozen runs (a saliency map), and a rank
that trains other parameters than the others is one line as soon as they meet, never a collective timeout (2 and
3 processes); a single process has a process group of one, so a model that asks torch.distributed itself runs."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import multicard
from conftest import run_cli
from multicard.errors import UsageError
from multicard.yourloop.multicard import Multicard

BASE = torch.tensor([[0.5, -1.0], [2.0, 0.25], [-3.0, 1.5], [4.0, -0.75]])  # 4 rows: 2 a process


def quantized(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates its quantized tensors; a batch may still hold one
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(values, 0.25, 8, torch.quint8)


def special(case: str, other: bool) -> torch.Tensor:
    """The tensor of `case` that a batch holds; `other`: the one a rank drew apart (it differs in one value, or
    where it holds none, in its shape)."""
    values = BASE.clone()
    if other:
        values[3, 1] = 0.0 if case == "bool" else 3.0  # the last rank's -0.75 read otherwise
    if case == "zero rows":  # detection targets of an image with no objects
        return torch.zeros(0, 5 if other else 4)
    if case == "zero-size dim":
        return torch.zeros(4, 0, 3 if other else 2)
    if case == "nan":
        values[0, 0] = float("nan")
        return values
    if case == "complex":
        return torch.complex(values, -values)
    if case == "quantized":
        return quantized(values)
    return values.to(DTYPES[case])


DTYPES = {"bool": torch.bool, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
          "uint8": torch.uint8}
CASES = ["zero rows", "zero-size dim", "nan", "complex", "quantized", *DTYPES]


def batch(mc: Multicard, case: str, apart: bool) -> dict:
    """A global batch holding the case's tensor; `apart`: the last rank drew its own."""
    return {"x": BASE, "v": special(case, apart and mc.rank == mc.world_size - 1)}


class Batches(IterableDataset):
    """A loader's stream every process reads whole: two batches, already batched."""

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class Holder(nn.Module):
    """A layer, and a buffer of the case's tensor (the replica check compares it)."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("v", value)

    def forward(self, x):
        return self.lin(x)


class Detector(nn.Module):
    """Images and, for each, its targets (an image with no objects has none)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, images, targets):
        return self.lin(images).sum() + sum(len(t["boxes"]) for t in targets)


def said(fn) -> str:
    """The line `fn()` stopped with, or "passed"."""
    try:
        fn()
    except UsageError as e:
        return str(e)
    return "passed"


def paths(mc: Multicard, case: str) -> dict:
    """Each place multicard fingerprints a batch or tensors, fed alike and apart batches holding `case`."""
    return {(path, apart): line for apart in (False, True) for path, line in fed(mc, case, apart).items()}


def fed(mc: Multicard, case: str, apart: bool) -> dict:
    run = Multicard("ddp", "cpu", replica_check_every=1)  # mc.local compares every call
    found = {"local": said(lambda: run.local(batch(mc, case, apart)))}
    loader = run.setup_dataloader(DataLoader(Batches([batch(mc, case, apart)] * 2), batch_size=None))
    found["loader"] = said(lambda: list(loader))
    holder = run.setup(Holder(special(case, False)))

    def replicas() -> None:
        holder.module.v = special(case, apart and mc.rank == mc.world_size - 1)
        run.check_replicas()

    found["replicas"] = said(replicas)
    run.close()
    return found


def fingerprints_job(mc: Multicard) -> dict:
    found = {case: paths(mc, case) for case in CASES}
    run = Multicard("ddp", "cpu")
    model = run.setup(Detector())
    targets = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}] * 2
    found["detection"] = said(lambda: model(run.local(BASE), targets))  # the first training forward compares these
    run.close()
    return mc.gather(found)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return multicard.launch(fingerprints_job, devices="cpu:2")


APART = {"local": r"mc.local \(call \d+\): the processes passed different global batches",
         "loader": "this loader serves each process other batches",
         "replicas": "at mc.check_replicas(): the replicas parted: buffer v differs on rank 1"}


def lines(ranks: list[dict], case: str) -> dict:
    assert all(r[case] == ranks[0][case] for r in ranks), case  # every rank says the same
    return ranks[0][case]


def check(ranks: list[dict], case: str, alike_cut: str = "passed", apart_loader: str = APART["loader"],
          apart_replicas: str = APART["replicas"]):
    found = lines(ranks, case)
    assert found["local", False].startswith(alike_cut) and re.match(APART["local"], found["local", True]), found
    assert found["loader", False].startswith(alike_cut) and found["loader", True].startswith(apart_loader), found
    assert found["replicas", False] == "passed" and found["replicas", True].startswith(apart_replicas), found


def test_a_batch_with_zero_rows_is_read(ranks):
    # alike, mc.local cuts it next, and that says why it cannot be: its fields' rows differ (a loader read whole
    # counts its rows before it compares it)
    rows = "the batch's fields hold different numbers of rows along dim 0 (['x']: 4, ['v']: 0)"
    check(ranks, "zero rows", alike_cut=rows, apart_loader=rows,
          apart_replicas="at mc.check_replicas(): the processes' models or optimizers are not built alike ")


def test_detection_targets_of_an_image_with_no_objects_reach_the_model(ranks):
    assert lines(ranks, "detection") == "passed"


def test_a_tensor_with_a_zero_size_dimension_is_read(ranks):
    check(ranks, "zero-size dim",
          apart_replicas="at mc.check_replicas(): the processes' models or optimizers are not built alike ")


def test_a_batch_holding_nan_is_alike_where_every_rank_holds_it(ranks):
    check(ranks, "nan")


def test_a_complex_batch_is_read(ranks):
    check(ranks, "complex")


def test_a_quantized_batch_is_read_by_its_values(ranks):
    check(ranks, "quantized")


@pytest.mark.parametrize("case", list(DTYPES))
def test_a_batch_of_any_standard_dtype_is_read(ranks, case):
    check(ranks, case)


# -- what trains, under ddp -------------------------------------------------------------------------------------
X = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))  # a global batch: each rank takes its rows


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def saliency(mc: Multicard, model) -> torch.Tensor:
    """The gradient of the outputs with respect to this process's rows of X (every parameter frozen)."""
    x = mc.local(X).requires_grad_()
    model(x).sum().backward()
    return x.grad


def steps(mc: Multicard, model, optimizer, n: int) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        mc.backward(model(mc.local(X)).pow(2).mean())
        optimizer.step()


def frozen_mid_run(run: Multicard) -> dict:
    """Two steps, a saliency map with every parameter frozen (on every rank), two more steps once unfrozen."""
    model = net()
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    steps(run, model, optimizer, 2)
    model.requires_grad_(False)
    found = {"saliency": saliency(run, model)}
    model.requires_grad_(True)
    steps(run, model, optimizer, 2)
    found["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run.close()
    return found


def frozen_job(mc: Multicard) -> dict:
    found = {}
    run = Multicard("ddp", "cpu")
    model = run.setup(net().requires_grad_(False))  # frozen from the start
    found["saliency"] = saliency(run, model)
    run.close()
    found["mid-run"] = frozen_mid_run(Multicard("ddp", "cpu"))
    run = Multicard("ddp", "cpu")
    model = net()
    if mc.rank == 1:
        model[2].bias.requires_grad_(False)
    found["setup"] = said(lambda: run.setup(model))
    run.close()
    return mc.gather(found)


@pytest.fixture(scope="module")
def frozen() -> list[dict]:
    return multicard.launch(frozen_job, devices="cpu:2")


def test_a_model_frozen_whole_runs_under_ddp_and_its_input_gradient_is_one_process_s(frozen):
    model = net().requires_grad_(False)
    x = X.clone().requires_grad_()
    model(x).sum().backward()
    one = frozen_mid_run(Multicard("single", "cpu"))
    for rank, found in enumerate(frozen):
        assert torch.equal(found["saliency"], x.grad[rank::2])
        torch.testing.assert_close(found["mid-run"]["saliency"], one["saliency"][rank::2])
        for key, value in one["weights"].items():
            torch.testing.assert_close(found["mid-run"]["weights"][key], value)
            assert torch.equal(found["mid-run"]["weights"][key], frozen[0]["mid-run"]["weights"][key])


def test_a_rank_that_froze_a_layer_before_setup_is_one_line_on_every_rank(frozen):
    assert frozen[0]["setup"] == frozen[1]["setup"] == (
        "at mc.setup(Sequential): the processes train different parameters: 2.bias trains on rank 0 but is frozen on "
        "rank 1; under ddp every process must train the same parameters (each waits for every trainable parameter's "
        "gradient from all of them): freeze and unfreeze them alike on every rank, not under `if mc.rank == ...`")


def froze_apart(mc: Multicard) -> None:
    """Rank 1 freezes the first layer's weight after 2 steps (rank 2, where there is one, the last bias): the others
    train them on, and go on into the backward that waits for their gradients."""
    model = net()
    model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    steps(mc, model, optimizer, 2)
    if mc.rank == 1:
        model[0].weight.requires_grad_(False)
    if mc.rank == 2:
        model[2].bias.requires_grad_(False)
    steps(mc, model, optimizer, 2)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_that_freezes_a_layer_the_others_train_is_one_line_at_that_forward(world):
    # the job's timeout (120 s) is never waited for: the line comes as the others reach that forward
    with pytest.raises(UsageError) as caught:
        multicard.launch(froze_apart, strategy="ddp", devices=f"cpu:{world}")
    differ = "trains on rank 0 but is frozen on rank 1" if world == 2 else \
        "trains on ranks 0, 2 but is frozen on rank 1 (and 1 more)"
    assert str(caught.value) == (
        f"at forward 3 of the set-up Sequential: the processes train different parameters: 0.weight {differ}; under "
        f"ddp every process must train the same parameters (each waits for every trainable parameter's gradient "
        f"from all of them): freeze and unfreeze them alike on every rank, not under `if mc.rank == ...`")


# -- one process, a process group of one ------------------------------------------------------------------------
class AsksTheGroup(nn.Module):
    """MoCo's habit: a forward that asks torch.distributed itself (the world's size, a sum and a gather over it).
    On one process it gives its layer's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        y = self.lin(x)
        total = y.detach().clone()
        torch_dist.all_reduce(total)
        parts = [torch.empty_like(total) for _ in range(torch_dist.get_world_size())]
        torch_dist.all_gather(parts, total)
        return y * torch_dist.get_world_size() + torch.cat(parts) - total * torch_dist.get_world_size()


X1 = torch.arange(6.0).view(2, 3)


def plain() -> torch.Tensor:
    torch.manual_seed(0)
    return AsksTheGroup().lin(X1)


def test_one_process_has_a_group_of_one_for_a_model_that_asks_torch_distributed():
    mc = Multicard(devices="cpu:1")
    torch.manual_seed(0)
    model = mc.setup(AsksTheGroup())
    assert mc.strategy == "single" and torch.equal(model(X1), plain())
    mc.close()
    assert not torch_dist.is_initialized()  # torn down with the Multicard that joined it


def test_a_group_the_script_joined_itself_stays_the_scripts():
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        mc = Multicard(devices="cpu")
        torch.manual_seed(0)
        assert torch.equal(mc.setup(AsksTheGroup())(X1), plain())
        mc.close()
        assert torch_dist.is_initialized()
    finally:
        torch_dist.destroy_process_group()


RUN_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from multicard import Multicard
from test_closed_world import X1, AsksTheGroup

mc = Multicard()
torch.manual_seed(0)
model = mc.setup(AsksTheGroup())
print(json.dumps({{"strategy": mc.strategy, "out": model(X1).tolist()}}))
"""


def test_multicard_run_on_one_process_runs_a_model_that_asks_torch_distributed(tmp_path):
    script = tmp_path / "moco.py"
    script.write_text(RUN_SCRIPT.format(tests=str(Path(__file__).parent)))
    out = run_cli("run", "--devices", "cpu:1", str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["strategy"] == "single" and torch.equal(torch.tensor(result["out"]), plain())
