"""Synthetic long-range tasks, generated in code, with the dependency distance as a knob.

Each task samples ``(inputs, targets)`` of shape ``(rows, seq_len)``; ``targets`` holds
``IGNORE_INDEX`` except where the answer is, so the loss and the accuracy only count answers.
Token ids: 0 blank, 1 delimiter / query marker, 2.. symbols.

- ``assoc_recall``: key-value pairs ``k v k v ...``; the four queried pairs come first, ``distance``
  tokens of distractor pairs (other keys) follow, then ``| k1 v1 k2 v2 ...``: predict each ``v_i``
  after ``k_i`` (multi-query associative recall, as in Zoology, arXiv:2312.04927).
- ``copy``: eight symbols, ``distance`` blanks, ``|``, then the eight symbols again.
- ``selective_copy``: eight symbols scattered among ``distance`` blanks, ``|``, then those symbols in
  order (Mamba's selective copying, arXiv:2312.00752).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .data import IGNORE_INDEX, _mix

__all__ = ["SyntheticTask", "TASKS", "make_task"]

TASKS = ("assoc_recall", "copy", "selective_copy")
BLANK, DELIM, FIRST = 0, 1, 2
NUM_ITEMS = 8  # symbols to copy
NUM_QUERIES = 4  # queried pairs in associative recall


@dataclass
class SyntheticTask:
    name: str
    distance: int
    num_symbols: int = 32

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {self.name!r}.")
        if self.distance < 2 * NUM_ITEMS:
            raise ValueError(f"distance: expected >= {2 * NUM_ITEMS}, got {self.distance}.")

    @property
    def vocab_size(self) -> int:
        return FIRST + self.num_symbols

    @property
    def seq_len(self) -> int:
        """Input length of one example (the targets are the inputs shifted by one)."""
        if self.name == "assoc_recall":
            return 2 * NUM_QUERIES + self.distance + 1 + 2 * NUM_QUERIES - 1
        if self.name == "copy":
            return NUM_ITEMS + self.distance + 1 + NUM_ITEMS - 1
        return self.distance + 1 + NUM_ITEMS - 1

    def sample(self, split: str, seed: int, step: int, rows: int, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(_mix(seed, step, 0 if split == "train" else 1, 7))
        seq = getattr(self, "_" + self.name)(rows, g)  # (rows, seq_len + 1)
        answer = torch.zeros_like(seq, dtype=torch.bool)
        answer[:, -self._num_answers * (2 if self.name == "assoc_recall" else 1):] = True
        if self.name == "assoc_recall":
            answer[:, -2 * NUM_QUERIES:] = False
            answer[:, -2 * NUM_QUERIES + 1::2] = True  # the values after each query key
        targets = torch.where(answer, seq, torch.full_like(seq, IGNORE_INDEX))
        return seq[:, :-1], targets[:, 1:]

    @property
    def _num_answers(self) -> int:
        return NUM_QUERIES if self.name == "assoc_recall" else NUM_ITEMS

    def _symbols(self, shape, g, low=0, high=None) -> Tensor:
        return FIRST + torch.randint(low, high or self.num_symbols, shape, generator=g)

    def _copy(self, rows, g):
        items = self._symbols((rows, NUM_ITEMS), g)
        blanks = torch.full((rows, self.distance), BLANK)
        return torch.cat([items, blanks, torch.full((rows, 1), DELIM), items], dim=1)

    def _selective_copy(self, rows, g):
        items = self._symbols((rows, NUM_ITEMS), g)
        # NUM_ITEMS distinct sorted positions among `distance`, per row
        pos = torch.rand(rows, self.distance, generator=g).argsort(dim=1)[:, :NUM_ITEMS].sort(dim=1).values
        body = torch.full((rows, self.distance), BLANK)
        body.scatter_(1, pos, items)
        return torch.cat([body, torch.full((rows, 1), DELIM), items], dim=1)

    def _assoc_recall(self, rows, g):
        # keys: first half of the symbols (queried keys drawn without replacement), values: second half
        half = self.num_symbols // 2
        perm = torch.rand(rows, half, generator=g).argsort(dim=1)
        qkeys = FIRST + perm[:, :NUM_QUERIES]  # (rows, NUM_QUERIES)
        other = FIRST + perm[:, NUM_QUERIES:]  # keys never queried
        qvals = self._symbols((rows, NUM_QUERIES), g, half)
        first = torch.stack([qkeys, qvals], dim=2).flatten(1)  # k1 v1 k2 v2 ...
        n_pairs = self.distance // 2
        pick = torch.randint(0, other.shape[1], (rows, n_pairs), generator=g)
        dkeys = other.gather(1, pick)
        dvals = self._symbols((rows, n_pairs), g, half)
        distract = torch.stack([dkeys, dvals], dim=2).flatten(1)
        if self.distance % 2:
            distract = torch.cat([distract, torch.full((rows, 1), BLANK)], dim=1)
        order = torch.rand(rows, NUM_QUERIES, generator=g).argsort(dim=1)
        queries = torch.stack([qkeys.gather(1, order), qvals.gather(1, order)], dim=2).flatten(1)
        return torch.cat([first, distract, torch.full((rows, 1), DELIM), queries], dim=1)


def make_task(spec: str) -> SyntheticTask:
    """``"task:NAME"`` or ``"task:NAME:DISTANCE"`` (default distance 64)."""
    parts = spec.split(":")
    if parts[0] != "task" or len(parts) not in (2, 3):
        raise ValueError(f"data: expected 'task:NAME[:DISTANCE]' with NAME in {TASKS}, got {spec!r}.")
    distance = int(parts[2]) if len(parts) == 3 else 64
    return SyntheticTask(parts[1], distance)
