"""The training step of a user's loop: Multicard.backward, clip_gradients, no_backward_sync, mark_forward and
autocast (a mixin of Multicard, beside ranks.py and saving.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..checkpoints.files import own
from ..errors import UsageError
from ..jobs.progress import watched
from . import determinism
from .precision import autocast
from .prepared import Prepared


class Steps:
    """Methods of Multicard (uses its _strategy, scaler, precision, device and world_size)."""

    def backward(self, loss: torch.Tensor, reduction: str = "mean") -> None:
        """loss.backward(); under fp16 the loss is scaled first. reduction="sum": the loss is a sum over the rows
        (reduction="sum", a VAE's BCE + KLD), not a mean: its gradient is then taken as one process takes it,
        the sum over all rows of the global batch (ddp and fsdp average the processes' gradients, so each is
        multiplied by N, rows held unevenly included)."""
        if reduction not in ("mean", "sum"):
            raise UsageError(f"backward(loss, reduction={reduction!r}): say \"mean\" (a loss averaged over the rows, "
                             f"the default) or \"sum\" (summed over them)")
        if reduction == "sum" and self.world_size > 1:  # the forward weighted it as a mean: N / weight on top
            weight = self._job_state.share.applied
            loss = loss * (self.world_size / weight if weight else self.world_size)
        with watched():  # ddp's gradient reduction ran out of time: told to the launcher, even where it is caught
            try:
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            except RuntimeError as e:  # an op whose backward has no deterministic version: one line
                determinism.check(e)
                raise

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients down so that their norm over ALL parameters of the whole model is at most
        max_norm (after unscaling under fp16); returns that norm as it was (a tensor: compare, no host sync).
        Call it between the last backward and optimizer.step(); every strategy gets the same number."""
        if not 0 < max_norm < float("inf"):
            raise UsageError(f"max_norm {max_norm}: must be a positive number")
        if self.scaler is not None:
            if self.world_size > 1:  # the parameters outside the models averaged first: every rank skips alike
                self._job_state.params.average_early(optimizer)
            self.scaler.unscale_(optimizer)
        return self._strategy.clip_grad_norm(model, max_norm)

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Gradients stay local (no reduction) for the micro-batches run inside, e.g. all but the last of several
        accumulated ones; the next backward outside reduces the sum. `model` is what setup returned. Under ddp
        the FORWARD decides: run forward and backward inside (a backward inside whose forward ran outside is
        still reduced; that is said once on stderr). fsdp skips by backward, so backward inside is enough."""
        model = own(model)  # torch.compile(model) after setup: the set-up model inside
        if not isinstance(model, Prepared):
            raise UsageError(f"no_backward_sync(model) takes the model mc.setup returned, not a plain "
                             f"{type(model).__name__} (model.module or the model before setup cannot skip the "
                             f"reduction)")
        with self._strategy.no_sync(model.forward_module) if enabled else contextlib.nullcontext(), \
                model._sync_paused() if enabled else contextlib.nullcontext():
            yield

    def mark_forward(self, model: nn.Module, *names: str) -> None:
        """Methods of your model that run its layers outside forward (model.encode(x), model.generate(...)):
        under ddp and fsdp, each call with gradients on then runs through the wrapper's forward, so their
        gradients are reduced. Unmarked, such a call is one error naming it (other strategies need nothing)."""
        model = own(model)
        if not isinstance(model, Prepared):
            raise UsageError("mark_forward(model, ...) takes the model mc.setup returned")
        for name in names:
            if not callable(getattr(model.module, name, None)):
                raise UsageError(f"mark_forward: {type(model.module).__name__} has no method {name!r}")
        model._marked.update(names)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's autocast (nothing for fp32); setup's model already runs its forward under it."""
        return autocast(self.device.type, self.precision)
