"""examples/mnist_one_card.py taken to N processes or cards: 10 lines differ (see the README, or diff the two).

Run:  .venv/bin/python examples/mnist_your_loop.py --epochs 3                       (one process, as before)
      .venv/bin/multicard run --devices cpu:2 examples/mnist_your_loop.py --epochs 3  (two processes on the CPU)
      .venv/bin/torchrun --nproc-per-node 2 examples/mnist_your_loop.py --epochs 3   (the same, started by torchrun)
On a machine with cards, the first one uses every card (ddp): the script starts its processes itself.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

import multicard
from multicard.data import mnist5k

mc = multicard.Multicard()  # the job: ddp over every card, or over --devices cpu:N under multicard run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        mc.backward(loss)
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            mc.print(f"Train Epoch: {epoch} [{batch_idx * train_loader.batch_size}/{len(train_loader.dataset)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # summed over the batch
            correct += (output.argmax(dim=1) == target).sum().item()
    test_loss, correct = mc.all_reduce(test_loss).item(), int(mc.all_reduce(correct))  # every process's part
    test_loss /= len(test_loader.dataset)
    mc.print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100.0 * correct / len(test_loader.dataset):.0f}%)\n")


def main():
    parser = argparse.ArgumentParser(description="pytorch/examples' MNIST recipe on mnist-5k")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for testing")
    parser.add_argument("--epochs", type=int, default=14, help="number of epochs to train (default: 14)")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--dry-run", action="store_true", help="one logged batch per epoch, for a quick check")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
    parser.add_argument("--save-model", action="store_true", help="save the trained model as mnist_cnn.pt")
    args = parser.parse_args()
    use_cuda = mc.device.type == "cuda"  # --no-cuda: say --devices cpu to multicard run
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if use_cuda else "cpu")

    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}  # mnist-5k is stored sorted by label
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_cuda:
        cuda_kwargs = {"num_workers": 1, "pin_memory": True, "shuffle": True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)
    dataset1, dataset2 = mnist5k.load()  # 4,000 training and 1,000 test digits, normalized
    train_loader = DataLoader(dataset1, **train_kwargs)
    test_loader = DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model, optimizer = mc.setup(model, optimizer)
    train_loader, test_loader = mc.setup_dataloader(train_loader), mc.setup_dataloader(test_loader, train=False)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        mc.save("mnist_cnn.pt", model.state_dict())  # rank 0 writes; the same plain state_dict


if __name__ == "__main__":
    main()
