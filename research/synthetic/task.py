"""The task: random relations, their composition, right-padded batches of several sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .config import DATA_STREAMS, TASKS


SPLITS = ("train", "val", "test")


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


def split_seeds(seed: int, task: str, task_index: int, data_streams: str) -> dict[str, int]:
    """The generator seed of each split (train, val, test) of one seed's data for `task` (the comparison's
    `task_index`-th task).

    "independent": the three children of numpy's `SeedSequence([seed, task id])`, whose streams cannot collide with
    those of another seed, task or split. "shifted": seed + 1000 * task_index, + 1, + 2 (how comparisons were drawn
    before; seed s + 1's validation set is seed s's test set).
    """
    if data_streams not in DATA_STREAMS:
        raise ValueError(f"`data_streams` must be one of {list(DATA_STREAMS)}, got {data_streams!r}.")
    if data_streams == "shifted":
        first = seed + 1000 * task_index
        return {split: first + offset for offset, split in enumerate(SPLITS)}
    # The task by its place among all tasks, not among the comparison's, so that a task's data do not depend on
    # which other tasks run beside it.
    children = np.random.SeedSequence([seed, sorted(TASKS).index(task)]).spawn(len(SPLITS))
    # torch's manual_seed takes 64 bits; one 63-bit draw of each child's stream stays a valid non-negative seed.
    return {split: int(child.generate_state(1, np.uint64)[0] >> np.uint64(1)) for split, child in zip(SPLITS, children)}


def relation_keys(data: CompositionData) -> list[bytes]:
    """Each example's relation as bytes (its m, then its m^2 bits): equal keys are the same relation."""
    sizes = data.sizes.tolist()
    bits = data.bits.to(torch.uint8).cpu().numpy()
    return [bytes([size]) + bits[index, : size * size].tobytes() for index, size in enumerate(sizes)]


def fraction_seen_in(data: CompositionData, reference: CompositionData) -> float:
    """The fraction of `data`'s relations that occur verbatim in `reference` (test relations present in the
    training set: small m at the paper's densities repeats relations by chance)."""
    seen = set(relation_keys(reference))
    keys = relation_keys(data)
    return sum(key in seen for key in keys) / max(len(keys), 1)
