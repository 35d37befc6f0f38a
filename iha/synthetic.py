"""The paper's trained synthetic tasks, reproduced on a CPU: relation composition with one attention layer.

Task (paper, appendix): a random boolean relation R on {0..m-1} (each pair related with probability `density`) is
flattened row-major into m^2 tokens (token (i, j) is the bit R[i, j]). The label of position (i, j) is
(R o R)[i, j] = OR_k R[i, k] AND R[k, j] ("binary" composition) or (R o R o R)[i, j] ("ternary"). Solving position
(i, j) needs row i and column j (and, for ternary, the pairs in between), so attention is bidirectional.

Model (identical for MHA and IHA except for the attention; our choices where the paper is silent):

* embedding = bit embedding + learned row embedding (i) + learned column embedding (j): the model knows where each
  bit sits without any order bias (no RoPE, no causal mask);
* one pre-norm transformer block: x + Attention(LayerNorm(x)), then x + MLP(LayerNorm(x)) (GELU, 4x width);
* a final LayerNorm and a linear readout to one logit per position (binary cross-entropy).

The attention is plain bidirectional softmax attention with H heads over the m^2 tokens (MHA), or IHA: the same
q/k/v/o projections plus `iha.modeling_iha.IHAHeadMixing` (alpha_q/k/v [H, H, P], per-head collapse [H, P]),
softmax attention over the m^2 * P interleaved pseudo-tokens without a mask, then the collapse back to H heads.
IHA here is trained from scratch, so its mixing does not start at identity (which would keep every pseudo-copy of
a key identical forever under a mask-free attention): alphas are drawn like fresh linear weights over heads,
N(0, 1/H), and the collapse weights N(0, 1/P).

Training: AdamW (weight decay 0.01), batch 128, per-epoch validation, early stopping on validation accuracy
(patience epochs), the best validation checkpoint is tested. Metrics: per-position accuracy (the paper's) and
per-matrix exact match.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .atomic_files import save_figure_atomic, write_json_atomic, write_text_atomic
from .atomic_folders import run_command
from .modeling_iha import IHAHeadMixing


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------

# Paper, appendix: binary composition with m in 6..10 at density 0.325, ternary with m in 5..8 at density 0.264.
TASKS = {
    "binary": {"order": 2, "density": 0.325},
    "ternary": {"order": 3, "density": 0.264},
}


def compose_relation(relation: torch.Tensor, order: int) -> torch.Tensor:
    """Boolean `order`-fold composition R o ... o R of relations [..., m, m] (bool or 0/1)."""
    if order < 1:
        raise ValueError(f"`order` must be >= 1, got {order}.")
    relation = relation.float()
    composed = relation
    for _ in range(order - 1):
        composed = (composed @ relation > 0).float()
    return composed.bool()


def make_composition_data(
    task: str, m: int, num_examples: int, seed: int, density: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_examples` random relations: inputs [n, m*m] (0/1 long) and labels [n, m*m] (0/1 float), row-major."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}: choose one of {sorted(TASKS)}.")
    if m < 2:
        raise ValueError(f"`m` must be >= 2, got {m}.")
    density = TASKS[task]["density"] if density is None else density
    generator = torch.Generator().manual_seed(seed)
    relation = torch.rand(num_examples, m, m, generator=generator) < density
    labels = compose_relation(relation, TASKS[task]["order"])
    return relation.reshape(num_examples, m * m).long(), labels.reshape(num_examples, m * m).float()


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


class BidirectionalAttention(nn.Module):
    """Mask-free softmax attention: multi-head (`num_pseudo_heads=None`) or Interleaved Head Attention."""

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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.head_mixing is not None:
            query = self.head_mixing.mix_queries(query)  # [B, H, N * P, d]
            key, value = self.head_mixing.mix_keys_values(key, value)
        output = F.scaled_dot_product_attention(query, key, value)  # no mask: every (pseudo-)token sees every one
        output = output.transpose(1, 2)  # [B, N (* P), H, d]
        if self.head_mixing is not None:
            output = self.head_mixing.collapse_heads(output)  # [B, N, H, d]
        return self.o_proj(output.reshape(batch_size, seq_len, -1))


class CompositionModel(nn.Module):
    """One bidirectional transformer block over the m^2 relation bits, one logit per position."""

    def __init__(self, m: int, hidden_size: int, num_heads: int, num_pseudo_heads: int | None = None):
        super().__init__()
        self.m = m
        self.bit_embedding = nn.Embedding(2, hidden_size)
        self.row_embedding = nn.Embedding(m, hidden_size)
        self.column_embedding = nn.Embedding(m, hidden_size)
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.attention = BidirectionalAttention(hidden_size, num_heads, num_pseudo_heads)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size)
        )
        self.final_norm = nn.LayerNorm(hidden_size)
        self.readout = nn.Linear(hidden_size, 1)
        rows = torch.arange(m).repeat_interleave(m)  # token t = i * m + j sits at row i, column j
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("columns", torch.arange(m).repeat(m), persistent=False)

    def forward(self, bits: torch.Tensor) -> torch.Tensor:
        if bits.shape[-1] != self.m * self.m:
            raise ValueError(f"Expected {self.m * self.m} tokens (m = {self.m}), got {bits.shape[-1]}.")
        hidden = self.bit_embedding(bits) + self.row_embedding(self.rows) + self.column_embedding(self.columns)
        hidden = hidden + self.attention(self.attention_norm(hidden))
        hidden = hidden + self.mlp(self.mlp_norm(hidden))
        return self.readout(self.final_norm(hidden)).squeeze(-1)


def build_model(m: int, hidden_size: int, num_heads: int, num_pseudo_heads: int | None, seed: int) -> CompositionModel:
    """The same seed gives MHA and IHA the same embeddings, projections, MLP and readout at initialisation."""
    torch.manual_seed(seed)
    model = CompositionModel(m, hidden_size, num_heads, num_pseudo_heads)
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
    m: dict[str, int] = field(default_factory=lambda: {"binary": 6, "ternary": 5})
    num_train: int = 40_000
    num_val: int = 5_000
    num_test: int = 5_000
    hidden_size: int = 32
    num_heads: int = 8
    pseudo_heads: list[int] = field(default_factory=lambda: [8, 2])  # IHA variants; MHA always runs
    learning_rates: list[float] = field(default_factory=lambda: [1e-3, 1e-4])
    batch_size: int = 128
    max_epochs: int = 6
    patience: int = 2
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self):
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown:
            raise ValueError(f"Unknown task(s) {unknown}: choose from {sorted(TASKS)}.")
        missing = [task for task in self.tasks if task not in self.m]
        if missing:
            raise ValueError(f"No matrix size `m` given for task(s) {missing}.")
        if any(p < 1 for p in self.pseudo_heads):
            raise ValueError(f"Every pseudo-head count must be >= 1, got {self.pseudo_heads}.")
        for name in ("num_train", "num_val", "num_test", "batch_size", "max_epochs", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")


# The full comparison: the paper's task sizes at the small end of its ranges (binary m = 6, ternary m = 5),
# 40k/5k/5k examples, H = 8, P = 8 and 2, lr 1e-3 and 1e-4. Shrunk to fit about 30 minutes on 2 idle CPU cores:
# width 32 (head dim 4) and at most 6 epochs (patience 2). IHA with P = 8 over m^2 = 36 tokens attends 288
# pseudo-tokens, 64 times the attention of MHA: it takes most of the time.
FULL = SyntheticConfig()
# Seconds, for the tests.
TINY = SyntheticConfig(
    m={"binary": 4, "ternary": 4},
    num_train=512,
    num_val=128,
    num_test=128,
    hidden_size=16,
    num_heads=4,
    pseudo_heads=[2],
    learning_rates=[1e-2],
    batch_size=64,
    max_epochs=3,
    patience=2,
)
PRESETS = {"full": FULL, "tiny": TINY}


@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int = 512) -> dict:
    """Per-position accuracy, per-matrix exact match and mean BCE loss."""
    model.eval()
    correct = exact = loss = 0.0
    for start in range(0, len(inputs), batch_size):
        logits = model(inputs[start : start + batch_size])
        target = labels[start : start + batch_size]
        predictions = (logits > 0).float()
        correct += (predictions == target).float().sum().item()
        exact += (predictions == target).all(dim=-1).float().sum().item()
        loss += F.binary_cross_entropy_with_logits(logits, target, reduction="sum").item()
    positions = labels.numel()
    return {"accuracy": correct / positions, "exact_match": exact / len(inputs), "loss": loss / positions}


def train_one(
    model: nn.Module,
    data: dict[str, tuple[torch.Tensor, torch.Tensor]],
    learning_rate: float,
    config: SyntheticConfig,
    description: str = "",
) -> dict:
    """Train with early stopping on validation accuracy; returns history and the test metrics of the best epoch."""
    train_inputs, train_labels = data["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    best_accuracy, best_epoch, best_state, history = -1.0, 0, None, []
    epochs_without_gain = 0
    start_time = time.perf_counter()
    # A context manager, so that an interruption closes the bar before the command prints its last line.
    with tqdm(range(1, config.max_epochs + 1), desc=description, unit="epoch", leave=False) as progress:
        for epoch in progress:
            model.train()
            order = torch.randperm(len(train_inputs), generator=generator)
            total_loss = 0.0
            for start in range(0, len(order), config.batch_size):
                batch = order[start : start + config.batch_size]
                logits = model(train_inputs[batch])
                loss = F.binary_cross_entropy_with_logits(logits, train_labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(batch)
            validation = evaluate(model, *data["val"])
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
    test = evaluate(model, *data["test"])
    return {
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "val_accuracy": best_accuracy,
        "test_accuracy": test["accuracy"],
        "test_exact_match": test["exact_match"],
        "test_loss": test["loss"],
        "train_seconds": time.perf_counter() - start_time,
        "history": history,
    }


def model_variants(config: SyntheticConfig) -> list[tuple[str, int | None]]:
    return [("MHA", None)] + [(f"IHA P={p}", p) for p in config.pseudo_heads]


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


def run_comparison(config: SyntheticConfig, progress: bool = True, checkpoint: str | os.PathLike | None = None) -> dict:
    """Every task x model x learning rate; returns a JSON-ready dict (config, baselines, runs).

    With `checkpoint`, every finished run is saved there at once, and a later call with the same config skips the
    runs it finds: an interrupted comparison resumes where it stopped (each run is deterministic in the seed).
    """
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
            positive_rate = data["test"][1].mean().item()
            baselines[task] = {
                "m": m,
                "test_positive_rate": positive_rate,
                "majority_accuracy": max(positive_rate, 1 - positive_rate),
            }
            for name, num_pseudo_heads in variants:
                for learning_rate in config.learning_rates:
                    description = f"{task} m={m} {name} lr={learning_rate:g}"
                    if (task, name, learning_rate) in finished:
                        runs.append(finished[(task, name, learning_rate)])
                        overall.update(1)
                        overall.set_postfix_str(f"{description}: done before")
                        continue
                    model = build_model(m, config.hidden_size, config.num_heads, num_pseudo_heads, config.seed)
                    result = train_one(model, data, learning_rate, config, description)
                    runs.append(
                        {
                            "task": task,
                            "m": m,
                            "model": name,
                            "num_pseudo_heads": num_pseudo_heads,
                            "learning_rate": learning_rate,
                            "parameters": count_parameters(model),
                            **result,
                        }
                    )
                    if checkpoint is not None:
                        write_json_atomic({"config": asdict(config), "runs": runs}, checkpoint)
                    overall.update(1)
                    overall.set_postfix_str(f"{description}: test acc {result['test_accuracy']:.4f}")
    return {"config": asdict(config), "baselines": baselines, "runs": runs, "torch_threads": torch.get_num_threads()}


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


def results_table(results: dict) -> str:
    """Markdown: per task and model, test accuracy at each learning rate, the validation-selected one, params."""
    config = results["config"]
    learning_rates = config["learning_rates"]
    best = best_runs(results)
    header = ["Task", "m", "Model", "Parameters"]
    header += [f"test acc, lr {lr:g}" for lr in learning_rates]
    header += ["test acc (val-selected lr)", "exact match (val-selected)", "epochs (best / run)"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|---:|" + "---:|" * (len(header) - 4)]
    for task in config["tasks"]:
        baseline = results["baselines"][task]
        models = [name for name, _ in model_variants(SyntheticConfig(**config))]
        for model in models:
            runs = {
                run["learning_rate"]: run for run in results["runs"] if run["task"] == task and run["model"] == model
            }
            chosen = best[(task, model)]
            row = [task, str(baseline["m"]), model, f"{chosen['parameters']:,}"]
            row += [f"{100 * runs[lr]['test_accuracy']:.2f}" for lr in learning_rates]
            row += [
                f"**{100 * chosen['test_accuracy']:.2f}**",
                f"{100 * chosen['test_exact_match']:.2f}",
                f"{chosen['best_epoch']} / {chosen['epochs_run']}",
            ]
            lines.append("| " + " | ".join(row) + " |")
        majority = f"{100 * baseline['majority_accuracy']:.2f}"
        lines.append(
            "| "
            + " | ".join(
                [task, str(baseline["m"]), "constant (majority label)", "0"]
                + [majority] * len(learning_rates)
                + [majority, "–", "–"]
            )
            + " |"
        )
    return "\n".join(lines)


def seed_summary(results_per_seed: list[dict]) -> tuple[str, dict]:
    """Test accuracy (validation-selected learning rate) over several seeds: a markdown table and its numbers.

    Every element of `results_per_seed` is the output of one `run_comparison` (same tasks and models, another seed).
    """
    if not results_per_seed:
        raise ValueError("No results to summarise.")
    seeds = [results["config"]["seed"] for results in results_per_seed]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Each result must come from a different seed; got seeds {seeds}.")
    first = results_per_seed[0]["config"]
    models = [name for name, _ in model_variants(SyntheticConfig(**first))]
    selected = [best_runs(results) for results in results_per_seed]
    summary = {}
    header = ["Task", "m", "Model", *[f"seed {seed}" for seed in seeds], "mean", "std", "mean − MHA mean"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|" + "---:|" * (len(header) - 3)]
    for task in first["tasks"]:
        mha_mean = None
        for model in models:
            try:
                values = [100 * runs[(task, model)]["test_accuracy"] for runs in selected]
            except KeyError:
                raise ValueError(f"Seed results disagree: not every seed has {model} on {task}.") from None
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
            mha_mean = mean if model == "MHA" else mha_mean
            summary[f"{task}/{model}"] = {
                "task": task,
                "m": first["m"][task],
                "model": model,
                "test_accuracy": values,
                "mean": mean,
                "std": std,
                "seeds": seeds,
            }
            delta = "–" if model == "MHA" or mha_mean is None else f"{mean - mha_mean:+.2f}"
            row = [task, str(first["m"][task]), model, *[f"{v:.2f}" for v in values], f"**{mean:.2f}**", f"{std:.2f}"]
            lines.append("| " + " | ".join(row + [delta]) + " |")
    return "\n".join(lines), summary


def plot_results(results: dict, path: str | os.PathLike) -> Path:
    """Test accuracy per model (validation-selected learning rate) and validation curves, one column per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = results["config"]
    tasks = config["tasks"]
    models = [name for name, _ in model_variants(SyntheticConfig(**config))]
    best = best_runs(results)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8), squeeze=False)
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
        bar_axis.set_title(f"{task} composition, m = {baseline['m']}: test accuracy")
        bar_axis.set_ylabel("per-position accuracy (%)")
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
    figure.tight_layout()
    try:
        return save_figure_atomic(figure, path, dpi=110)
    finally:
        plt.close(figure)


