"""One trained run (`train_filter`: one model, attention and seed) and the runs saved by earlier calls."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..synthetic.models import reset_mixing_random
from .config import MODELS, PolynomialConfig, config_adjacency
from .constructions import FilterAttention, filter_target


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
