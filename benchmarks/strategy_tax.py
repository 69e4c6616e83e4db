"""The strategy tax: each strategy on ONE device against `single`, in the same run. With one process or one card
there is nobody to reduce with, so ddp, dp and dp-balanced should cost nothing over single.

multicard.train(model, mnist-5k train, strategy=S, devices=<one>, batch 64, Adam 1e-3, no schedule, augment off)
for S in single, ddp (one process) and, on a card, dp and dp-balanced; 1 warm-up epoch + --epochs timed epochs,
rates from metrics.jsonl without epoch 1. --model tiny (a linear layer over the pixels) makes a step's time the
loop's and the strategy's host work; lenet5 is the main job's model. Repeats are interleaved; medians reported.

    .venv/bin/python benchmarks/strategy_tax.py [--device cpu|cuda] [--model tiny|lenet5] [--epochs 3]
        [--repeats 3] [--out benchmarks/results/strategy_tax.json]
"""

from __future__ import annotations

import tempfile

import torch
from _common import interleaved, load_mnist5k, machine, parse_args, report, timed_rate
from loop_vs_plain import BATCH, LR, MODELS, SEED, add_flags

import multicard


def main() -> None:
    args = parse_args(__doc__, "benchmarks/results/strategy_tax.json", extra=add_flags)
    train, test, x, *_ = load_mnist5k()
    card = args.device != "cpu"
    names = ["single", "ddp", *(["dp", "dp-balanced"] if card else [])]
    summary_rates = []

    def run(name: str) -> tuple[float, float]:
        torch.manual_seed(SEED)
        with tempfile.TemporaryDirectory() as out:
            summary = multicard.train(MODELS[args.model](), train, test, strategy=name, devices="1" if card else "cpu",
                                      epochs=args.epochs + 1, batch_size=BATCH, lr=LR, scheduler="none", seed=SEED,
                                      augment=False, quiet=True, out=out, channels_last=False, device_data=card)
            summary_rates.append(summary["train_samples_per_s"])
            return timed_rate(out), summary["test_accuracy"]

    rates, accs = interleaved(names, args.repeats, run)
    report("strategy_tax", "strategy",
           f"each strategy on one {'card' if card else 'CPU process'}: {args.epochs} timed epochs (+1 warm-up) x "
           f"{args.repeats} interleaved rounds, mnist-5k train ({len(x)} samples), {args.model}, batch {BATCH}, "
           f"Adam {LR}, torch threads {torch.get_num_threads()}", rates, accs, summary_rates,
           settings={"model": args.model, "device": args.device, "batch_size": BATCH, "optimizer": f"Adam lr {LR}",
                     "timed_epochs": args.epochs, "repeats": args.repeats, "order": "rotated each round"},
           hardware=machine(torch_threads=torch.get_num_threads()), out=args.out, per_step=BATCH)


if __name__ == "__main__":
    main()
