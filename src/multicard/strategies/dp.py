"""dp: torch.nn.DataParallel in one process over all chosen cards; outputs and the loss land on the first card.

The model lives on the first card. Each forward scatters the batch in chunks over the cards, replicates the
model on them, runs the replicas in threads and gathers the outputs on the first card, where the loss is
computed; backward sums the replicas' gradients into the model there. Only the model is wrapped: the optimizer
and the scheduler stay plain (seed 000 also wrapped them in nn.DataParallel, which only hides them behind
`.module`), so the learning rate reads as on one card; model.pt is saved unwrapped.
"""

from __future__ import annotations

from torch import nn

from ..errors import UsageError
from .base import Strategy


class DP(Strategy):
    name = "dp"

    @property
    def cards(self) -> list[int]:
        """Every chosen card: one process drives them all, so each gets its own peak memory entry."""
        return list(self.devices.ids) if self.devices.kind == "cuda" else []

    def local_batch(self, global_batch: int, what: str = "--batch-size", hint: str = "", accumulate: int = 1) -> int:
        batch = super().local_batch(global_batch, what, hint, accumulate)  # one process: the whole (micro-)batch
        cards = len(self.cards)
        if batch < cards:  # DataParallel would silently leave the last cards idle
            raise UsageError(f"{what} {global_batch} is smaller than the {cards} cards of --strategy {self.name}"
                             f"{f' x {accumulate} micro-batches' if accumulate > 1 else ''}; every card needs a "
                             f"sample: use {what} {cards * accumulate} or more")
        return batch

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model, device_ids=self.cards, output_device=self.cards[0])

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model
