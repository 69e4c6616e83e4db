"""What a second process gains on the CPU: one training loop (your loop on `multicard.Multicard()`), run as one
whole process per setting, so the same file times one process with 1 thread, one with 2 threads and
`multicard run --devices cpu:2` (2 processes, 1 thread each). Rank 0 prints one JSON line: samples/s (and
tokens/s) over the timed steps, after the warm-up steps, and the last step's loss.

--model lenet5: the main job's LeNet-5 (61,706 parameters), Adam, global batch 256, synthetic 28x28 digits.
--model chargpt: a char-level transformer (4 pre-norm layers, width 256, 4 heads, context 128, vocabulary 96,
3,241,568 parameters), AdamW with decay groups, clipping, global batch 16 sequences (2,048 tokens a step).
--compile before|after: torch.compile the model before or after mc.setup (same weights, same data: the losses
compare; "graphs": how many torch compiled); the warm-up's seconds hold the compilation.
--checkpointing: activation checkpointing of each transformer layer (use_reentrant=False).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_speedups.py --model chargpt
    .venv/bin/python benchmarks/cpu_speedups.py --model chargpt
    .venv/bin/multicard run --devices cpu:2 benchmarks/cpu_speedups.py --model chargpt
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import multicard
from multicard.models import LeNet5

VOCAB, CONTEXT, WIDTH, LAYERS = 96, 128, 256, 4


class CharGPT(nn.Module):
    def __init__(self, checkpointing: bool = False):
        super().__init__()
        self.tokens, self.places = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.checkpointing = checkpointing
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, x):
        h = self.tokens(x) + self.places(torch.arange(x.size(1), device=x.device))
        for layer in self.layers:
            if self.checkpointing:
                h = checkpoint(layer, h, self.mask, None, True, use_reentrant=False)
            else:
                h = layer(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def parts(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with decay on the matrices only (nanoGPT's groups)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def data(name: str, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    if name == "lenet5":
        y = torch.randint(0, 10, (samples,), generator=g)
        x = torch.randn(samples, 1, 28, 28, generator=g)
        x[torch.arange(samples), 0, 0, y] += 4
        return TensorDataset(x, y)
    steps = torch.where(torch.rand(samples * CONTEXT + 1, generator=g) < 0.2,
                        torch.randint(0, VOCAB, (samples * CONTEXT + 1,), generator=g), 1)
    stream = torch.cumsum(steps, 0) % VOCAB  # each char mostly the one after the one before
    return TensorDataset(stream[:-1].view(samples, CONTEXT), stream[1:].view(samples, CONTEXT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["lenet5", "chargpt"], default="lenet5")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("--steps", type=int, help="timed optimizer steps (default: lenet5 200, chargpt 30)")
    parser.add_argument("--compile", choices=["none", "before", "after"], default="none")
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same weights in every process
    gpt = args.model == "chargpt"
    batch = 16 if gpt else 256
    args.steps = args.steps or (30 if gpt else 200)
    model = CharGPT(args.checkpointing) if gpt else LeNet5()
    optimizer = parts(model, 1e-3) if gpt else torch.optim.Adam(model.parameters(), lr=1e-3)
    mc = multicard.Multicard()
    if args.compile == "before":
        model = torch.compile(model)
    model, optimizer = mc.setup(model, optimizer)
    if args.compile == "after":
        model = torch.compile(model)
    loader = mc.setup_dataloader(DataLoader(data(args.model, batch * (args.warmup + args.steps)), batch))
    start, began = time.perf_counter(), None
    for step, (x, y) in enumerate(loader):
        if step == args.warmup:
            mc.barrier()
            began = time.perf_counter()
        optimizer.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
        mc.backward(loss)
        if gpt:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    mc.barrier()
    seconds = time.perf_counter() - began
    loss = float(mc.all_reduce(loss.detach(), op="mean"))
    rate = batch * args.steps / seconds
    mc.print(json.dumps({"model": args.model, "processes": mc.world_size, "threads": torch.get_num_threads(),
                         "compile": args.compile, "checkpointing": args.checkpointing,
                         "samples_per_s": round(rate, 1), "tokens_per_s": round(rate * CONTEXT) if gpt else None,
                         "warmup_s": round(began - start, 2), "last_loss": round(loss, 7),
                         "graphs": counters["stats"]["unique_graphs"],
                         "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
