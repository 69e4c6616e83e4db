"""Models by name. Add your own with `@register("name")` on a class or a function that returns a module.

A model class may say what one sample looks like (`input_shape = (C, H, W)`); synthetic data follows it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import UsageError
from .lenet import LeNet5
from .resnet import ResNet8

MODELS: dict[str, Callable[[], nn.Module]] = {"lenet5": LeNet5, "resnet8": ResNet8}


def register(name: str):
    def add(factory: Callable[[], nn.Module]):
        MODELS[name] = factory
        return factory

    return add


def build(name: str) -> nn.Module:
    if name not in MODELS:
        raise UsageError(f"--model {name}: unknown; choose one of {', '.join(sorted(MODELS))}")
    return MODELS[name]()


__all__ = ["MODELS", "LeNet5", "ResNet8", "build", "register"]
