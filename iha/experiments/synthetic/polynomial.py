"""The paper's polynomial-filter claim, trained: `run_experiment` trains, from random initialisations on fresh random
features every step, MHA with ceil(sqrt(k)) and with k heads and IHA with ceil(sqrt(k)) heads (P = the same) on the
filter of order k (k = 4: 2, 4 and 2 heads; k = 9: 3, 9 and 3), with linear and softmax attention, and reports the
relative error on held-out features against steps (`iha polynomial-filter --output-dir DIR`; k = 9 with
`--order 9`).

The task, the attention layer and the hand-set constructions that show why the claim holds are in
`iha.experiments.synthetic.polynomial_filter`.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...utils.atomic_files import saved_figure, write_json_atomic, write_text_atomic
from ..statistics import holm_adjusted, paired_differences
from .models import reset_mixing_random
from .polynomial_filter import (
    ATTENTION_KINDS,
    FILTER_ORDER,
    FilterAttention,
    filter_target,
    kronecker_rank,
    mha_error_floor,
)


# ---------------------------------------------------------------------------------------------------------------------
# The trained comparison
# ---------------------------------------------------------------------------------------------------------------------


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
    """The settings of the polynomial-filter experiment (each a flag of `iha polynomial-filter`)."""

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


def relative_error(prediction: torch.Tensor, target: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(prediction - target) / torch.linalg.vector_norm(target)).item()


def train_filter(config: PolynomialConfig, model_name: str, attention: str, seed: int) -> dict:
    """Train one model on fresh random features every step (Adam, cosine decay); relative error on a fixed
    held-out set of features every `eval_every` steps."""
    num_heads, num_pseudo_heads = MODELS[model_name]
    adjacency = config_adjacency(config, attention)
    torch.manual_seed(seed)
    layer = FilterAttention(
        config.num_tokens,
        config.feature_size,
        num_heads,
        config.head_dim,
        config.order * config.feature_size,
        num_pseudo_heads,
        attention,
    )
    if layer.head_mixing is not None:
        reset_mixing_random(layer.head_mixing, torch.Generator().manual_seed(seed + 1))
    data = torch.Generator().manual_seed(seed + 2)
    held_out = torch.randn(
        config.num_eval,
        config.num_tokens,
        config.feature_size,
        generator=torch.Generator().manual_seed(config.graph_seed + 1),
    )
    held_out_target = filter_target(adjacency, held_out, config.order)
    optimizer = torch.optim.Adam(layer.parameters(), lr=config.learning_rate)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps)
    curve = []
    started = time.process_time()
    for step in range(1, config.steps + 1):
        features = torch.randn(config.batch_size, config.num_tokens, config.feature_size, generator=data)
        loss = (layer(features) - filter_target(adjacency, features, config.order)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % config.eval_every == 0 or step == config.steps:
            with torch.no_grad():
                error = relative_error(layer(held_out), held_out_target)
            curve.append([step, error if math.isfinite(error) else None])
    final = curve[-1][1]
    return {
        "model": model_name,
        "attention": attention,
        "seed": seed,
        "parameters": sum(parameter.numel() for parameter in layer.parameters()),
        "final_relative_error": final,
        "best_relative_error": min((error for _, error in curve if error is not None), default=None),
        "curve": curve,
        "cpu_seconds": time.process_time() - started,
    }


def _log10(value: float | None) -> float:
    return math.log10(value) if value is not None and value > 0 else float("inf")


def is_iha(model: str) -> bool:
    return MODELS[model][1] is not None


def summarize(config: PolynomialConfig, runs: list[dict]) -> dict:
    """Per attention and model: the final relative error over seeds (median, range, seeds below 1e-3); per
    attention, each IHA model against each MHA paired by seed on log10 of the final error, with Holm-adjusted
    p-values over all the pairs of the report (one family)."""
    summary = {"models": {}, "paired": {}}
    for attention in config.attentions:
        for model in config.models:
            chosen = [run for run in runs if run["attention"] == attention and run["model"] == model]
            if not chosen:
                continue
            finals = [run["final_relative_error"] for run in chosen]
            finite = [value for value in finals if value is not None]
            summary["models"][f"{attention}/{model}"] = {
                "attention": attention,
                "model": model,
                "parameters": chosen[0]["parameters"],
                "seeds": [run["seed"] for run in chosen],
                "final_relative_error": finals,
                "median": statistics.median(finite) if finite else None,
                "min": min(finite) if finite else None,
                "max": max(finite) if finite else None,
                "below_1e-3": sum(value is not None and value < 1e-3 for value in finals),
            }
        for iha in [model for model in config.models if is_iha(model)]:
            ours = {run["seed"]: run for run in runs if run["attention"] == attention and run["model"] == iha}
            for baseline in [model for model in config.models if not is_iha(model)]:
                other = {run["seed"]: run for run in runs if run["attention"] == attention and run["model"] == baseline}
                seeds = sorted(set(ours) & set(other))
                values = [
                    (_log10(other[s]["final_relative_error"]), _log10(ours[s]["final_relative_error"])) for s in seeds
                ]
                if seeds and all(math.isfinite(a) and math.isfinite(b) for a, b in values):
                    summary["paired"][f"{attention}/{iha} - {baseline}"] = paired_differences(
                        [a for a, _ in values], [b for _, b in values], labels=seeds
                    )
    made = {(run["attention"], run["model"], run["seed"]) for run in runs}
    summary["missing"] = [
        [attention, model, seed]
        for attention in config.attentions
        for seed in config.seeds
        for model in config.models
        if (attention, model, seed) not in made
    ]
    tested = [paired for paired in summary["paired"].values() if paired["t_p_value"] is not None]
    for key in ("t_p_value", "permutation_p_value"):
        for paired, adjusted in zip(tested, holm_adjusted([paired[key] for paired in tested])):
            paired[f"holm_{key}"] = adjusted
    for paired in tested:
        paired["holm_family_size"] = len(tested)
    return summary


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2g}"


def _filter_text(order: int) -> str:
    powers = ["X", "AX"] + [f"A^{power} X" for power in range(2, order)]
    return "[" + ", ".join(powers if order <= 4 else [*powers[:3], "...", powers[-1]]) + "]"


def _graphs_text(config: PolynomialConfig) -> str:
    if config.graphs == "gaussian":
        return "Linear attention: A Gaussian with spectral norm 1; softmax: A row-stochastic with positive entries"
    return (
        "Linear attention: A a random rotation (every power has the norm of I); softmax: A the row-stochastic softmax "
        f"of a directed cycle's logits ({PERSISTENT_CYCLE_LOGIT:g}) plus Gaussian noise (powers stay distinct)"
    )


def _seeds_text(seeds: list[int]) -> str:
    seeds = sorted(seeds)
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def _unfinished_lines(config: PolynomialConfig, summary: dict) -> list[str]:
    """What an unfinished report holds: the runs made per attention and model, and the ones still to make."""
    if not summary["missing"]:
        return []
    total = len(config.attentions) * len(config.models) * len(config.seeds)
    made = []
    for attention in config.attentions:
        for model in config.models:
            entry = summary["models"].get(f"{attention}/{model}")
            made.append(f"{attention} {model}: " + (_seeds_text(entry["seeds"]) if entry else "none"))
    return [
        f"## Unfinished: {total - len(summary['missing'])} of {total} runs",
        "",
        "Runs made, per attention and model: " + "; ".join(made) + ". Every table below is over these runs only, and "
        "each paired test over the seeds where both of its models have a run. The command under Reproduce continues "
        "it: it reuses the runs saved in this folder's report.json and trains the missing ones.",
        "",
    ]


def _paired_note(config: PolynomialConfig, summary: dict, family: int) -> str:
    """What the paired table's tests are over and how low they can go."""
    seeds = len(config.seeds)
    if not summary["paired"]:
        return "No IHA model and MHA model have a run on the same seed yet: nothing to pair."
    note = f"Negative: IHA lower. Holm: adjusted over the {family} tested comparisons of this table (one family); "
    if all(paired["n"] == seeds for paired in summary["paired"].values()):
        return note + (
            f"with {seeds} seeds the exact sign-flip test cannot go below {2 / 2**seeds:.3g} raw, nor below "
            f"{min(1.0, family * 2 / 2**seeds):.3g} after Holm."
        )
    return note + (
        "each row pairs only the seeds where both models have a run (n in the 'seeds IHA higher' column); with n "
        "seeds the exact sign-flip test cannot go below 2 / 2^n (0.0625 for 5, 0.125 for 4, 0.25 for 3), and one "
        "seed allows no test."
    )


