"""report.md (`render_markdown`) and error.png (`plot_curves`) of the trained comparison."""

from __future__ import annotations

import math
from pathlib import Path

from iha.utils.atomic_files import saved_figure

from .config import MODELS, PERSISTENT_CYCLE_LOGIT, PolynomialConfig, config_adjacency, is_iha
from .constructions import kronecker_rank, mha_error_floor


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
        f"{config.graph_seed}). The hand-set constructions are tested in tests/research/polynomial_filter/test_polynomial_filter.py "
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
