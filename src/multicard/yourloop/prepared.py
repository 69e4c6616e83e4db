"""Prepared: a model as Multicard.setup returns it. It reads and writes as the user's own model; the forward goes
through the strategy's wrapper, under the precision's autocast.

What the wrapper must not let drift silently: attributes set on it reach the user's model (which runs forward);
nanoGPT's `model.require_backward_grad_sync = ...` reaches the wrapper where it acts; and where gradients are
reduced by the wrapper (ddp, fsdp on 2+ processes), a method of the model that runs its layers outside forward
is an error, or, once marked (mc.mark_forward), runs through the wrapper's forward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..checkpoints.files import own, unprefixed
from ..errors import UsageError
from ..jobs.trees import values
from . import determinism
from .precision import to_fp32

SYNC = "require_backward_grad_sync"  # DDP's switch; scripts such as nanoGPT set it on the model per micro-step
_OWN = ("forward_module", "_module", "_autocast", "_reduced", "_main", "_marked", "_paused", "_strategy", "_job",
        SYNC)
CONTAINER = ("__getitem__", "__len__", "__iter__")  # a model class with any of these reads as a container


class Prepared(nn.Module):
    """A model as set up: the strategy's wrapper runs the forward (under autocast where `dtype` is given, the
    outputs handed back in fp32). Everything else reads as the user's own model: its attributes, `.module`,
    and its state_dict, which has no wrapper prefix. `reduced`: the wrapper reduces gradients between processes
    (only its forward arms the reduction; `strategy` rebuilds it where what trains changed). `job`: the JobState
    (yourloop/job_state.py) each forward tells: the uneven split's weight, the habits seen, the first inputs
    compared, and the replica check's count of forwards whose backward is reduced."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Prepared:
        module = args[1] if len(args) > 1 else kwargs.get("module")
        if cls is Prepared and any(hasattr(type(own(module)), name) for name in CONTAINER):
            cls = Container  # a Sequential, ModuleList, ModuleDict (or a class of the user's) indexes as itself
        return super().__new__(cls)

    def __init__(self, forward_module: nn.Module, module: nn.Module, device_type: str, dtype: torch.dtype | None,
                 job: Any, reduced: bool = False, main: bool = True, strategy: Any = None):
        super().__init__()
        self.forward_module = forward_module  # registered: train(), eval() and parameters() reach the model
        self.__dict__.update(_module=module, _autocast=(device_type, dtype), _reduced=reduced, _main=main,
                             _marked=set(), _paused=0, _strategy=strategy, _job=job)  # not registered twice

    @property
    def module(self) -> nn.Module:
        return self.__dict__["_module"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type, dtype = self._autocast
        weight = self._before_forward(args, kwargs)
        try:
            if dtype is None:
                out = self.forward_module(*args, **kwargs)
            else:
                with torch.autocast(device_type, dtype):
                    out = to_fp32(self.forward_module(*args, **kwargs))
        except (RuntimeError, ValueError) as error:  # said in one line, or under torch's message
            determinism.check(error)  # an op with no deterministic version: one line
            if self._strategy is not None:  # ddp: a parameter that got no gradient in the last backward
                self._strategy.explain(error, self.module)
            said = self._job.habits.explain(error)  # a shape naming the global batch; an empty evaluation batch
            if said is not None:
                raise said from None
            raise
        return self._after_forward(out, weight)

    # multicard's bookkeeping around the forward runs as it is under torch.compile(model) after setup: compiled, it
    # would be traced (and traced again as its counts change) at every forward
    @torch.compiler.disable
    def _before_forward(self, args: tuple, kwargs: dict) -> float:
        """The wrapper armed, the job told of the forward; returns the weight of its rows of an uneven split."""
        job = self._job
        if self._reduced and torch.is_grad_enabled():
            self._arm()
        weight = job.share.weight_for((args, kwargs)) if self._reduced else 1.0
        job.habits.forwarded()
        if self._reduced:  # 2+ processes: the draws since the last forward, and the first training one's inputs,
            job.inputs.compare()  # compared (inputs_alike.py)
            job.inputs.forwarded((args, kwargs), self.training)
        return weight

    @torch.compiler.disable
    def _after_forward(self, out: Any, weight: float) -> Any:
        if self._reduced and torch.is_grad_enabled():  # an uneven share of the batch's rows: weighted
            out = self._job.share.weigh(out, weight)
        if isinstance(self.forward_module, DistributedDataParallel) and torch.is_grad_enabled() and \
                self.forward_module.require_backward_grad_sync:
            self._watch_backward(out)
        return out

    def _arm(self) -> None:
        """Before a forward with gradients on, whose backward the wrapper reduces: the wrapper built anew where
        what trains changed since it was built (ddp: a parameter frozen or unfrozen mid-run), and the replica
        check told of a reduced forward (not one inside no_backward_sync)."""
        if self._strategy is not None:
            before = self._modules["forward_module"]  # (not through __getattr__: this runs every forward)
            wrapper = self._strategy.refresh(before, self.__dict__["_module"])
            if wrapper is not before:
                self.forward_module = wrapper
        if not self._paused and self.__dict__.get(SYNC, True):
            self._job.replicas.forwarded()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """Your model's keys: no wrapper's prefix, nor torch.compile's (`_orig_mod.`) where it was compiled before
        setup; inside a module of yours (or torch.compile(model)), under that module's prefix."""
        return own(self.module).state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """copy.deepcopy(model), and so AveragedModel(model) (an EMA): a copy of your model, outside every wrapper.
        A copy of ddp's wrapper would wait in each forward for the other processes (an EMA evaluated on rank 0
        alone would hang); a plain copy runs anywhere, and its parameters follow yours in the same order."""
        if any(type(p).__name__ == "DTensor" for p in self.module.parameters()):  # fsdp's shards: torch refuses
            raise UsageError("copy.deepcopy / AveragedModel of a model set up under fsdp: its parameters are this "
                             "process's shards, which torch cannot copy; build the EMA before setup and set it up "
                             "too (ema = mc.setup(AveragedModel(model)), evaluated on every rank), or use ddp")
        return copy.deepcopy(self.module, memo)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Your model's keys (or theirs under a wrapper's or torch.compile's prefix), compiled before setup or not."""
        return own(self.module).load_state_dict(unprefixed(state_dict), strict, assign)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """Loaded as a part of a bigger module (torch.compile(model), a dict of models): the keys state_dict()
        gave under `prefix` go to your model where it sits inside the wrapper (torch loads the children next)."""
        inner = own(self.module)
        path = next((name for name, module in self.named_modules() if module is inner), None)
        if path:
            keys = [k for k in state_dict if k.startswith(prefix)]
            mine = unprefixed({k[len(prefix):]: state_dict.pop(k) for k in keys})
            state_dict.update({f"{prefix}{path}.{k}": v for k, v in mine.items()})
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- reading and writing attributes ----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_module" not in self.__dict__:
                raise
        attr = getattr(self.__dict__["_module"], name)
        if self.__dict__["_reduced"] and getattr(attr, "__self__", None) is self.module and callable(attr):
            return self._guarded(name, attr)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        if "_module" not in self.__dict__ or name in self.__dict__ or name in _OWN or hasattr(type(self), name):
            if name == SYNC and "_module" in self.__dict__:
                self._set_grad_sync(bool(value))
            return super().__setattr__(name, value)
        if self._reduced and _holds_parameters(value):
            raise UsageError(f"model.{name} = {type(value).__name__}(...) after setup: its parameters would not be "
                             f"in the gradient reduction between processes; add it to the model before mc.setup")
        setattr(self.module, name, value)  # the model that runs forward sees it (a property setter runs there)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__ or name in self._parameters or name in self._buffers or name in self._modules:
            return super().__delattr__(name)
        delattr(self.module, name)

    def _set_grad_sync(self, value: bool) -> None:
        """`model.require_backward_grad_sync = False` as on a DDP model: the next forward's backward is not
        reduced (fsdp: no reduce-scatter until it is True again)."""
        wrapper = self.forward_module
        if isinstance(wrapper, DistributedDataParallel):
            wrapper.require_backward_grad_sync = value
        elif hasattr(wrapper, "set_requires_gradient_sync"):
            wrapper.set_requires_gradient_sync(value)

    # -- methods that run the model's layers outside forward ------------------------------------------------
    def _guarded(self, name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing to reduce: run it as it is (e.g. generate on rank 0 only)
                return method(*args, **kwargs)
            if name in self._marked:
                return self._through_forward(method, args, kwargs)
            with _layers_refused(self.module, name):
                return method(*args, **kwargs)

        call.__name__ = name
        return call

    def _through_forward(self, method: Any, args: tuple, kwargs: dict) -> Any:
        """The method runs as the module's forward, called by the wrapper, so the reduction follows its output.
        The substitute puts the real forward back first: the method may call forward (or self(...)) itself."""
        module, before = self.module, self.module.__dict__.get("forward")

        def once(*a: Any, **kw: Any) -> Any:
            _restore_forward(module, before)
            return method(*a, **kw)

        module.__dict__["forward"] = once
        try:
            return self(*args, **kwargs)
        finally:
            _restore_forward(module, before)

    # -- no_backward_sync -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """`with model.no_sync():` as on a DDP model (a DDP script's accumulation): mc.no_backward_sync(model)."""
        before = self.__dict__.get(SYNC, True)
        self.require_backward_grad_sync = False
        try:
            with self._sync_paused():
                yield
        finally:
            self.require_backward_grad_sync = before

    @contextlib.contextmanager
    def _sync_paused(self) -> Iterator[None]:
        self.__dict__["_paused"] += 1
        try:
            yield
        finally:
            self.__dict__["_paused"] -= 1

    def _watch_backward(self, out: Any) -> None:
        """ddp arms its reduction in forward: a backward through this output inside no_backward_sync still
        reduces. Say so once (the hook runs in backward; it costs nothing else)."""
        tensor = next((t for t in values(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is None or "no_sync" in self._job.warned or not self._main:
            return

        def check(grad: torch.Tensor) -> None:
            if self._paused:
                self._job.say_once("no_sync", "a backward inside no_backward_sync reduced the gradients anyway: "
                                   "under ddp the forward decides, and its forward ran outside the context; run the "
                                   "forward inside it too")

        tensor.register_hook(check)


class Container(Prepared):
    """A set-up model whose class indexes (Sequential, ModuleList, ModuleDict, or one of the user's): model[0],
    model["enc"], len, iteration and `in` read the user's model, and give the user's own sub-modules. Called
    directly (model[0](x)), a sub-module runs outside the wrapper's forward: under ddp and fsdp its gradients are
    not reduced between the processes (call it from forward, or under torch.no_grad()). An item set after setup
    (model[3] = nn.Linear(...)) on 2+ processes is refused: its parameters would not be reduced."""

    def __getitem__(self, key: Any) -> Any:
        return own(self.module)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._reduced and _holds_parameters(value):
            raise UsageError(f"model[{key!r}] = {type(value).__name__}(...) after setup: its parameters would not be "
                             f"in the gradient reduction between processes; add it to the model before mc.setup")
        own(self.module)[key] = value

    def __delitem__(self, key: Any) -> None:
        if self._reduced and _holds_parameters(own(self.module)[key]):
            raise UsageError(f"del model[{key!r}] after setup: the wrapper would still wait for its parameters' "
                             f"gradients; remove it from the model before mc.setup")
        del own(self.module)[key]

    def __len__(self) -> int:
        return len(own(self.module))

    def __iter__(self) -> Iterator[Any]:
        return iter(own(self.module))

    def __contains__(self, item: Any) -> bool:
        return item in own(self.module)

    def __bool__(self) -> bool:
        return bool(own(self.module))



def _restore_forward(module: nn.Module, before: Any) -> None:
    if before is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = before


def _holds_parameters(value: Any) -> bool:
    return isinstance(value, nn.Parameter) or (isinstance(value, nn.Module) and any(True for _ in value.parameters()))


@contextlib.contextmanager
def _layers_refused(model: nn.Module, name: str) -> Iterator[None]:
    """While a method of `model` runs with gradients on: one clear error before its first layer with trainable
    parameters runs (outside the wrapper's forward its gradients would stay unreduced, the replicas drifting)."""
    trainable = {id(m) for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))}

    def hook(module: nn.Module, args: Any) -> None:
        if id(module) in trainable and torch.is_grad_enabled():
            raise UsageError(f"model.{name}() runs the model's layers outside its forward: their gradients would "
                             f"not be reduced between the processes. Call mc.mark_forward(model, {name!r}) after "
                             f"setup (then model.{name}() runs through the wrapper's forward), or run it under "
                             f"torch.no_grad() if nothing backpropagates through it")

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()

