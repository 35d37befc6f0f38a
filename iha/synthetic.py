"""The paper's trained synthetic tasks: relation composition with one attention layer, MHA, 2-simplicial and IHA.

Task (paper, appendix): a random boolean relation R on {0..m-1} (each pair related with probability `density`) is
flattened row-major into m^2 tokens (token (i, j) is the bit R[i, j]). The label of position (i, j) is
(R o R)[i, j] = OR_k R[i, k] AND R[k, j] ("binary" composition) or (R o R o R)[i, j] ("ternary"). Solving position
(i, j) needs row i and column j (and, for ternary, the pairs in between), so attention is bidirectional. As in the
paper, m is drawn per example (binary m ~ U{6..10} at density 0.325, ternary m ~ U{5..8} at density 0.264; a fixed
m is an option), a batch is right-padded to its largest m^2 and padded keys are masked out of the attention; loss
and accuracy count the real positions only, and accuracy is also reported per m.

Model (identical for every attention; our choices where the paper is silent):

* embedding = bit embedding + learned row embedding (i) + learned column embedding (j): the model knows where each
  bit sits without any order bias (no RoPE, no causal mask);
* one pre-norm transformer block: x + Attention(LayerNorm(x)), then x + MLP(LayerNorm(x)) (GELU, 4x width);
* a final LayerNorm and a linear readout to one logit per position (binary cross-entropy).

The attention is plain bidirectional softmax attention with H heads over the m^2 tokens (MHA); 2-simplicial
attention (`iha.simplicial_attention`: trilinear scores over pairs of keys, two more projections); or IHA: the
MHA projections plus `iha.modeling_iha.IHAHeadMixing` (alpha_q/k/v [H, H, P], per-head collapse [H, P]), softmax
attention over the m^2 * P interleaved pseudo-tokens (the padding mask repeated over each token's P pseudo-tokens),
then the collapse back to H heads. IHA here is trained from scratch, so its mixing does not start at identity
(which would keep every pseudo-copy of a key identical forever under a mask-free attention): alphas are drawn like
fresh linear weights over heads, N(0, 1/H), and the collapse weights N(0, 1/P).

Training: AdamW (weight decay 0.01), per-epoch validation, early stopping on validation accuracy (patience 10 by
default), the best validation checkpoint is tested. Metrics: per-position accuracy (the paper's) and per-matrix
exact match, overall and per m. Runs on CUDA when there is one.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .atomic_files import save_figure_atomic, write_json_atomic, write_text_atomic
from .atomic_folders import run_command
from .modeling_iha import IHAHeadMixing
from .simplicial_attention import TwoSimplicialAttention


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------

# Paper, appendix: binary composition with m in 6..10 at density 0.325, ternary with m in 5..8 at density 0.264.
TASKS = {
    "binary": {"order": 2, "density": 0.325, "m": [6, 10]},
    "ternary": {"order": 3, "density": 0.264, "m": [5, 8]},
}


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


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


class BidirectionalAttention(nn.Module):
    """Mask-free softmax attention: multi-head (`num_pseudo_heads=None`) or Interleaved Head Attention.

    Only padding is masked: `key_padding_mask` [B, N] (True = real token) hides padded keys from every query; for
    IHA it is repeated over the P pseudo-tokens of each token (virtual index n * P + p belongs to token n).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_pseudo_heads: int | None = None):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"`hidden_size` ({hidden_size}) must be a multiple of `num_heads` ({num_heads}).")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.head_mixing = None
        if num_pseudo_heads is not None:
            self.head_mixing = IHAHeadMixing(num_heads, num_heads, num_pseudo_heads, collapse_mode="per_head")

    def reset_mixing_random(self, generator: torch.Generator) -> None:
        """Random mixing for training from scratch: alphas N(0, 1/H) (fan-in H), collapse N(0, 1/P)."""
        if self.head_mixing is None:
            return
        mixing = self.head_mixing
        with torch.no_grad():
            for name in ("alpha_q", "alpha_k", "alpha_v"):
                parameter = getattr(mixing, name)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(mixing.num_heads))
            mixing.collapse.copy_(
                torch.randn(mixing.collapse.shape, generator=generator) / math.sqrt(mixing.num_pseudo_heads)
            )

    def forward(self, hidden_states: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.head_mixing is not None:
            query = self.head_mixing.mix_queries(query)  # [B, H, N * P, d]
            key, value = self.head_mixing.mix_keys_values(key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.repeat_interleave(self.head_mixing.num_pseudo_heads, dim=1)
        attention_mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        output = output.transpose(1, 2)  # [B, N (* P), H, d]
        if self.head_mixing is not None:
            output = self.head_mixing.collapse_heads(output)  # [B, N, H, d]
        return self.o_proj(output.reshape(batch_size, seq_len, -1))


ATTENTIONS = ("mha", "iha", "simplicial")


class CompositionModel(nn.Module):
    """One bidirectional transformer block over the m^2 relation bits (m up to `max_m`), one logit per position."""

    def __init__(
        self,
        max_m: int,
        hidden_size: int,
        num_heads: int,
        attention: str = "mha",
        num_pseudo_heads: int | None = None,
    ):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"Unknown attention {attention!r}: choose one of {ATTENTIONS}.")
        if (attention == "iha") != (num_pseudo_heads is not None):
            raise ValueError("`num_pseudo_heads` is given for IHA and only for IHA.")
        self.max_m = max_m
        self.bit_embedding = nn.Embedding(2, hidden_size)
        self.row_embedding = nn.Embedding(max_m, hidden_size)
        self.column_embedding = nn.Embedding(max_m, hidden_size)
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size)
        )
        self.final_norm = nn.LayerNorm(hidden_size)
        self.readout = nn.Linear(hidden_size, 1)
        # Built last, so that every model of one seed draws the same embeddings, MLP and readout (and MHA, IHA and
        # 2-simplicial the same q/k/v/o projections).
        if attention == "simplicial":
            self.attention = TwoSimplicialAttention(hidden_size, num_heads)
        else:
            self.attention = BidirectionalAttention(hidden_size, num_heads, num_pseudo_heads)

    def forward(self, bits: torch.Tensor, sizes: torch.Tensor | None = None) -> torch.Tensor:
        """bits [B, L] (row-major, right-padded), sizes [B] (m of every example; default: all sqrt(L))."""
        batch_size, length = bits.shape
        if sizes is None:
            side = math.isqrt(length)
            if side * side != length:
                raise ValueError(f"{length} tokens are no m x m relation: pass `sizes` for padded batches.")
            sizes = torch.full((batch_size,), side, device=bits.device)
        if int(sizes.max()) > self.max_m or int(sizes.max()) ** 2 > length:
            raise ValueError(
                f"Relations up to m = {int(sizes.max())} need {int(sizes.max()) ** 2} tokens and a model with "
                f"max_m >= m; got {length} tokens and max_m = {self.max_m}."
            )
        positions = torch.arange(length, device=bits.device)[None, :]
        is_real = valid_positions(sizes, length)
        rows = torch.where(is_real, positions // sizes[:, None], 0)  # token t = i * m + j sits at row i, column j
        columns = torch.where(is_real, positions % sizes[:, None], 0)
        hidden = self.bit_embedding(bits) + self.row_embedding(rows) + self.column_embedding(columns)
        key_padding_mask = None if bool(is_real.all()) else is_real
        hidden = hidden + self.attention(self.attention_norm(hidden), key_padding_mask)
        hidden = hidden + self.mlp(self.mlp_norm(hidden))
        return self.readout(self.final_norm(hidden)).squeeze(-1)


def build_model(
    max_m: int,
    hidden_size: int,
    num_heads: int,
    num_pseudo_heads: int | None,
    seed: int,
    attention: str | None = None,
) -> CompositionModel:
    """The same seed gives every attention the same embeddings, projections, MLP and readout at initialisation.

    `attention` defaults to IHA when `num_pseudo_heads` is given, MHA otherwise.
    """
    attention = attention or ("mha" if num_pseudo_heads is None else "iha")
    torch.manual_seed(seed)
    model = CompositionModel(max_m, hidden_size, num_heads, attention, num_pseudo_heads)
    if attention != "simplicial":
        model.attention.reset_mixing_random(torch.Generator().manual_seed(seed + 1))
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SyntheticConfig:
    tasks: list[str] = field(default_factory=lambda: ["binary", "ternary"])
    # Matrix size per task, [low, high]: m drawn uniformly per example (low == high: every example the same m).
    m: dict[str, list[int]] = field(default_factory=lambda: {task: list(TASKS[task]["m"]) for task in TASKS})
    num_train: int = 40_000
    num_val: int = 5_000
    num_test: int = 5_000
    hidden_size: int = 128
    num_heads: int = 8
    pseudo_heads: list[int] = field(default_factory=lambda: [2, 8])  # IHA variants; MHA always runs
    simplicial: bool = True  # also the 2-simplicial attention baseline
    learning_rates: list[float] = field(default_factory=lambda: [1e-3, 1e-4])
    batch_size: int = 128
    max_epochs: int = 200
    patience: int = 10
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self):
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown:
            raise ValueError(f"Unknown task(s) {unknown}: choose from {sorted(TASKS)}.")
        missing = [task for task in self.tasks if task not in self.m]
        if missing:
            raise ValueError(f"No matrix size `m` given for task(s) {missing}.")
        # A single size (results written before ranges existed) is the range [m, m].
        self.m = {task: [size, size] if isinstance(size, int) else list(size) for task, size in self.m.items()}
        for task, (low, high) in self.m.items():
            if not 2 <= low <= high:
                raise ValueError(f"`m` of {task} must be a range [low, high] with 2 <= low <= high, got {[low, high]}.")
        if any(p < 1 for p in self.pseudo_heads):
            raise ValueError(f"Every pseudo-head count must be >= 1, got {self.pseudo_heads}.")
        for name in ("num_train", "num_val", "num_test", "batch_size", "max_epochs", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")


def describe_m(low_high: list[int] | int) -> str:
    low, high = (low_high, low_high) if isinstance(low_high, int) else low_high
    return str(low) if low == high else f"{low}..{high}"


# The paper's scale as far as the paper states it: m per example from its ranges, width 128, H = 8, IHA with
# P = 8 (and P = 2), 40k/5k/5k examples, lr 1e-3 and 1e-4, early stopping with patience 10. Our choices where it is
# silent: batch 128, AdamW with weight decay 0.01, at most 200 epochs (the length Kozachinskiy et al. 2025 train
# binary composition for), seeds 0, 1, 2. Sized for a GPU (the device is picked automatically): on 2 CPU cores one
# epoch of IHA P = 8 or 2-simplicial at m = 10 takes tens of minutes.
PAPER = SyntheticConfig()
# The full comparison of PAPER (MHA, 2-simplicial, IHA P = 2 and 8; both tasks with the paper's m ranges; H = 8;
# seeds 0, 1, 2; patience 10) shrunk for 2 shared CPU cores. IHA P = 8 (8 m^2 pseudo-tokens) and 2-simplicial (m^4
# pairs of keys per query) take almost all of the time: measured per training example at m up to 10 (width 32,
# forward and backward), MHA and IHA P = 2 cost 1-20 ms, IHA P = 8 20-25 ms on a quiet machine and ~200 ms with the
# 2 cores shared by other jobs (load ~10), 2-simplicial ~35 and ~400 ms. What had to give, in order: lr 1e-3 only
# (the rate validation picked for every model in the fixed-m runs; lr 1e-4 needs many more epochs), width 32 (head
# dim 4), 320 / 160 / 1,000 examples with batch 32 (10 steps an epoch), at most 60 epochs. Estimate on a quiet
# machine: ~30 minutes per seed if every run uses its 60 epochs, most of it the two costly models; on shared cores
# several times that. Several seeds train every seed's MHA and IHA P = 2 first (about 15 minutes per seed even with
# busy cores), then the costly models, ternary before binary. With busy cores pass `--threads 1`: small ops ran 3-5x
# faster on one thread than on two, the costly ones as fast. The data is small, so the results measure learning
# from few examples rather than the paper's 40k, and the 60-epoch budget, not patience, ends most runs (MHA on
# binary is still rising slowly at epoch 60).
CPU = replace(
    PAPER,
    num_train=320,
    num_val=160,
    num_test=1_000,
    hidden_size=32,
    learning_rates=[1e-3],
    batch_size=8,
    max_epochs=150,
)
# The setting before the paper's ranges: every example at the small end (binary m = 6, ternary m = 5), MHA and
# IHA only, width 32, at most 6 epochs with patience 2 (about 22 minutes on 2 cores).
FIXED = replace(
    PAPER,
    m={"binary": [6, 6], "ternary": [5, 5]},
    hidden_size=32,
    pseudo_heads=[8, 2],
    simplicial=False,
    max_epochs=6,
    patience=2,
)
# Seconds, for the tests.
TINY = SyntheticConfig(
    m={"binary": [3, 4], "ternary": [3, 4]},
    num_train=256,
    num_val=64,
    num_test=64,
    hidden_size=16,
    num_heads=4,
    pseudo_heads=[2],
    simplicial=True,
    learning_rates=[1e-2],
    batch_size=64,
    max_epochs=3,
    patience=2,
)
PRESETS = {"paper": PAPER, "cpu": CPU, "fixed": FIXED, "tiny": TINY}
# Seeds a preset runs when neither --seed nor --seeds is given.
PRESET_SEEDS = {"paper": [0, 1, 2], "cpu": [0, 1, 2], "fixed": [0], "tiny": [0]}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def evaluate(model: nn.Module, data: CompositionData, batch_size: int = 256) -> dict:
    """Accuracy over real positions (the paper's), per-matrix exact match, mean BCE loss; overall and per m.

    Examples are evaluated in order of m, so that a batch holds few sizes and little padding (the mask makes the
    result independent of how the examples are batched).
    """
    model.eval()
    order = torch.argsort(data.sizes.cpu(), stable=True).to(data.sizes.device)
    correct = torch.zeros(len(data), device=data.sizes.device)
    loss = torch.zeros((), device=data.sizes.device)
    exact = torch.zeros(len(data), dtype=torch.bool, device=data.sizes.device)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = data.subset(index)
        logits = model(batch.bits, batch.sizes)
        is_real = valid_positions(batch.sizes, batch.bits.shape[1])
        right = ((logits > 0).float() == batch.labels) & is_real
        correct[index] = right.float().sum(dim=-1)
        exact[index] = (right | ~is_real).all(dim=-1)
        losses = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        loss += losses[is_real].sum()
    positions = (data.sizes * data.sizes).float()
    metrics = {
        "accuracy": (correct.sum() / positions.sum()).item(),
        "exact_match": exact.float().mean().item(),
        "loss": (loss / positions.sum()).item(),
        "accuracy_by_m": {},
        "exact_match_by_m": {},
    }
    for size in data.sizes.unique().tolist():
        examples = data.sizes == size
        metrics["accuracy_by_m"][str(size)] = (correct[examples].sum() / positions[examples].sum()).item()
        metrics["exact_match_by_m"][str(size)] = exact[examples].float().mean().item()
    return metrics


def masked_loss(logits: torch.Tensor, batch: CompositionData) -> torch.Tensor:
    """Mean binary cross-entropy over the real positions of a right-padded batch (padding never counts)."""
    is_real = valid_positions(batch.sizes, batch.bits.shape[1])
    return F.binary_cross_entropy_with_logits(logits[is_real], batch.labels[is_real])


def train_one(
    model: nn.Module,
    data: dict[str, CompositionData],
    learning_rate: float,
    config: SyntheticConfig,
    description: str = "",
) -> dict:
    """Train with early stopping on validation accuracy; returns history and the test metrics of the best epoch."""
    train_data = data["train"]
    device = train_data.sizes.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    best_accuracy, best_epoch, best_state, history = -1.0, 0, None, []
    epochs_without_gain = 0
    start_time = time.perf_counter()
    # A context manager, so that an interruption closes the bar before the command prints its last line.
    with tqdm(range(1, config.max_epochs + 1), desc=description, unit="epoch", leave=False) as progress:
        for epoch in progress:
            model.train()
            order = torch.randperm(len(train_data), generator=generator).to(device)
            total_loss = 0.0
            for start in range(0, len(order), config.batch_size):
                batch = train_data.subset(order[start : start + config.batch_size])  # padded to this batch's largest m
                loss = masked_loss(model(batch.bits, batch.sizes), batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(batch)
            validation = evaluate(model, data["val"], config.batch_size)
            history.append(
                {"epoch": epoch, "train_loss": total_loss / len(order), "val_accuracy": validation["accuracy"]}
            )
            progress.set_postfix(loss=f"{total_loss / len(order):.4f}", val_acc=f"{validation['accuracy']:.4f}")
            if validation["accuracy"] > best_accuracy:
                best_accuracy, best_epoch, epochs_without_gain = validation["accuracy"], epoch, 0
                best_state = copy.deepcopy(model.state_dict())
            else:
                epochs_without_gain += 1
                if epochs_without_gain >= config.patience:
                    break
    model.load_state_dict(best_state)
    test = evaluate(model, data["test"], config.batch_size)
    return {
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "stopped_by": "patience" if epochs_without_gain >= config.patience else "epoch budget",
        "val_accuracy": best_accuracy,
        "test_accuracy": test["accuracy"],
        "test_exact_match": test["exact_match"],
        "test_loss": test["loss"],
        "test_accuracy_by_m": test["accuracy_by_m"],
        "test_exact_match_by_m": test["exact_match_by_m"],
        "train_seconds": time.perf_counter() - start_time,
        "history": history,
    }


def model_variants(config: SyntheticConfig) -> list[tuple[str, str, int | None]]:
    """(name, attention, P) of every model the comparison trains."""
    variants = [("MHA", "mha", None)]
    if config.simplicial:
        variants.append(("2-simplicial", "simplicial", None))
    return variants + [(f"IHA P={p}", "iha", p) for p in config.pseudo_heads]


def _config_as_saved(config: SyntheticConfig) -> dict:
    """The config as it reads back from a results file (JSON turns tuples into lists, int keys into strings), so
    that a saved comparison can be matched against the one asked for."""
    return json.loads(json.dumps(asdict(config)))


def _load_checkpoint(path: Path | None, config: SyntheticConfig) -> list[dict]:
    """Finished runs from an earlier, interrupted call with the same config (none if there is no checkpoint)."""
    if path is None or not path.is_file():
        return []
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved.get("config") != _config_as_saved(config):
        raise ValueError(
            f"{path} holds runs of a different configuration. Delete it (or pass --fresh) to start over, or use "
            "another output folder."
        )
    return saved["runs"]


def majority_baseline(data: CompositionData) -> dict:
    """Accuracy of always predicting the more frequent label, over all real positions and per m."""
    is_real = valid_positions(data.sizes, data.bits.shape[1])
    positive_rate = data.labels[is_real].mean().item()
    by_m = {}
    for size in data.sizes.unique().tolist():
        rate = data.labels[data.sizes == size, : size * size].mean().item()
        by_m[str(size)] = max(rate, 1 - rate)
    return {
        "test_positive_rate": positive_rate,
        "majority_accuracy": max(positive_rate, 1 - positive_rate),
        "majority_accuracy_by_m": by_m,
    }


def run_comparison(
    config: SyntheticConfig,
    progress: bool = True,
    checkpoint: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    only: Collection[tuple[str, str]] | None = None,
) -> dict:
    """Every task x model x learning rate; returns a JSON-ready dict (config, baselines, runs).

    With `checkpoint`, every finished run is saved there at once, and a later call with the same config skips the
    runs it finds: an interrupted comparison resumes where it stopped (each run is deterministic in the seed).
    `device` defaults to CUDA when there is one. `only` ((task, model) pairs) trains just those runs now, keeping
    the checkpoint's other runs, so that a caller can order the work across seeds (cheap models first).
    """
    device = torch.device(device) if device is not None else default_device()
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    finished = {(run["task"], run["model"], run["learning_rate"]): run for run in _load_checkpoint(checkpoint, config)}
    runs = []
    baselines = {}
    variants = model_variants(config)
    total = len(config.tasks) * len(variants) * len(config.learning_rates)
    with tqdm(total=total, desc="synthetic runs", unit="run", disable=not progress) as overall:
        for task_index, task in enumerate(config.tasks):
            m = config.m[task]
            seed = config.seed + 1000 * task_index
            data = {
                "train": make_composition_data(task, m, config.num_train, seed),
                "val": make_composition_data(task, m, config.num_val, seed + 1),
                "test": make_composition_data(task, m, config.num_test, seed + 2),
            }
            baselines[task] = {"m": m, **majority_baseline(data["test"])}
            data = {split: split_data.to(device) for split, split_data in data.items()}
            for name, attention, num_pseudo_heads in variants:
                if only is not None and (task, name) not in only:
                    overall.update(len(config.learning_rates))
                    continue
                for learning_rate in config.learning_rates:
                    description = f"{task} m={describe_m(m)} {name} lr={learning_rate:g}"
                    if (task, name, learning_rate) in finished:
                        runs.append(finished[(task, name, learning_rate)])
                        overall.update(1)
                        overall.set_postfix_str(f"{description}: done before")
                        continue
                    model = build_model(
                        m[1], config.hidden_size, config.num_heads, num_pseudo_heads, config.seed, attention
                    ).to(device)
                    result = train_one(model, data, learning_rate, config, description)
                    runs.append(
                        {
                            "task": task,
                            "m": m,
                            "model": name,
                            "attention": attention,
                            "num_pseudo_heads": num_pseudo_heads,
                            "learning_rate": learning_rate,
                            "parameters": count_parameters(model),
                            **result,
                        }
                    )
                    if checkpoint is not None:
                        done = {(run["task"], run["model"], run["learning_rate"]) for run in runs}
                        kept = [run for key, run in finished.items() if key not in done]  # runs outside `only`
                        write_json_atomic({"config": asdict(config), "runs": runs + kept}, checkpoint)
                    overall.update(1)
                    overall.set_postfix_str(f"{description}: test acc {result['test_accuracy']:.4f}")
    return {
        "config": asdict(config),
        "baselines": baselines,
        "runs": runs,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------


def best_runs(results: dict) -> dict[tuple[str, str], dict]:
    """Per (task, model): the learning rate with the best validation accuracy (ties: the first listed)."""
    best = {}
    for run in results["runs"]:
        key = (run["task"], run["model"])
        if key not in best or run["val_accuracy"] > best[key]["val_accuracy"]:
            best[key] = run
    return best


def _saved_config(config: dict) -> SyntheticConfig:
    """A results file's config; those written before the 2-simplicial baseline existed ran without it."""
    return SyntheticConfig(**{"simplicial": False, **config})


def _model_names(config: dict) -> list[str]:
    return [name for name, _, _ in model_variants(_saved_config(config))]


def _sizes(config: dict, task: str) -> list[int]:
    low, high = _saved_config(config).m[task]
    return list(range(low, high + 1))


def _stopping_line(runs: list[dict]) -> str:
    recorded = [run for run in runs if "stopped_by" in run]  # results written before it was recorded lack it
    if not recorded:
        return "How the runs stopped was not recorded."
    by_patience = sum(run["stopped_by"] == "patience" for run in recorded)
    return (
        f"{by_patience} of {len(recorded)} runs stopped by patience, {len(recorded) - by_patience} by the epoch budget."
    )


def results_table(results: dict) -> str:
    """Markdown: per task and model, test accuracy at each learning rate, the validation-selected one, params;
    then the validation-selected runs' accuracy per m, and how the runs stopped."""
    config = results["config"]
    learning_rates = config["learning_rates"]
    best = best_runs(results)
    models = _model_names(config)
    header = ["Task", "m", "Model", "Parameters"]
    header += [f"test acc, lr {lr:g}" for lr in learning_rates]
    header += ["test acc (val-selected lr)", "exact match (val-selected)", "epochs (best / run)"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|---:|" + "---:|" * (len(header) - 4)]
    for task in config["tasks"]:
        baseline = results["baselines"][task]
        for model in models:
            runs = {
                run["learning_rate"]: run for run in results["runs"] if run["task"] == task and run["model"] == model
            }
            chosen = best[(task, model)]
            row = [task, describe_m(baseline["m"]), model, f"{chosen['parameters']:,}"]
            row += [f"{100 * runs[lr]['test_accuracy']:.2f}" for lr in learning_rates]
            row += [
                f"**{100 * chosen['test_accuracy']:.2f}**",
                f"{100 * chosen['test_exact_match']:.2f}",
                f"{chosen['best_epoch']} / {chosen['epochs_run']}",
            ]
            lines.append("| " + " | ".join(row) + " |")
        majority = f"{100 * baseline['majority_accuracy']:.2f}"
        row = [task, describe_m(baseline["m"]), "constant (majority label)", "0"]
        row += [majority] * len(learning_rates) + [majority, "–", "–"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Test accuracy per m (validation-selected learning rate):", ""]
    for task in config["tasks"]:
        sizes = _sizes(config, task)
        lines.append("| " + " | ".join([f"{task}: model", *[f"m = {size}" for size in sizes]]) + " |")
        lines.append("|---|" + "---:|" * len(sizes))
        for model in models:
            by_m = best[(task, model)].get("test_accuracy_by_m", {})
            cells = [f"{100 * by_m[str(size)]:.2f}" if str(size) in by_m else "–" for size in sizes]
            lines.append("| " + " | ".join([model, *cells]) + " |")
        by_m = results["baselines"][task].get("majority_accuracy_by_m", {})
        cells = [f"{100 * by_m[str(size)]:.2f}" if str(size) in by_m else "–" for size in sizes]
        lines.append("| " + " | ".join(["majority label", *cells]) + " |")
        lines.append("")
    lines.append(_stopping_line(results["runs"]))
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def seed_summary(results_per_seed: list[dict]) -> tuple[str, dict]:
    """Test accuracy over several seeds: mean ± std per task, model and learning rate, for the validation-selected
    learning rate (with every seed's value and the gap to each baseline), and per m; a markdown table and its numbers.

    Every element of `results_per_seed` is the output of one `run_comparison` (same tasks and models, another seed).
    """
    if not results_per_seed:
        raise ValueError("No results to summarise.")
    seeds = [results["config"]["seed"] for results in results_per_seed]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Each result must come from a different seed; got seeds {seeds}.")
    first = results_per_seed[0]["config"]
    models = _model_names(first)
    learning_rates = first["learning_rates"]
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    selected = [best_runs(results) for results in results_per_seed]
    summary = {}
    header = ["Task", "m", "Model", *[f"lr {lr:g}" for lr in learning_rates], "val-selected lr"]
    header += [f"seed {seed}" for seed in seeds] + [f"− {name}" for name in baselines]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|" + "---:|" * (len(header) - 3)]
    for task in first["tasks"]:
        for model in models:
            per_rate = {}
            for lr in learning_rates:
                values = []
                for results in results_per_seed:
                    matching = [
                        run["test_accuracy"]
                        for run in results["runs"]
                        if run["task"] == task and run["model"] == model and run["learning_rate"] == lr
                    ]
                    values += [100 * accuracy for accuracy in matching[:1]]
                if values:  # a seed may have run fewer learning rates (then the table says over how many seeds)
                    per_rate[f"{lr:g}"] = dict(zip(("mean", "std"), _mean_std(values)), test_accuracy=values)
            # Seeds that have this model (all, unless some results are a partial checkpoint of a running call).
            having = [(seed, runs[(task, model)]) for seed, runs in zip(seeds, selected) if (task, model) in runs]
            if not having:
                continue
            values = [100 * run["test_accuracy"] for _, run in having]
            mean, std = _mean_std(values)
            by_m = {}
            for size in _sizes(first, task):
                per_seed = [run.get("test_accuracy_by_m", {}).get(str(size)) for _, run in having]
                if None not in per_seed:
                    by_m[str(size)] = dict(zip(("mean", "std"), _mean_std([100 * value for value in per_seed])))
            summary[f"{task}/{model}"] = {
                "task": task,
                "m": first["m"][task],
                "model": model,
                "test_accuracy": values,
                "mean": mean,
                "std": std,
                "seeds": [seed for seed, _ in having],
                "learning_rates": [run["learning_rate"] for _, run in having],
                "by_learning_rate": per_rate,
                "by_m": by_m,
                "stopped_by_patience": sum(
                    run.get("stopped_by") == "patience"
                    for results in results_per_seed
                    for run in results["runs"]
                    if run["task"] == task and run["model"] == model
                ),
                "runs": sum(
                    run["task"] == task and run["model"] == model
                    for results in results_per_seed
                    for run in results["runs"]
                ),
            }
            row = [task, describe_m(first["m"][task]), model]
            for lr in learning_rates:
                rate = per_rate.get(f"{lr:g}")
                cell = "–" if rate is None else f"{rate['mean']:.2f} ± {rate['std']:.2f}"
                if rate is not None and len(rate["test_accuracy"]) < len(seeds):
                    cell += f" ({len(rate['test_accuracy'])} of {len(seeds)} seeds)"
                row.append(cell)
            selected_cell = f"**{mean:.2f} ± {std:.2f}**"
            if len(having) < len(seeds):
                selected_cell += f" ({len(having)} of {len(seeds)} seeds)"
            by_seed = {seed: 100 * run["test_accuracy"] for seed, run in having}
            row += [selected_cell, *[f"{by_seed[seed]:.2f}" if seed in by_seed else "–" for seed in seeds]]
            for name in baselines:
                reference = summary.get(f"{task}/{name}")
                row.append("–" if name == model or reference is None else f"{mean - reference['mean']:+.2f}")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Test accuracy per m, mean ± std over seeds (validation-selected learning rate):", ""]
    for task in first["tasks"]:
        sizes = _sizes(first, task)
        lines.append("| " + " | ".join([f"{task}: model", *[f"m = {size}" for size in sizes]]) + " |")
        lines.append("|---|" + "---:|" * len(sizes))
        for model in models:
            if f"{task}/{model}" not in summary:
                continue
            by_m = summary[f"{task}/{model}"]["by_m"]
            cells = [
                f"{by_m[str(size)]['mean']:.2f} ± {by_m[str(size)]['std']:.2f}" if str(size) in by_m else "–"
                for size in sizes
            ]
            lines.append("| " + " | ".join([model, *cells]) + " |")
        lines.append("")
    lines.append(_stopping_line([run for results in results_per_seed for run in results["runs"]]))
    return "\n".join(lines), summary


def plot_results(results: dict, path: str | os.PathLike) -> Path:
    """Per task (one column): test accuracy per model (validation-selected learning rate), validation curves, and
    test accuracy against m."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = results["config"]
    tasks = config["tasks"]
    models = _model_names(config)
    best = best_runs(results)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = plt.subplots(3, len(tasks), figsize=(5.5 * len(tasks), 12), squeeze=False)
    for column, task in enumerate(tasks):
        baseline = results["baselines"][task]
        accuracies = [100 * best[(task, model)]["test_accuracy"] for model in models]
        bar_axis = axes[0][column]
        bars = bar_axis.bar(models, accuracies, color=colors[: len(models)])
        for bar, accuracy, model in zip(bars, accuracies, models):
            label = f"{accuracy:.2f}\nlr {best[(task, model)]['learning_rate']:g}"
            bar_axis.text(
                bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=8
            )
        bar_axis.axhline(100 * baseline["majority_accuracy"], color="gray", linestyle="--", label="majority label")
        low = min(accuracies + [100 * baseline["majority_accuracy"]])
        bar_axis.set_ylim(max(0, low - 5), max(accuracies) + 8)  # room for the labels above the bars
        bar_axis.set_title(f"{task} composition, m = {describe_m(baseline['m'])}: test accuracy")
        bar_axis.set_ylabel("per-position accuracy (%)")
        bar_axis.tick_params(axis="x", labelsize=8)
        bar_axis.legend(loc="lower right", fontsize=8)
        curve_axis = axes[1][column]
        for index, model in enumerate(models):
            for run in results["runs"]:
                if run["task"] != task or run["model"] != model:
                    continue
                epochs = [point["epoch"] for point in run["history"]]
                values = [100 * point["val_accuracy"] for point in run["history"]]
                style = "-" if run["learning_rate"] == max(config["learning_rates"]) else ":"
                curve_axis.plot(
                    epochs, values, style, color=colors[index], label=f"{model}, lr {run['learning_rate']:g}"
                )
        curve_axis.set_xlabel("epoch")
        curve_axis.set_ylabel("validation accuracy (%)")
        curve_axis.set_title(f"{task}: validation accuracy per epoch")
        curve_axis.legend(fontsize=7)
        size_axis = axes[2][column]
        sizes = _sizes(config, task)
        for index, model in enumerate(models):
            by_m = best[(task, model)].get("test_accuracy_by_m", {})
            shown = [size for size in sizes if str(size) in by_m]
            size_axis.plot(shown, [100 * by_m[str(size)] for size in shown], "o-", color=colors[index], label=model)
        majority = baseline.get("majority_accuracy_by_m", {})
        shown = [size for size in sizes if str(size) in majority]
        size_axis.plot(shown, [100 * majority[str(s)] for s in shown], "--", color="gray", label="majority label")
        size_axis.set_xticks(sizes)
        size_axis.set_xlabel("m (relation size)")
        size_axis.set_ylabel("test accuracy (%)")
        size_axis.set_title(f"{task}: test accuracy against m")
        size_axis.legend(fontsize=7)
    figure.tight_layout()
    try:
        return save_figure_atomic(figure, path, dpi=110)
    finally:
        plt.close(figure)


def plot_seed_summary(summary: dict, path: str | os.PathLike) -> Path:
    """Per task (one column): mean test accuracy per model over seeds (bars, +-1 std, every seed a dot), and mean
    test accuracy against m (+-1 std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(entry["task"] for entry in summary.values()))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8.4), squeeze=False)
    for column, task in enumerate(tasks):
        axis = axes[0][column]
        entries = [entry for entry in summary.values() if entry["task"] == task]
        positions = range(len(entries))
        means = [entry["mean"] for entry in entries]
        axis.bar(
            positions,
            means,
            yerr=[entry["std"] for entry in entries],
            capsize=4,
            color=colors[: len(entries)],
            alpha=0.75,
        )
        # Labels sit above both the error bar and the highest seed, so that neither hides them.
        tops = [max(entry["mean"] + entry["std"], *entry["test_accuracy"]) for entry in entries]
        bottoms = [min(entry["mean"] - entry["std"], *entry["test_accuracy"]) for entry in entries]
        span = max(max(tops) - min(bottoms), 1.0)
        for position, entry, top in zip(positions, entries, tops):
            values = entry["test_accuracy"]
            axis.scatter([position] * len(values), values, color="black", s=12, zorder=3)
            label = f"{entry['mean']:.2f} ± {entry['std']:.2f}"
            axis.text(position, top + 0.03 * span, label, ha="center", va="bottom", fontsize=8)
        axis.set_ylim(min(bottoms) - 0.3 * span, max(tops) + 0.15 * span)
        axis.set_xticks(list(positions), [entry["model"] for entry in entries], fontsize=8)
        seeds = ", ".join(str(seed) for seed in entries[0]["seeds"])
        m = describe_m(entries[0]["m"])
        axis.set_title(f"{task} composition, m = {m}: test accuracy, seeds {seeds}", fontsize=10)
        axis.set_ylabel("per-position accuracy (%)")
        axis.grid(axis="y", alpha=0.3)
        size_axis = axes[1][column]
        for index, entry in enumerate(entries):
            sizes = sorted(int(size) for size in entry.get("by_m", {}))
            if not sizes:
                continue
            size_axis.errorbar(
                sizes,
                [entry["by_m"][str(size)]["mean"] for size in sizes],
                yerr=[entry["by_m"][str(size)]["std"] for size in sizes],
                fmt="o-",
                capsize=3,
                color=colors[index],
                label=entry["model"],
            )
            size_axis.set_xticks(sizes)
        size_axis.set_xlabel("m (relation size)")
        size_axis.set_ylabel("test accuracy (%), mean ± std over seeds")
        size_axis.set_title(f"{task}: test accuracy against m", fontsize=10)
        size_axis.legend(fontsize=7)
        size_axis.grid(alpha=0.3)
    figure.tight_layout()
    try:
        return save_figure_atomic(figure, path, dpi=110)
    finally:
        plt.close(figure)


def write_seed_summary(results_per_seed: list[dict], output_dir: str | os.PathLike) -> dict[str, Path]:
    """seeds.md (the table), seeds.json and seeds.png in `output_dir`."""
    output_dir = Path(output_dir)
    table, summary = seed_summary(results_per_seed)
    paths = {"table": output_dir / "seeds.md", "json": output_dir / "seeds.json", "plot": output_dir / "seeds.png"}
    write_text_atomic(table + "\n", paths["table"])
    write_json_atomic(summary, paths["json"])
    plot_seed_summary(summary, paths["plot"])
    return paths


def write_outputs(results: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """results.json, results.md (the table) and accuracy.png in `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, table_path, plot_path = (
        output_dir / "results.json",
        output_dir / "results.md",
        output_dir / "accuracy.png",
    )
    write_json_atomic(results, json_path)
    write_text_atomic(results_table(results) + "\n", table_path)
    plot_results(results, plot_path)
    return {"json": json_path, "table": table_path, "plot": plot_path}


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def _parse_m(values: list[str] | None) -> dict[str, list[int]] | None:
    """TASK=SIZE (every example that m) or TASK=LOW-HIGH (m drawn per example) -> {task: [low, high]}."""
    if not values:
        return None
    sizes = {}
    for value in values:
        task, separator, size = value.partition("=")
        low, dash, high = size.partition("-")
        high = high if dash else low
        if not separator or not low.isdigit() or not high.isdigit():
            raise SystemExit(f"--m takes TASK=SIZE or TASK=LOW-HIGH (e.g. binary=6 or binary=6-10), got {value!r}")
        sizes[task] = [int(low), int(high)]
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="iha synthetic",
        description="Relation composition (paper appendix): MHA, 2-simplicial attention and IHA, one bidirectional "
        "attention layer trained from scratch.",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="cpu: the full comparison shrunk for 2 CPU cores (~30 min a seed on a quiet machine; default); paper: the paper's scale "
        "(for a GPU); fixed: every example at m = 6 / 5, MHA and IHA only; tiny: seconds",
    )
    parser.add_argument(
        "--output-dir", default="runs/synthetic", help="writes results.json/.md and accuracy.png (default: %(default)s)"
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None)
    parser.add_argument(
        "--m",
        nargs="+",
        default=None,
        metavar="TASK=SIZE",
        help="matrix size per task: binary=6 (every example) or binary=6-10 (drawn per example)",
    )
    parser.add_argument("--num-train", type=int, default=None)
    parser.add_argument("--num-val", type=int, default=None)
    parser.add_argument("--num-test", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--pseudo-heads", type=int, nargs="+", default=None, help="IHA variants (P values)")
    parser.add_argument(
        "--simplicial",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train the 2-simplicial attention baseline too (default: the preset's)",
    )
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--patience", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="one comparison with this seed")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="one comparison per seed (in OUTPUT_DIR/seed-N), then seeds.md/.json/.png: mean and spread over seeds "
        "(default: the preset's seeds, 0 1 2 for cpu and paper)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda when there is one, else cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--summarize",
        nargs="+",
        default=None,
        metavar="RESULTS_JSON",
        help="no training: write seeds.md/.json/.png (mean and spread over the seeds of these results.json files)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="run everything again: ignore (and replace) the finished runs of an earlier call in OUTPUT_DIR "
        "(results.partial.json of an interrupted call, results.json of a finished one)",
    )
    args = parser.parse_args(argv)
    return run_command(
        "iha synthetic",
        lambda: _run(args),
        errors=(ValueError,),
        interrupted=f"the runs finished so far are kept in {args.output_dir}: the same command resumes from them",
    )


def _read_results(path: str) -> dict:
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None
    if not isinstance(results, dict) or not {"config", "runs"} <= set(results):
        raise ValueError(f"{path} is not a results.json written by `iha synthetic`.")
    return results


def _run(args: argparse.Namespace) -> int:
    if args.summarize:
        results_per_seed = [_read_results(path) for path in args.summarize]
        paths = write_seed_summary(results_per_seed, args.output_dir)
        print(paths["table"].read_text(encoding="utf-8"))
        return 0
    if args.seed is not None and args.seeds is not None:
        raise SystemExit("Give either --seed or --seeds, not both.")
    overrides = {
        "tasks": args.tasks,
        "m": _parse_m(args.m),
        "num_train": args.num_train,
        "num_val": args.num_val,
        "num_test": args.num_test,
        "hidden_size": args.hidden_size,
        "num_heads": args.num_heads,
        "pseudo_heads": args.pseudo_heads,
        "simplicial": args.simplicial,
        "learning_rates": args.learning_rates,
        "batch_size": args.batch_size,
        "max_epochs": args.max_epochs,
        "patience": args.patience,
    }
    preset = PRESETS[args.preset]
    if overrides["m"] is not None:
        overrides["m"] = {**preset.m, **overrides["m"]}
    config = replace(preset, **{key: value for key, value in overrides.items() if value is not None})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    seeds = args.seeds or ([args.seed] if args.seed is not None else PRESET_SEEDS[args.preset])
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must be distinct, got {seeds}.")
    output_dir = Path(args.output_dir)
    if len(seeds) > 1 and not args.fresh:
        _train_cheap_models_first(config, seeds, output_dir, args.device)
    results_per_seed = []
    for seed in seeds:
        # Several seeds: one complete comparison per seed in its own folder, then their mean and spread.
        seed_dir = output_dir if len(seeds) == 1 else output_dir / f"seed-{seed}"
        results_per_seed.append(_run_and_write(replace(config, seed=seed), seed_dir, args.fresh, args.device))
    if len(seeds) > 1:
        paths = write_seed_summary(results_per_seed, output_dir)
        print("\n" + paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


def _train_cheap_models_first(config: SyntheticConfig, seeds: list[int], output_dir: Path, device: str | None) -> None:
    """Several seeds: train every seed's MHA and IHA P = 2 first, then the costly models (IHA with P > 2 attends
    P m^2 pseudo-tokens, 2-simplicial m^4 pairs of keys), the cheaper task first, so that an interrupted call has
    whole models over all seeds. Runs go to each seed's checkpoint; the outputs are written afterwards."""
    cheap = {"MHA", "IHA P=1", "IHA P=2"}
    tasks_by_cost = sorted(config.tasks, key=lambda task: config.m[task][1])  # the largest m costs the most
    passes = [{(task, name) for task in config.tasks for name, _, _ in model_variants(config) if name in cheap}]
    for task in tasks_by_cost:
        passes.append({(task, name) for name, _, _ in model_variants(config) if name not in cheap})
    for only in passes:
        for seed in seeds:
            seed_config = replace(config, seed=seed)
            seed_dir = output_dir / f"seed-{seed}"
            finished = seed_dir / "results.json"
            if finished.is_file():
                saved = json.loads(finished.read_text(encoding="utf-8"))
                if saved.get("config") == _config_as_saved(seed_config):
                    continue  # done; another configuration is refused by _run_and_write
                return
            run_comparison(seed_config, checkpoint=seed_dir / "results.partial.json", device=device, only=only)


def _run_and_write(config: SyntheticConfig, output_dir: Path, fresh: bool, device: str | None = None) -> dict:
    """One comparison (resuming from `output_dir`'s checkpoint unless `fresh`), its outputs written to `output_dir`.

    A finished comparison of the same configuration already in `output_dir` is reused rather than recomputed (so
    `--seeds` picks up where an interrupted call stopped); one of another configuration is never overwritten
    unless `fresh`.
    """
    checkpoint = output_dir / "results.partial.json"
    finished = output_dir / "results.json"
    if fresh:
        checkpoint.unlink(missing_ok=True)
    elif finished.is_file():
        saved = json.loads(finished.read_text(encoding="utf-8"))
        if saved.get("config") == _config_as_saved(config):
            print(f"{finished}: this comparison has already run; reusing it (--fresh runs it again).")
            return saved
        raise SystemExit(
            f"{finished} holds a comparison with another configuration: pass --fresh to replace it, or choose "
            "another --output-dir."
        )
    start = time.perf_counter()
    results = run_comparison(config, checkpoint=checkpoint, device=device)
    results["wall_seconds"] = time.perf_counter() - start  # this call only (resumed runs are not counted)
    results["train_seconds_total"] = sum(run["train_seconds"] for run in results["runs"])
    paths = write_outputs(results, output_dir)
    checkpoint.unlink(missing_ok=True)
    print(results_table(results))
    print(
        f"\nseed {config.seed}: training time {results['train_seconds_total'] / 60:.1f} min "
        f"(this call {results['wall_seconds'] / 60:.1f} min); wrote " + ", ".join(str(p) for p in paths.values())
    )
    return results


if __name__ == "__main__":
    sys.exit(main())
