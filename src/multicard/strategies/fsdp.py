"""fsdp: each process holds 1/N of the parameters, their gradients and the optimizer state (FSDP2, the
`fully_shard` that torchtitan scales on). A block's parameters are gathered whole just before it computes and
dropped after; gradients are reduce-scattered, so each process steps only its own shard.

Processes, rendezvous and collectives are ddp's (NCCL on cards, gloo on the CPU and on a shared card). The device
mesh is built explicitly for this process's device: the default one follows the accelerator, which a CPU job must not.
On a shared card gloo's reduce-scatter is an all-reduce of the whole tensor, each process keeping its part: twice the
traffic of NCCL's, through the host; all-gather copies through the host too.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

from ..errors import UsageError
from .ddp import DDP

# torch's optimizers that cannot step fsdp's shards (each parameter a DTensor: 1/N of its rows per process), and why
REFUSED = {
    "LBFGS": "it flattens every parameter into one vector, which a shard cannot be where a parameter does not split "
             "evenly over the processes or has one row",
    "Rprop": "torch's sharded tensors refuse its in-place indexing",
    "Adafactor": "torch's sharded tensors refuse its in-place updates",
    "Muon": "it orthogonalizes each process's rows of a matrix, not the whole matrix: N processes would not take "
            "one process's steps",
}


class FSDP(DDP):
    name = "fsdp"
    sharded = True  # parameters and optimizer state are split over the processes
    blocks = ""  # class names of the modules to shard one by one (comma list); "" : the default rule
    reshard_after_forward = True  # drop a block's gathered parameters after its forward (gathered again in backward)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        dtype = getattr(self, "param_dtype", None)
        # bf16: blocks compute in bf16, gradients are reduced in fp32; the shards themselves stay fp32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in units(model, self.blocks):  # innermost first, the root last
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        return model  # an optimizer the user never set up is refused at its first step (the job's step hook)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        refuse(optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # sharded in place: the model is its own wrapper

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _gradient_sync_off(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The norm over the whole model, not over this process's shard: torch sums the shards' squares over
        the processes (the gradients are DTensors), then every process scales its shard by the same factor."""
        return full(super().clip_grad_norm(model, max_norm))

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's plain state_dict, gathered onto the CPU of rank 0 (every rank must call it; the
        others get {})."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """A whole, plain state_dict (every rank has read it) into the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def refuse(optimizer: torch.optim.Optimizer) -> None:
    """One line for an optimizer in REFUSED (or a subclass of one) over fsdp's shards. Cheap: it runs before every
    optimizer step while an fsdp job is open (yourloop/job_state.py)."""
    name = next((c.__name__ for c in type(optimizer).__mro__
                 if c.__module__.startswith("torch.optim") and c.__name__ in REFUSED), None)
    if name is None:
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        raise UsageError(f"fsdp cannot step {name}: {REFUSED[name]}; use ddp (it steps any torch optimizer), or "
                         f"an optimizer that steps each parameter on its own (SGD, Adam, AdamW, ...)")


def units(model: nn.Module, names: str = "") -> list[nn.Module]:
    """The modules to shard one by one, innermost first. Named classes (`names`, a comma list) where given;
    else the model's repeated blocks: children of one ModuleList or Sequential that share a class and hold
    parameters (a transformer's layers, a ResNet's residual blocks); else each child of the root that holds
    parameters. A model too small for any of these is one unit: the root."""
    if names:
        wanted = {n.strip() for n in names.split(",") if n.strip()}
        found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
        if not found:
            classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise UsageError(f"--fsdp-blocks {names}: no module of that class in {type(model).__name__} (its "
                             f"classes: {', '.join(classes)})")
    else:
        found = []
        for container in model.modules():  # outermost first: blocks inside a block chosen already stay in it
            if isinstance(container, (nn.ModuleList, nn.Sequential)) and \
                    not any(container is f or container in set(f.modules()) for f in found):
                found += repeated(container)
        if not found:
            found = [child for child in model.children() if any(True for _ in child.parameters())]
    depth = {m: len(name.split(".")) for name, m in model.named_modules()}
    return sorted(dict.fromkeys(found), key=lambda m: -depth[m])  # children before their parents


def repeated(container: nn.Module) -> list[nn.Module]:
    children = [c for c in container.children() if any(True for _ in c.parameters())]
    kinds = Counter(type(c) for c in children)
    return [c for c in children if kinds[type(c)] > 1]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole (a collective: every rank calls it), or the tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def _gradient_sync_off(model: nn.Module):
    """Backward keeps whole, unsharded gradients until the next backward outside: accumulation's micro-batches
    then cost no reduce-scatter each, but hold the gradients of the whole model in every process, which is the
    memory fsdp saves. See docs/strategies.md."""
    if not hasattr(model, "set_requires_gradient_sync"):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
