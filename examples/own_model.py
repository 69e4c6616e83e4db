"""Your own model, data and criterion on multicard's loop: the seeds' build_net / build_data, as arguments.

Run:  .venv/bin/python examples/own_model.py --strategy ddp --devices cpu:2
"""

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multicard


def build_data(samples: int = 3072, features: int = 20, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (samples,), generator=g)
    x = centers[y] + torch.randn(samples, features, generator=g)
    cut = samples * 3 // 4
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def build_net(features: int = 20, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    train, test = build_data()
    torch.manual_seed(0)
    summary = multicard.train(build_net(), train, test, criterion=nn.CrossEntropyLoss(), strategy=args.strategy,
                              devices=args.devices, epochs=args.epochs, batch_size=64, out="runs/own_model")
    print(f"{summary['strategy']} on {summary['world_size']} process(es): "
          f"test accuracy {summary['test_accuracy']:.2%}")


if __name__ == "__main__":  # ddp spawns processes: keep the entry point guarded
    main()
