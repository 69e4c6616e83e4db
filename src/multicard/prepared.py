"""Prepared: a model as Multicard.setup returns it. It reads as the user's own model; the forward goes through the
strategy's wrapper, under the precision's autocast."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .checkpoint import unprefixed


class Prepared(nn.Module):
    """A model as set up: the strategy's wrapper runs the forward (under autocast where `dtype` is given, the
    outputs handed back in fp32). Everything else reads as the user's own model: its attributes, `.module`,
    and its state_dict, which has no wrapper prefix."""

    def __init__(self, forward_module: nn.Module, module: nn.Module, device_type: str, dtype: torch.dtype | None):
        super().__init__()
        self.forward_module = forward_module  # registered: train(), eval() and parameters() reach the model
        self.__dict__.update(_module=module, _autocast=(device_type, dtype))  # not registered a second time

    @property
    def module(self) -> nn.Module:
        return self.__dict__["_module"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type, dtype = self._autocast
        if dtype is None:
            return self.forward_module(*args, **kwargs)
        with torch.autocast(device_type, dtype):
            return to_fp32(self.forward_module(*args, **kwargs))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(unprefixed(state_dict), strict, assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_module" not in self.__dict__:
                raise
            return getattr(self.__dict__["_module"], name)


def to_fp32(obj: Any) -> Any:
    """Half-precision float tensors in any structure back to float32, the structure kept (dp-balanced's list of
    per-card outputs with its sample counts included)."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, dict):
        return type(obj)((k, to_fp32(v)) for k, v in obj.items())
    if isinstance(obj, list):
        out = copy.copy(obj)  # a list subclass keeps what else it carries
        out[:] = [to_fp32(v) for v in obj]
        return out
    if isinstance(obj, tuple):
        items = [to_fp32(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
