"""`PromptStream`: the endless, seeded, resumable order in which async rollouts draw prompts from a dataset."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

__all__ = ["PromptStream"]


class PromptStream:
    """Endless stream of `(row, prompt_ids)`: row indices in a fresh seeded shuffle per epoch, from any position.

    `PromptStream(..., start=p)` yields exactly what the stream started at 0 would yield from its p-th item on
    (epoch shuffles are replayed from the seed), which is what checkpoint resume needs: no prompt a finished step
    trained on comes back.
    """

    def __init__(self, num_rows: int, seed: int, fetch: Callable[[int], tuple[Any, list[int]]], start: int = 0):
        if num_rows <= 0:
            raise ValueError("The prompt stream needs a non-empty dataset.")
        self.num_rows, self.fetch = num_rows, fetch
        self._rng = random.Random(seed)
        epoch, offset = divmod(start, num_rows)
        for _ in range(epoch):  # replay earlier epochs' shuffles: the RNG must be where the original run left it
            self._next_order()
        self._order = self._next_order()
        self._offset = offset

    def _next_order(self) -> list[int]:
        order = list(range(self.num_rows))
        self._rng.shuffle(order)
        return order

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> tuple[Any, list[int]]:
        if self._offset == self.num_rows:
            self._order, self._offset = self._next_order(), 0
        index = self._order[self._offset]
        self._offset += 1
        return self.fetch(index)
