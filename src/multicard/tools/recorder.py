"""`multicard check script.py`, inside each rank: the user's script run as `python script.py` would run it, with a
recorder that notes what it trains. After each optimizer step: the weights of the set-up models that the step
moved (rank 0: whole tensors, on the CPU), the losses passed to mc.backward since the step before, and a digest of
torch's random state; at setup: what could part N processes from one (dropout, BatchNorm per process, the
precision, the seed). Run as `python -m multicard.tools.recorder script.py args...` with protocol.CHECK_RECORDS
naming the folder where each rank writes rank-R.pt when the script ends well (check_script.py reads them).
CHECK_STEPS=K ends the script in every rank after its K-th optimizer step."""

from __future__ import annotations

import functools
import hashlib
import os
import runpy
import sys
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..jobs import protocol

RECORDS, STEPS = protocol.CHECK_RECORDS, protocol.CHECK_STEPS


class Enough(BaseException):
    """Raised in the hook after the K-th step: the script ends there, in every rank at the same step."""


class Recorder:
    def __init__(self, rank: int, last_step: int):
        self.rank, self.last_step = rank, last_step
        self.names: dict[int, tuple[int, str]] = {}  # id(parameter) -> (set-up model, name)
        self.models: list[dict[str, Any]] = []  # what setup saw of each model
        self.steps: list[dict[str, Any]] = []
        self.losses: list[tuple[float, str]] = []  # passed to mc.backward since the last step

    def install(self) -> None:
        """Wraps Multicard.setup and Multicard.backward (in this process only) and hooks every optimizer's step."""
        from ..yourloop.multicard import Multicard

        setup, backward = Multicard.setup, Multicard.backward

        @functools.wraps(setup)
        def recorded_setup(mc: Any, model: nn.Module, *optimizers: Any) -> Any:
            out = setup(mc, model, *optimizers)
            self.set_up(mc, mc.unwrap(out[0] if optimizers else out))
            return out

        @functools.wraps(backward)
        def recorded_backward(mc: Any, loss: torch.Tensor, reduction: str = "mean") -> None:
            self.losses.append((float(loss.detach().float().sum()), reduction))
            backward(mc, loss, reduction)

        Multicard.setup, Multicard.backward = recorded_setup, recorded_backward
        register_optimizer_step_post_hook(self.stepped)

    def set_up(self, mc: Any, model: nn.Module) -> None:
        for key, p in model.named_parameters():
            self.names.setdefault(id(p), (len(self.models), key))  # (which set-up model, the name in it)
        dropout = [k for k, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                   or not isinstance(m, nn.modules.dropout._DropoutNd) and _float(getattr(m, "dropout", 0)) > 0]
        norms = [k for k, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and type(m).__name__ not in ("SyncBatchNorm", "CPUSyncBatchNorm")]
        self.models.append(dict(name=type(model).__name__, dropout=dropout, batchnorm=norms, precision=mc.precision,
                                sync_batchnorm=mc.sync_batchnorm, strategy=mc.strategy, world=mc.world_size,
                                seed=torch.initial_seed(), random=random_digest()))

    def stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        moved = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.names]
        if not moved:  # an optimizer over no set-up model's parameters: not the check's
            return
        weights = {self.names[id(p)]: p.detach().to("cpu", copy=True) for p in moved} if self.rank == 0 else {}
        self.steps.append(dict(weights=weights, losses=self.losses, random=random_digest()))
        self.losses = []
        if len(self.steps) == self.last_step:
            raise Enough

    def write(self, folder: str) -> None:
        torch.save(dict(models=self.models, steps=self.steps), os.path.join(folder, f"rank-{self.rank}.pt"))


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def random_digest() -> str:
    """torch's random state in this process (the CPU's, and the current card's where CUDA started), digested: two
    processes that drew the same numbers since the same seed have the same digest."""
    digest = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    """Run sys.argv[1] with its arguments as `python script.py args` runs it (its folder first on sys.path, as
    __main__), recorded."""
    script, folder = sys.argv[1], os.environ[RECORDS]
    recorder = Recorder(int(os.environ.get("RANK", "0")), int(os.environ.get(STEPS, "0")))
    recorder.install()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.excepthook = from_script(sys.excepthook, script)
    try:
        runpy.run_path(script, run_name="__main__")
    except Enough:
        pass
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    recorder.write(folder)


def from_script(previous: Any, script: str) -> Any:
    """An excepthook that shows an error as `python script.py` would: from the script's first frame on, not this
    module's and runpy's (multicard's own hooks, set later, call it as the one before theirs)."""
    path = os.path.abspath(script)

    def hook(kind: type, error: BaseException, trace: Any) -> None:
        start = trace
        while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != path:
            start = start.tb_next
        if start is not None and error.__traceback__ is trace:  # Python prints the error's own traceback
            error.with_traceback(start)
        previous(kind, error, start or trace)

    return hook


if __name__ == "__main__":
    from multicard.tools import recorder as imported  # the module under its own name, not as __main__

    imported.main()
