"""The task: random relations, their composition, right-padded batches of several sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .config import TASKS


class CompositionData(NamedTuple):
    """Relations of several sizes, right-padded: token t < m^2 of example e is bit (t // m, t % m) of its m x m
    relation; positions t >= m^2 are padding (bit 0, label 0) and never count."""

    bits: torch.Tensor  # [n, max_m^2] long
    labels: torch.Tensor  # [n, max_m^2] float
    sizes: torch.Tensor  # [n] long: m of every example

    def to(self, device) -> CompositionData:
        return CompositionData(*(tensor.to(device) for tensor in self))

    def __len__(self) -> int:
        return len(self.sizes)

    def subset(self, index) -> CompositionData:
        """Examples `index`, trimmed to the largest m among them (padding to the batch maximum)."""
        sizes = self.sizes[index]
        length = int(sizes.max()) ** 2
        return CompositionData(self.bits[index, :length], self.labels[index, :length], sizes)


def compose_relation(relation: torch.Tensor, order: int) -> torch.Tensor:
    """Boolean `order`-fold composition R o ... o R of relations [..., m, m] (bool or 0/1)."""
    if order < 1:
        raise ValueError(f"`order` must be >= 1, got {order}.")
    relation = relation.float()
    composed = relation
    for _ in range(order - 1):
        composed = (composed @ relation > 0).float()
    return composed.bool()


def valid_positions(sizes: torch.Tensor, length: int) -> torch.Tensor:
    """[n, length] bool: True on the m^2 real tokens of every example."""
    return torch.arange(length, device=sizes.device)[None, :] < (sizes * sizes)[:, None]


def make_composition_data(
    task: str, m: int | Sequence[int], num_examples: int, seed: int, density: float | None = None
) -> CompositionData:
    """`num_examples` random relations with m fixed (an int) or drawn uniformly from [low, high] per example."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}: choose one of {sorted(TASKS)}.")
    low, high = (m, m) if isinstance(m, int) else m
    if not 2 <= low <= high:
        raise ValueError(f"`m` must be a size >= 2 or a range [low, high] with 2 <= low <= high, got {m}.")
    density = TASKS[task]["density"] if density is None else density
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(low, high + 1, (num_examples,), generator=generator)
    relation = torch.rand(num_examples, high, high, generator=generator) < density
    bits = torch.zeros(num_examples, high * high, dtype=torch.long)
    labels = torch.zeros(num_examples, high * high)
    for size in sizes.unique().tolist():
        examples = sizes == size
        block = relation[examples, :size, :size]  # example e uses the top-left m x m block of its draw
        bits[examples, : size * size] = block.reshape(-1, size * size).long()
        composed = compose_relation(block, TASKS[task]["order"])
        labels[examples, : size * size] = composed.reshape(-1, size * size).float()
    return CompositionData(bits, labels, sizes)