def render_markdown(config: PolynomialConfig, summary: dict, runs: list[dict], command: str) -> str:
    family = sum(paired["t_p_value"] is not None for paired in summary["paired"].values())
    mha_heads = sorted(MODELS[model][0] for model in config.models if not is_iha(model))
    fewest = mha_heads[0] if mha_heads else None
    lines = [
        f"# The polynomial-filter claim: one attention layer computing {_filter_text(config.order)} (k = {config.order})",
        "",
        f"N = {config.num_tokens} tokens with one-hot positions and d_x = {config.feature_size} features, head dim "
        f"{config.head_dim}; one bidirectional attention layer, nothing else. Trained from random initialisations "
        f"(IHA mixing drawn N(0, 1/H), collapse N(0, 1/P)) on fresh Gaussian features every step: Adam, lr "
        f"{config.learning_rate:g} with cosine decay, batch {config.batch_size}, {config.steps} steps; relative error "
        f"||Y_hat - Y|| / ||Y|| on {config.num_eval} held-out feature sets. {_graphs_text(config)} (graph seed "
        f"{config.graph_seed}). The hand-set constructions are tested in tests/experiments/synthetic/test_polynomial_filter.py "
        "(exact in float64).",
        "",
        *_unfinished_lines(config, summary),
        "## Final relative error over seeds",
        "",
        "| attention | model | parameters | median | best | worst | seeds below 1e-3 | per seed |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for entry in summary["models"].values():
        per_seed = ", ".join("diverged" if value is None else f"{value:.2g}" for value in entry["final_relative_error"])
        lines.append(
            f"| {entry['attention']} | {entry['model']} | {entry['parameters']:,} | {_cell(entry['median'])} | "
            f"{_cell(entry['min'])} | {_cell(entry['max'])} | {entry['below_1e-3']} of {len(entry['seeds'])} | "
            f"{per_seed} |"
        )
    if fewest is not None:
        adjacencies = {attention: config_adjacency(config, attention).double() for attention in config.attentions}
        floors = ", ".join(
            f"{attention} {mha_error_floor(adjacency, fewest, config.order):.3g}"
            for attention, adjacency in adjacencies.items()
        )
        ranks = ", ".join(
            f"{attention} {kronecker_rank(adjacency, config.order)}" for attention, adjacency in adjacencies.items()
        )
        lines += [
            "",
            f"The floor of {fewest}-head MHA with position-only patterns (the best sum of {fewest} Kronecker products): "
            f"{floors}; the filter's Kronecker rank: {ranks}. A trained {fewest}-head MHA can also read the features "
            f"in its patterns; {config.order}-head MHA and {math.isqrt(config.order - 1) + 1}-head IHA can reach 0.",
        ]
    lines += [
        "",
        "## IHA against MHA, paired by seed (log10 of the final relative error, IHA - MHA)",
        "",
        _paired_note(config, summary, family),
        "",
        "| attention | comparison | mean [95% t interval] | seeds IHA higher | paired t p | Holm | sign-flip p | Holm |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, paired in summary["paired"].items():
        attention, comparison = name.split("/", 1)
        if paired["ci"] is None:
            lines.append(f"| {attention} | {comparison} | {paired['mean']:+.2f} (one seed: no test) | | | | | |")
            continue
        low, high = paired["ci"]
        lines.append(
            f"| {attention} | {comparison} | {paired['mean']:+.2f} [{low:+.2f}, {high:+.2f}] | "
            f"{paired['positive']} of {paired['n']} | {paired['t_p_value']:.3g} | {paired['holm_t_p_value']:.3g} | "
            f"{paired['permutation_p_value']:.3g} | {paired['holm_permutation_p_value']:.3g} |"
        )
    lines += [
        "",
        "![relative error against steps](error.png)",
        "",
        f"CPU time: {sum(run['cpu_seconds'] for run in runs) / 60:.1f} min over {len(runs)} runs.",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    return "\n".join(lines)


def plot_curves(config: PolynomialConfig, runs: list[dict], path: Path) -> Path:
    """Relative error against steps, one panel per attention, one line per run (colour: model)."""
    colors = {model: f"C{index}" for index, model in enumerate(config.models)}
    with saved_figure(
        path, dpi=110, ncols=len(config.attentions), figsize=(6 * len(config.attentions), 4.2), squeeze=False
    ) as (_, axes):
        for axis, attention in zip(axes[0], config.attentions):
            labelled = set()
            for run in runs:
                if run["attention"] != attention:
                    continue
                points = [(step, error) for step, error in run["curve"] if error is not None]
                label = None if run["model"] in labelled else run["model"]
                labelled.add(run["model"])
                axis.plot(*zip(*points), color=colors[run["model"]], alpha=0.7, linewidth=1, label=label)
            axis.set_yscale("log")
            axis.set_xlabel("training step")
            axis.set_ylabel("relative error on held-out features")
            axis.set_title(f"{attention} attention: {_filter_text(config.order)}")
            axis.grid(alpha=0.3, which="both")
            if labelled:  # a panel of an unfinished report may have no runs yet
                axis.legend(fontsize=8)
    return Path(path)


# The settings that choose which runs to make, not how a run goes: every run depends only on the other settings and
# its own attention, model and seed, so runs saved under another selection can be reused.
SELECTION_SETTINGS = ("models", "attentions", "seeds")


def task_settings(config: PolynomialConfig) -> dict:
    """The settings a run depends on (all but the selection), as saved in JSON."""
    settings = json.loads(json.dumps(asdict(config)))
    return {name: value for name, value in settings.items() if name not in SELECTION_SETTINGS}


def _saved_runs(path: Path, config: PolynomialConfig) -> list[dict]:
    """The runs of `config`'s selection saved in `path` (a checkpoint or a report) if they were made with the same
    task settings (the selection may differ); a saved configuration from before a setting existed takes that
    setting's default."""
    if not path.is_file():
        return []
    saved = json.loads(path.read_text(encoding="utf-8"))
    try:
        saved_config = PolynomialConfig(**saved["config"])
    except (TypeError, ValueError):
        return []
    if task_settings(saved_config) != task_settings(config):
        return []
    return [
        run
        for run in saved["runs"]
        if run["attention"] in config.attentions and run["model"] in config.models and run["seed"] in config.seeds
    ]


def saved_runs(config: PolynomialConfig, folders: list[Path]) -> list[dict]:
    """The runs of `config` saved in any of `folders` (runs.partial.json, report.json), each (attention, model,
    seed) once: the first folder's first."""
    runs, done = [], set()
    for folder in folders:
        for name in ("runs.partial.json", "report.json"):
            for run in _saved_runs(Path(folder) / name, config):
                key = (run["attention"], run["model"], run["seed"])
                if key not in done:
                    done.add(key)
                    runs.append(run)
    return runs


def run_experiment(
    config: PolynomialConfig,
    output_dir: str | Path,
    command: str = "",
    progress: bool = True,
    runs_from: list[str | Path] = (),
    train: bool = True,
) -> dict:
    """Every attention x model x seed (reusing the runs saved with the same task settings in OUTPUT_DIR's
    runs.partial.json or report.json, or in the folders `runs_from`), then report.md/.json and error.png in
    `output_dir`. With `train=False` nothing is trained: the report is of the saved runs and lists the missing ones."""
    output_dir = Path(output_dir)
    checkpoint = output_dir / "runs.partial.json"
    runs = saved_runs(config, [output_dir, *runs_from])
    done = {(run["attention"], run["model"], run["seed"]) for run in runs}
    # Seed by seed, every model of a seed before the next seed: runs cut short still pair by seed.
    work = [(a, m, s) for a in config.attentions for s in config.seeds for m in config.models if (a, m, s) not in done]
    if not train:
        work = []
    for index, (attention, model, seed) in enumerate(work, 1):
        run = train_filter(config, model, attention, seed)
        runs.append(run)
        write_json_atomic({"config": asdict(config), "runs": runs}, checkpoint)
        if progress:
            final = run["final_relative_error"]
            print(
                f"[{index}/{len(work)}] {attention} {model} seed {seed}: relative error "
                f"{'diverged' if final is None else f'{final:.3g}'} ({run['cpu_seconds']:.0f} CPU-s)",
                flush=True,
            )
    summary = summarize(config, runs)
    report = {"config": asdict(config), "summary": summary, "runs": runs, "command": command}
    write_json_atomic(report, output_dir / "report.json")
    plot_curves(config, runs, output_dir / "error.png")
    write_text_atomic(render_markdown(config, summary, runs, command), output_dir / "report.md")
    checkpoint.unlink(missing_ok=True)
    return report
