"""pytorch/examples' word_language_model shape: batches made by hand from one long tensor of token ids
(batchify / get_batch, truncated backpropagation through time), a small LSTM, on N processes.

batchify lays the corpus out as columns, one stream per column; under multicard each process keeps its
columns (mc.local(..., dim=1): columns rank, rank + N, ...), so N processes together take the step one
process takes. The corpus is synthetic (a seeded token stream with structure to learn), so the script runs
anywhere. --plain runs the one-card original (the lines marked `# multicard` left out).

Run:  .venv/bin/python examples/word_language_model.py                          (one process)
      .venv/bin/python examples/word_language_model.py --plain                  (the one-card original)
      .venv/bin/multicard run --devices cpu:2 examples/word_language_model.py   (two processes on the CPU)
"""

import argparse
import math

import torch
from torch import nn

import multicard


def corpus(length: int, vocabulary: int, seed: int) -> torch.Tensor:
    """Token ids where each token mostly follows from the one before (something for the LSTM to learn)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [0]
    for _ in range(length - 1):
        jump = int(torch.randint(0, vocabulary, (1,), generator=g)) if torch.rand(1, generator=g) < 0.2 else 1
        tokens.append((tokens[-1] + jump) % vocabulary)
    return torch.tensor(tokens)


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int, nhid: int):
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(ntoken, ninp), nn.LSTM(ninp, nhid)
        self.decoder, self.nhid = nn.Linear(nhid, ntoken), nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()  # (length, bsz): a stream per column


def get_batch(source: torch.Tensor, i: int, bptt: int):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def main():
    parser = argparse.ArgumentParser(description="a small LSTM language model on a synthetic corpus")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="streams (columns): the global batch")
    parser.add_argument("--bptt", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--save", default="", help="write the trained weights here")
    parser.add_argument("--plain", action="store_true", help="the one-card original, without multicard")
    args = parser.parse_args()
    mc = None if args.plain else multicard.Multicard()  # multicard

    torch.manual_seed(1111)
    ntokens = 20
    train_data = batchify(corpus(args.tokens, ntokens, seed=0), args.batch_size)
    if mc is not None:  # multicard
        train_data = mc.local(train_data, dim=1)  # multicard: this process's columns
    model = RNNModel(ntokens, 16, 32)
    if mc is not None:  # multicard
        model = mc.setup(model)  # multicard
    criterion = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        model.train()
        total, hidden = 0.0, model.init_hidden(train_data.size(1))  # this process's streams
        starts = range(0, train_data.size(0) - 1, args.bptt)
        for i in starts:
            data, targets = get_batch(train_data, i, args.bptt)
            hidden = repackage_hidden(hidden)
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the gradients are reduced already
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-args.lr)
            total += loss.item()
        if mc is not None:  # multicard: the mean over every process's streams
            total = mc.all_reduce(total, "mean").item()  # multicard
        if mc is None or mc.is_main:
            print(f"epoch {epoch}: train loss {total / len(starts):.4f}, ppl {math.exp(total / len(starts)):.2f}")
    if args.save:
        weights = model.state_dict()
        if mc is None:
            torch.save(weights, args.save)
        else:  # multicard
            mc.save(args.save, weights)  # multicard: rank 0 writes the plain state_dict


if __name__ == "__main__":
    main()
