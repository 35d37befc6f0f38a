"""The numbers of a report: per attention and model the final errors over seeds, and IHA against each MHA paired by
seed (`summarize`)."""

from __future__ import annotations

import math
import statistics

from ..statistics import holm_adjusted, paired_differences
from .config import PolynomialConfig, is_iha


def _log10(value: float | None) -> float:
    return math.log10(value) if value is not None and value > 0 else float("inf")


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
