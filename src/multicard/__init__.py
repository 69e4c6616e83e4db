"""multicard: your training loop on one CPU, one card or many cards (single, dp, dp-balanced, ddp, fsdp).

The names below load on first use, so that `multicard --help` does not wait for torch.
"""

from importlib import import_module

from .jobs import launcher_watch as _launcher_watch  # noqa: F401  (first thing: the parent a rank was started under)

__version__ = "0.1.0"
_HOME = {"Multicard": "yourloop.multicard", "launch": "yourloop.multicard", "train": "trainer.run",
         "TrainConfig": "trainer.config", "UsageError": "errors", "save": "checkpoints.files",
         "load": "checkpoints.files", "MODELS": "models", "register": "models", "STRATEGIES": "strategies"}
__all__ = sorted(_HOME)
_PACKAGES = ("models", "data", "checkpoints", "strategies")  # multicard.models.build(...) as the docs write it


def __getattr__(name: str):
    if name in _PACKAGES:
        return import_module(f".{name}", __name__)
    if name not in _HOME:
        raise AttributeError(f"module 'multicard' has no attribute {name!r}")
    return getattr(import_module(f".{_HOME[name]}", __name__), name)