def plot_seed_summary(summary: dict, path: str | os.PathLike) -> Path:
    """Mean test accuracy per model over seeds (bars, +-1 std), every seed as a dot; one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(entry["task"] for entry in summary.values()))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for axis, task in zip(axes[0], tasks):
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
        axis.set_xticks(list(positions), [entry["model"] for entry in entries])
        seeds = ", ".join(str(seed) for seed in entries[0]["seeds"])
        axis.set_title(f"{task} composition, m = {entries[0]['m']}: test accuracy, seeds {seeds}", fontsize=10)
        axis.set_ylabel("per-position accuracy (%)")
        axis.grid(axis="y", alpha=0.3)
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


def _parse_m(values: list[str] | None) -> dict[str, int] | None:
    if not values:
        return None
    sizes = {}
    for value in values:
        task, separator, size = value.partition("=")
        if not separator or not size.isdigit():
            raise SystemExit(f"--m takes TASK=SIZE (e.g. binary=6), got {value!r}")
        sizes[task] = int(size)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="iha synthetic",
        description="Relation composition (paper appendix): MHA vs IHA, one bidirectional attention layer, on CPU.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="full: ~30 min on 2 cores")
    parser.add_argument(
        "--output-dir", default="runs/synthetic", help="writes results.json/.md and accuracy.png (default: %(default)s)"
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None)
    parser.add_argument("--m", nargs="+", default=None, metavar="TASK=SIZE", help="matrix size per task")
    parser.add_argument("--num-train", type=int, default=None)
    parser.add_argument("--num-val", type=int, default=None)
    parser.add_argument("--num-test", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--pseudo-heads", type=int, nargs="+", default=None, help="IHA variants (P values)")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--patience", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="one comparison with this seed (default 0)")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="one comparison per seed (in OUTPUT_DIR/seed-N), then seeds.md/.json/.png: mean and spread over seeds",
    )
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
    seeds = args.seeds or [preset.seed if args.seed is None else args.seed]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must be distinct, got {seeds}.")
    output_dir = Path(args.output_dir)
    results_per_seed = []
    for seed in seeds:
        # Several seeds: one complete comparison per seed in its own folder, then their mean and spread.
        seed_dir = output_dir if len(seeds) == 1 else output_dir / f"seed-{seed}"
        results_per_seed.append(_run_and_write(replace(config, seed=seed), seed_dir, fresh=args.fresh))
    if len(seeds) > 1:
        paths = write_seed_summary(results_per_seed, output_dir)
        print("\n" + paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


def _run_and_write(config: SyntheticConfig, output_dir: Path, fresh: bool) -> dict:
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
    results = run_comparison(config, checkpoint=checkpoint)
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
