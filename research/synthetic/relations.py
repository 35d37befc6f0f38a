"""Per-relation tests of finished comparisons from their saved best weights, and what the data of the seeds share.

A finished run saves its best weights (`states.save_run_weights`, safetensors: never unpickled). From them and the
run's configuration the model and its test split are rebuilt exactly as training made them
(`train.comparison_data`: the same seed and data streams), so each test relation's exact match is known per model
without retraining:

- **McNemar within a seed**: two models of one seed answered the same test relations; the relations only one of
  them got entirely right (`statistics.discordant_counts`) give the exact McNemar test
  (`statistics.mcnemar_exact`), Holm-adjusted over every pair of the report (`statistics.holm_adjusted`);
- **seen and unseen relations**: exact match on the test relations absent from that seed's training set, and on
  those present verbatim (small m at the paper's densities repeats relations by chance);
- **the data**: per seed, the fraction of test relations present in its own training set (the duplicate rate), and
  across seeds, the fraction of one seed's test relations present in another seed's splits (what "shifted" data
  streams share; "independent" streams share only what chance repeats).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from ..statistics import discordant_counts, holm_adjusted, mcnemar_exact
from .config import SyntheticConfig, config_from_saved
from .models import build_model
from .states import load_run_weights
from .summary import best_runs
from .task import CompositionData, relation_keys
from .train import comparison_data, default_device, evaluate_relations


def load_run_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
    """The model of a finished run, rebuilt from its saved best weights (safetensors and JSON), and its description."""
    state_dict, description = load_run_weights(path)
    model = build_model(
        description["max_m"],
        description["hidden_size"],
        description["num_heads"],
        description["num_pseudo_heads"],
        description["seed"],
        description["attention"],
    )
    model.load_state_dict(state_dict)
    return model.to(device), description


def exact_match_per_relation(
    run: dict, seed_dir: str | os.PathLike, test: CompositionData, batch_size: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[n] bool: which of the run's test relations its saved best weights get entirely right."""
    model, _ = load_run_model(Path(seed_dir) / run["weights"], device)
    _, exact, _ = evaluate_relations(model, test.to(device), batch_size)
    return exact.cpu()


def seen_in(data: CompositionData, reference: CompositionData) -> torch.Tensor:
    """[n] bool: which relations of `data` occur verbatim in `reference`."""
    seen = set(relation_keys(reference))
    return torch.tensor([key in seen for key in relation_keys(data)], dtype=torch.bool)


def _share(flags: torch.Tensor) -> float:
    return flags.float().mean().item() if len(flags) else 0.0


def _exact_match_on(exact: torch.Tensor, where: torch.Tensor) -> dict:
    return {"relations": int(where.sum()), "exact_match": exact[where].float().mean().item() if where.any() else None}


def seed_relation_tests(
    config: SyntheticConfig, results: dict, seed_dir: str | os.PathLike, device: str | torch.device = "cpu"
) -> dict:
    """One seed's per-relation results: per task, the duplicate rate, every validation-selected run's exact match
    on the seen and unseen test relations (from its weights; the recorded exact match beside the rebuilt one), and
    McNemar for every pair of models that both have weights (the pairs that do not are listed, with why)."""
    selected = best_runs(results)
    tasks = {}
    for task in config.tasks:
        data = comparison_data(config, task)
        in_train = seen_in(data["test"], data["train"])
        runs, exact_by_model = {}, {}
        for (run_task, model), run in selected.items():
            if run_task != task:
                continue
            if "weights" not in run:
                runs[model] = {"weights": None}
                continue
            exact = exact_match_per_relation(run, seed_dir, data["test"], config.batch_size, device)
            exact_by_model[model] = exact
            runs[model] = {
                "weights": run["weights"],
                "learning_rate": run["learning_rate"],
                "recorded_exact_match": run["test_exact_match"],
                "exact_match": exact.float().mean().item(),
                "unseen": _exact_match_on(exact, ~in_train),
                "seen": _exact_match_on(exact, in_train),
            }
        pairs = []
        for model_a, model_b in itertools.combinations(list(runs), 2):
            pair = {"models": [model_a, model_b]}
            if model_a in exact_by_model and model_b in exact_by_model:
                only_a, only_b = discordant_counts(exact_by_model[model_a].tolist(), exact_by_model[model_b].tolist())
                pair.update(only_a_right=only_a, only_b_right=only_b, p_value=mcnemar_exact(only_a, only_b))
            else:
                missing = [model for model in (model_a, model_b) if model not in exact_by_model]
                pair.update(missing_weights=missing)
            pairs.append(pair)
        tasks[task] = {
            "test_relations": len(data["test"]),
            "test_seen_in_train": _share(in_train),
            "runs": runs,
            "pairs": pairs,
        }
    return {"seed": config.seed, "tasks": tasks}


def duplicate_rates(config: SyntheticConfig) -> dict[str, float]:
    """Per task of `config` (its seed): the share of test relations present verbatim in the training set."""
    rates = {}
    for task in config.tasks:
        data = comparison_data(config, task)
        rates[task] = _share(seen_in(data["test"], data["train"]))
    return rates


def cross_seed_overlap(configs: list[SyntheticConfig]) -> dict:
    """Per task and ordered pair of seeds (a, b): the fraction of seed a's test relations present verbatim in each of
    seed b's splits, beside seed a's own duplicate rate (its test relations in its own training set)."""
    overlap = {}
    for task in configs[0].tasks:
        data = {config.seed: comparison_data(config, task) for config in configs}
        rows = []
        for seed_a, seed_b in itertools.permutations(data, 2):
            row = {"test_of": seed_a, "splits_of": seed_b}
            row.update({split: _share(seen_in(data[seed_a]["test"], data[seed_b][split])) for split in data[seed_b]})
            rows.append(row)
        overlap[task] = {
            "data_streams": configs[0].data_streams,
            "own_train": {seed: _share(seen_in(split["test"], split["train"])) for seed, split in data.items()},
            "pairs": rows,
        }
    return overlap


def relation_tests(
    results_per_seed: list[dict], seed_dirs: list[str | os.PathLike], device: str | torch.device | None = None
) -> dict:
    """Every seed's `seed_relation_tests`, the McNemar p-values Holm-adjusted as one family, and the data the seeds
    share (`cross_seed_overlap`). JSON-ready. `device` defaults to CUDA when there is one."""
    device = torch.device(device) if device is not None else default_device()
    configs = [config_from_saved(results["config"]) for results in results_per_seed]
    seeds = [
        seed_relation_tests(config, results, seed_dir, device)
        for config, results, seed_dir in zip(configs, results_per_seed, seed_dirs)
    ]
    tested = [pair for seed in seeds for task in seed["tasks"].values() for pair in task["pairs"] if "p_value" in pair]
    for pair, adjusted in zip(tested, holm_adjusted([pair["p_value"] for pair in tested])):
        pair["p_value_holm"] = adjusted
    return {"seeds": seeds, "mcnemar_tests": len(tested), "overlap": cross_seed_overlap(configs)}
