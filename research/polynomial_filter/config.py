"""The polynomial-filter comparison's settings (`PolynomialConfig`, each a flag of `python -m research.polynomial_filter`), the
models it trains and the graph of each task."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .constructions import ATTENTION_KINDS, FILTER_ORDER


# name -> (heads, pseudo-heads)
MODELS = {
    "MHA H=2": (2, None),
    "MHA H=4": (4, None),
    "IHA H=2 P=2": (2, 2),
    "MHA H=3": (3, None),
    "MHA H=9": (9, None),
    "IHA H=3 P=3": (3, 3),
}
# The comparison of each filter order: MHA with ceil(sqrt(k)) heads, IHA with as many (P = H), MHA with k heads.
ORDER_MODELS = {4: ["MHA H=2", "MHA H=4", "IHA H=2 P=2"], 9: ["MHA H=3", "IHA H=3 P=3", "MHA H=9"]}
# The graphs of a task, per attention kind (`task_adjacency`).
GRAPHS = ("gaussian", "persistent")
# The persistent softmax graph: a directed cycle whose logits exceed the Gaussian noise's by this much (most of a
# row's weight on the next node, about 70% on average), so that its powers stay apart up to A^8 instead of all
# nearing the stationary distribution within a few steps.
PERSISTENT_CYCLE_LOGIT = 4.0


@dataclass
class PolynomialConfig:
    """The settings of the polynomial-filter experiment (each a flag of `python -m research.polynomial_filter`)."""

    order: int = field(
        default=FILTER_ORDER,
        metadata={"help": "filter order k: [X, AX, ..., A^(k-1) X]", "choices": list(ORDER_MODELS)},
    )
    num_tokens: int = field(default=6, metadata={"help": "tokens (graph nodes) per example; >= k for rank k"})
    feature_size: int = field(default=3, metadata={"help": "features per token"})
    # H N: room for a softmax IHA layer to set its H^2 patterns independently (2 N at k = 4, 3 N at k = 9).
    head_dim: int = field(default=12, metadata={"help": "head dimension"})
    models: list[str] | None = field(
        default=None,
        metadata={
            "help": "models to train (default: the order's three, MHA sqrt(k), IHA sqrt(k), MHA k heads)",
            "choices": list(MODELS),
        },
    )
    graphs: str = field(
        default="gaussian",
        metadata={
            "help": "gaussian: linear A Gaussian / spectral norm 1, softmax A = softmax(Gaussian) (high powers "
            "fade); persistent: linear A a random rotation, softmax a noisy directed cycle (every power counts)",
            "choices": list(GRAPHS),
        },
    )
    attentions: list[str] = field(
        default_factory=lambda: list(ATTENTION_KINDS),
        metadata={"help": "attention kinds", "choices": list(ATTENTION_KINDS)},
    )
    # Six seeds: the fewest with which the exact sign-flip test can reach p < 0.05 (its floor is 2 / 2^n).
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5], metadata={"help": "one run per seed"})
    steps: int = field(default=10_000, metadata={"help": "optimizer steps per run"})
    batch_size: int = field(default=64, metadata={"help": "examples per step"})
    learning_rate: float = field(default=1e-2, metadata={"help": "Adam learning rate"})
    eval_every: int = field(default=50, metadata={"help": "steps between evaluations"})
    num_eval: int = field(default=512, metadata={"help": "evaluation examples"})
    graph_seed: int = field(default=1234, metadata={"help": "seed of the graph (the task)"})

    def __post_init__(self):
        if self.order not in ORDER_MODELS:
            raise ValueError(f"Unknown order {self.order}: choose one of {list(ORDER_MODELS)}.")
        if self.models is None:
            self.models = list(ORDER_MODELS[self.order])
        unknown = [model for model in self.models if model not in MODELS]
        if unknown:
            raise ValueError(f"Unknown model(s) {unknown}: choose from {sorted(MODELS)}.")
        unknown = [kind for kind in self.attentions if kind not in ATTENTION_KINDS]
        if unknown:
            raise ValueError(f"Unknown attention(s) {unknown}: choose from {list(ATTENTION_KINDS)}.")
        if self.graphs not in GRAPHS:
            raise ValueError(f"Unknown graphs {self.graphs!r}: choose one of {list(GRAPHS)}.")
        if self.steps < 1 or self.eval_every < 1 or not self.seeds:
            raise ValueError("`steps` and `eval_every` must be >= 1 and `seeds` non-empty.")


def task_adjacency(num_tokens: int, attention: str, seed: int, graphs: str = "gaussian") -> torch.Tensor:
    """The fixed graph of a task. `gaussian`: linear attention a Gaussian matrix of spectral norm 1 (powers never
    grow; they shrink, A^8 to a few percent of I); softmax a random row-stochastic matrix with positive entries (what
    a softmax pattern can be; its powers near the stationary distribution within a few steps). `persistent`: linear
    a random rotation (every power the norm of I); softmax the row-stochastic softmax of a directed cycle's logits
    plus Gaussian noise, whose powers stay distinct to high order."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_tokens, num_tokens, generator=generator)
    if graphs == "gaussian":
        if attention == "linear":
            return weights / torch.linalg.matrix_norm(weights, ord=2)
        return torch.softmax(weights, dim=-1)
    if attention == "linear":
        rotation, triangle = torch.linalg.qr(weights)
        return rotation * torch.sign(torch.diagonal(triangle))  # signs fixed: a uniformly random rotation
    cycle = torch.roll(torch.eye(num_tokens), 1, dims=1)
    return torch.softmax(PERSISTENT_CYCLE_LOGIT * cycle + weights, dim=-1)


def config_adjacency(config: PolynomialConfig, attention: str) -> torch.Tensor:
    return task_adjacency(config.num_tokens, attention, config.graph_seed, config.graphs)


def is_iha(model: str) -> bool:
    return MODELS[model][1] is not None
