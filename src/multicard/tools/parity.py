"""multicard check: do N processes (or cards) learn what one learns?

The same K optimizer steps of plain SGD (no momentum: a wrong gradient shows in the weights, where Adam would
normalize a wrong scale away) run on one process and under each strategy this machine can run, with the same
global batch, data order and initial weights, and the run's own knobs (--accumulate, --clip-grad-norm,
--sync-bn). The first step's gradients and the final weights are each compared against --tolerance, or against
the model's own sensitivity where that is larger: one process run again from weights nudged by 1e-7 (float
rounding's size) shows how far rounding alone carries this model, in its first gradients and in K steps' weights
(a BatchNorm ResNet on random labels is chaotic: the nudge moves its first gradients by ~1e-4 and its weights
by 1e-4 in 5 steps; LeNet-5's stay near 1e-7 for 20). Each may differ by up to SENSITIVITY times that. A real
fault moves the gradients by their own size (a sum instead of an average: N times them; a rank with other
data: as much as a batch changes them), far past it. A gradient that differs is named as the cause, with the
ratio that tells a sum from an average.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import data, models, rules
from ..data.images import ImageData
from ..errors import UsageError
from ..jobs.devices import select
from ..strategies import Strategy
from ..strategies.fsdp import full
from ..trainer.config import TrainConfig
from ..yourloop.multicard import Multicard, launch

CHECK_BATCH = 64  # the global batch of the check where --batch-size is auto
LR = 0.05  # plain SGD: large enough that K steps move the weights well past float rounding
NUDGE = 1e-7  # float32 rounding's size: the start of the reference run that measures the model's own sensitivity
SENSITIVITY = 10  # gradients and weights may differ up to this many times what that nudge alone makes them differ


@dataclass
class Side:
    grads: dict[str, torch.Tensor]  # of the first optimizer step, as the optimizer saw them
    weights: dict[str, torch.Tensor]  # after the last step (buffers included)
    loss: float  # mean training loss over the K steps, over every process


@dataclass
class Parity:
    strategy: str
    processes: int
    steps: int
    tolerance: float
    grad_diff: float
    grad_worst: str
    grad_ratio: float  # |gradients| under N over |gradients| on one: N when summed instead of averaged
    weight_diff: float
    weight_worst: str
    sensitivity: float  # how far one process's weights move from a 1e-7 nudge of the start, in the same steps
    grad_sensitivity: float  # how far that nudge moves the first step's gradients
    loss_one: float
    loss_many: float
    causes: list[str] = field(default_factory=list)

    @property
    def grad_bound(self) -> float:
        return max(self.tolerance, SENSITIVITY * self.grad_sensitivity)

    @property
    def weight_bound(self) -> float:
        return max(self.tolerance, SENSITIVITY * self.sensitivity)

    @property
    def ok(self) -> bool:
        return self.grad_diff <= self.grad_bound and self.weight_diff <= self.weight_bound

    def lines(self) -> list[str]:
        out = [f"parity: {self.steps} SGD steps (lr {LR}, no momentum), one device vs {self.processes} "
               f"({self.strategy}): first-step gradients differ by {self.grad_diff:.2e} ({self.grad_worst}), "
               f"weights by {self.weight_diff:.2e} ({self.weight_worst}); tolerance {self.tolerance:.0e}: "
               f"{'PASS' if self.ok else 'FAIL'}",
               f"training loss: {self.loss_one:.6f} on one, {self.loss_many:.6f} under {self.strategy}"]
        if self.grad_bound > self.tolerance:
            out.append(f"this model's own sensitivity: weights nudged by {NUDGE:.0e} give first-step gradients "
                       f"{self.grad_sensitivity:.2e} apart on one process, so the gradients may differ by up to "
                       f"{self.grad_bound:.2e} ({SENSITIVITY}x that)")
        if self.weight_bound > self.tolerance:
            out.append(f"this model's own sensitivity: weights nudged by {NUDGE:.0e} at the start end "
                       f"{self.sensitivity:.2e} apart on one process after the same steps, so the weights may "
                       f"differ by up to {self.weight_bound:.2e} ({SENSITIVITY}x that)")
        if not self.ok:
            out += ["likely cause: " + c for c in self.causes or ["none known; look for rank-dependent code"]]
        return out


def sgd_steps(mc: Multicard, model: nn.Module, dataset: ImageData, config: TrainConfig) -> Side:
    """In every process: K steps of the recipe's loop (SGD instead of its optimizer) on `dataset`."""
    torch.manual_seed(config.seed + mc.rank)  # dropout, if any, draws per rank, as in training
    model = mc.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = mc.setup_dataloader(DataLoader(dataset, config.batch_size, shuffle=True,
                                            generator=torch.Generator().manual_seed(config.seed)),
                                 accumulate=config.accumulate)
    criterion = mc.setup_criterion(nn.CrossEntropyLoss())
    grads, total = None, torch.zeros(2, dtype=torch.float64, device=mc.device)
    for x, y in loader:
        with mc.no_backward_sync(model, enabled=not loader.step_ends):
            loss = criterion(model(x), y)
            mc.backward(loss * loader.share)
        total += torch.stack([loss.detach().double() * len(y), total.new_tensor(len(y))])
        if loader.step_ends:
            if config.clip_grad_norm:
                mc.clip_gradients(model, optimizer, config.clip_grad_norm)
            if grads is None:
                # fsdp: each process holds a shard of each gradient; made whole here (every rank takes part)
                grads = {k: full(p.grad).detach().cpu().clone() for k, p in mc.unwrap(model).named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    loss_sum, samples = mc.all_reduce(total).tolist()
    weights = mc.state_dict(model)  # whole (fsdp: gathered onto rank 0, whose result is the one used)
    return Side(grads, weights, loss_sum / samples)


def worst(one: dict[str, torch.Tensor], many: dict[str, torch.Tensor]) -> tuple[float, str]:
    diffs = {k: (one[k].double() - many[k].double()).abs().max().item() for k in one if one[k].numel()}
    name = max(diffs, key=diffs.get)
    return diffs[name], name


def nudge(model: nn.Module) -> nn.Module:
    """A copy of `model` with every weight multiplied by 1 + NUDGE x (a fixed normal draw)."""
    nudged, g = copy.deepcopy(model), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + NUDGE * torch.randn(p.shape, generator=g).to(p.dtype))
    return nudged


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors.values()])).item()


