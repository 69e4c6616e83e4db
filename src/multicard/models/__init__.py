"""Models by name (this layer imports errors.py only). Add your own with `@register("name")` on a class or a
function that returns a module.

A model class may say what one sample looks like (`input_shape = (C, H, W)`); synthetic data follows it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..errors import UsageError
from . import user_error
from .lenet import LeNet5
from .resnet import ResNet8
from .wide_mlp import WideMLP

# the models by name: a registry users add to (@register), read by --model; module level, as names are global
MODELS: dict[str, Callable[[], nn.Module]] = {"lenet5": LeNet5, "resnet8": ResNet8, "wide-mlp": WideMLP}


def register(name: str):
    def add(factory: Callable[[], nn.Module]):
        MODELS[name] = factory
        return factory

    return add


def build(name: str) -> nn.Module:
    """A registered name, or your own class (or function) by where it lives: `path/to/file.py:Net` or
    `package.module:Net`; it is called with no arguments."""
    if ":" in name:
        factory = find(name)
    elif name in MODELS:
        factory = MODELS[name]
    else:
        raise UsageError(f"--model {name}: unknown; choose one of {', '.join(sorted(MODELS))}, "
                         f"or name your own as file.py:Class or package.module:Class")
    try:
        model = factory()
    except Exception as e:  # the user's own code failing in __init__: their error, in one line
        if isinstance(e, TypeError) and user_error.where(e) is None:  # the call itself: the class wants arguments
            raise UsageError(f"--model {name}: cannot be built without arguments ({e})") from None
        raise UsageError(f"--model {name}: building it failed: {user_error.line(e)}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {name}: gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def find(spec: str) -> Callable[[], nn.Module]:
    """Import `file.py:Name` or `package.module:Name`. A file is imported as a module named after it, from its
    folder (put first on sys.path), so that processes spawned later find its classes the same way."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise UsageError(f"--model {spec}: name both the file (or module) and the class, as file.py:Class or "
                         f"package.module:Class")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise UsageError(f"--model {spec}: no such file {where}")
        module_name = path.stem
        loaded = sys.modules.get(module_name)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise UsageError(f"--model {spec}: a module named {module_name} is imported already; rename {where}")
        sys.path.insert(0, str(path.parent))
    else:
        module_name = where
    module = _import(spec, where, module_name)
    if not hasattr(module, attr):
        raise UsageError(f"--model {spec}: {where} has no {attr}")
    return getattr(module, attr)


def _import(spec: str, where: str, module_name: str):
    """Import the module that holds the model, as a module: it sees no command line of ours (a script's top-level
    argparse would read multicard's flags), and one that ends the program when imported is refused in a line."""
    argv, sys.argv = sys.argv, [where]
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--model {spec}: cannot import {where} ({e})") from None
    except Exception as e:  # the user's module failing as it is imported (SyntaxError, NameError, ...)
        raise UsageError(f"--model {spec}: importing {where} failed: {user_error.line(e)}") from None
    except SystemExit as e:
        raise UsageError(f"--model {spec}: importing {where} ended the program (exit {e.code}); run its script part "
                         f"only under `if __name__ == \"__main__\":`") from None
    finally:
        sys.argv = argv


__all__ = ["MODELS", "LeNet5", "ResNet8", "WideMLP", "build", "register"]