def likely_causes(result: Parity, model: nn.Module, config: TrainConfig) -> list[str]:
    causes = []
    if result.grad_diff > result.grad_bound:
        cause = (f"the gradients differ from the first step (norm ratio {result.grad_ratio:.3f} of one "
                 f"process's)")
        if result.processes > 1 and abs(result.grad_ratio - result.processes) < 0.05 * result.processes:
            cause += f": they look summed over the {result.processes} processes instead of averaged"
        causes.append(cause)
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        if result.strategy in ("ddp", "fsdp") and not config.sync_bn:
            causes.append("BatchNorm computes its statistics per process; add --sync-bn (sync_batchnorm=True) "
                          "to compute them over the whole batch")
        elif result.strategy not in ("ddp", "fsdp"):
            causes.append(f"BatchNorm computes its statistics per card under {result.strategy}")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        causes.append("dropout draws its masks from each rank's own RNG, so masks differ per rank")
    return causes


def runnable(config: TrainConfig) -> tuple[list[str], str]:
    """The strategies to compare with one process, and the devices for them."""
    auto = select("auto")
    cards = auto.count if auto.kind == "cuda" else 0
    devices = config.devices if config.devices != "auto" else ("cuda" if cards > 1 else "cpu:2")
    many = select(devices)
    if many.count < 2:
        raise UsageError(f"--devices {config.devices}: parity needs 2 or more devices, e.g. cpu:2 or 0,1")
    if many.kind == "cuda":  # this process sees only the chosen cards now: named again as it sees them
        devices = many.spec
    if config.strategy != "auto":
        return [config.strategy], devices
    # fsdp only when asked for (--strategy fsdp): its parity is ddp's arithmetic, sharded; dp and dp-balanced cannot
    # rehearse on a shared card
    return (["ddp", "dp", "dp-balanced"] if many.kind == "cuda" and not many.shared else ["ddp"]), devices


def check(config: TrainConfig, steps: int = 20, tolerance: float = 1e-4,
          strategies: list[str | Strategy] | None = None) -> list[Parity]:
    """One Parity per strategy (those this machine can run, or `strategies`: names or Strategy objects). The
    batch is the run's --batch-size; auto is the check's own 64 (20 steps of 64 fit mnist-5k)."""
    config.validate()
    if config.batch_size is None:
        config = replace(config, batch_size=CHECK_BATCH)
    rules.at_least(steps, f"--steps {steps}", 1)
    if not 0 <= tolerance < float("inf"):
        raise UsageError(f"--tolerance {tolerance}: must be a number of 0 or more")
    names, devices = runnable(config) if strategies is None else (strategies, config.devices)
    torch.manual_seed(config.seed)
    model = models.build(config.model)
    shape = tuple(getattr(model, "input_shape", (1, 28, 28)))
    train_set, _ = data.load(config.data, config.data_dir, config.download, False, config.synthetic_samples,
                             config.seed, shape)
    if tuple(train_set.tensors[0].shape[1:]) != shape:  # the data does not fit the model: its shape decides
        train_set, _ = data.load("synthetic", synthetic_samples=steps * config.batch_size, seed=config.seed,
                                 shape=shape)
    size = steps * config.batch_size
    if size > len(train_set):
        raise UsageError(f"--steps {steps} x --batch-size {config.batch_size} needs {size} samples; "
                         f"{config.data} has {len(train_set)}")
    subset = ImageData(train_set.tensors[0][:size], train_set.tensors[1][:size], train_set.mean, train_set.std)
    results, sides, kinds = [], [], set()  # sides: one per strategy given (two may share a name)
    for name in names:  # the many-device runs first: the single run may start CUDA in this process
        counted = select(devices) if isinstance(name, str) else name.devices
        kinds.add(counted.kind)
        mc = Multicard(name, devices if isinstance(name, str) else "auto", sync_batchnorm=config.sync_bn)
        sides.append((mc.strategy, counted.count, mc.launch(sgd_steps, copy.deepcopy(model), subset, config)))
    one_device = "cpu" if kinds == {"cpu"} else "cuda:0"
    one = launch(sgd_steps, copy.deepcopy(model), subset, config, strategy="single", devices=one_device)
    nudged = launch(sgd_steps, nudge(model), subset, config, strategy="single", devices=one_device)
    sensitivity, grad_sensitivity = worst(one.weights, nudged.weights)[0], worst(one.grads, nudged.grads)[0]
    for strategy, processes, many in sides:
        grad_diff, grad_worst = worst(one.grads, many.grads)
        weight_diff, weight_worst = worst(one.weights, many.weights)
        result = Parity(strategy, processes, steps, tolerance, grad_diff, grad_worst,
                        norm(many.grads) / max(norm(one.grads), 1e-30), weight_diff, weight_worst, sensitivity,
                        grad_sensitivity, one.loss, many.loss)
        result.causes = likely_causes(result, model, config)
        results.append(result)
    return results
