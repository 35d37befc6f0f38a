"""Training one model with early stopping, evaluating it, and running a whole comparison with resume."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .checkpoints import (
    claim,
    config_as_saved,
    epoch_state_path,
    load_checkpoint,
    run_key,
    same_config,
    save_run,
    weights_path,
)
from .config import SyntheticConfig, describe_m, model_variants
from .models import build_model, count_parameters
from .states import load_epoch_state, save_epoch_state, save_run_weights
from .task import CompositionData, fraction_seen_in, make_composition_data, split_seeds, valid_positions


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def evaluate_relations(
    model: nn.Module, data: CompositionData, batch_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per relation of `data`: the number of entries right, whether every entry is right (exact match), and the summed
    BCE loss over its entries; [n] each, in `data`'s order.

    Examples are evaluated in order of m, so that a batch holds few sizes and little padding (the mask makes the
    result independent of how the examples are batched).
    """
    model.eval()
    order = torch.argsort(data.sizes.cpu(), stable=True).to(data.sizes.device)
    correct = torch.zeros(len(data), device=data.sizes.device)
    loss = torch.zeros(len(data), device=data.sizes.device)
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
        loss[index] = (losses * is_real).sum(dim=-1)
    return correct, exact, loss


def evaluate(model: nn.Module, data: CompositionData, batch_size: int = 256) -> dict:
    """Accuracy over real positions (the paper's), per-matrix exact match, mean BCE loss; overall and per m
    (`evaluate_relations`, summed)."""
    correct, exact, loss = evaluate_relations(model, data, batch_size)
    positions = (data.sizes * data.sizes).float()
    metrics = {
        "accuracy": (correct.sum() / positions.sum()).item(),
        "exact_match": exact.float().mean().item(),
        "loss": (loss.sum() / positions.sum()).item(),
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


def epoch_batches(
    sizes: torch.Tensor, batch_size: int, generator: torch.Generator, group_by_m: bool = True
) -> list[torch.Tensor]:
    """The example indices of one epoch's training batches: every example exactly once, in a random order.

    `group_by_m`: each batch holds examples of a single m (a random permutation, sorted stably by m, cut into
    batches within each m, then the batches shuffled), so no batch pads to a larger m than its own; otherwise
    consecutive slices of the permutation (padded to their largest m).
    """
    order = torch.randperm(len(sizes), generator=generator)
    if not group_by_m:
        return list(order.split(batch_size))
    by_m = order[torch.argsort(sizes[order].cpu(), stable=True)]
    batches = [batch for size in sizes.unique().tolist() for batch in by_m[sizes[by_m].cpu() == size].split(batch_size)]
    return [batches[index] for index in torch.randperm(len(batches), generator=generator).tolist()]


def train_one(
    model: nn.Module,
    data: dict[str, CompositionData],
    learning_rate: float,
    config: SyntheticConfig,
    description: str = "",
    resume_path: str | os.PathLike | None = None,
) -> dict:
    """Train with early stopping on validation accuracy; returns history and the test metrics of the best epoch.

    With `resume_path`, the run's whole state (weights, optimizer, the batch order's generator, the best epoch so
    far, history, time spent) is saved there after every epoch (`states.save_epoch_state`: safetensors and JSON),
    and a run that finds the file continues after its last finished epoch: an interrupted run loses at most one
    epoch, and resumes to the result it would have reached without the interruption (every epoch's batches come
    from the saved generator state). The caller deletes the file once the run's result is saved.

    Every epoch that improves the best validation accuracy also records the test accuracy and exact match of that
    model in the history (never used to choose anything), so that models can be compared at equal epochs.
    The model ends holding the best epoch's weights.
    """
    train_data = data["train"]
    device = train_data.sizes.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    best_accuracy, best_epoch, best_state, history = -1.0, 0, None, []
    epochs_without_gain, seconds_before = 0, 0.0
    resume_path = Path(resume_path) if resume_path is not None else None
    if resume_path is not None and resume_path.is_file():
        # On the CPU: the batch order's generator is a CPU one; weights and optimizer state move to the model's device.
        state = load_epoch_state(resume_path)
        if not same_config(state["config"], config):
            raise ValueError(
                f"{resume_path} holds an unfinished run of another configuration. Delete it (or pass --fresh) to "
                "start over, or use another output folder."
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        best_accuracy, best_epoch, best_state = state["best_accuracy"], state["best_epoch"], state["best_state"]
        history, epochs_without_gain, seconds_before = state["history"], state["epochs_without_gain"], state["seconds"]
    start_time = time.perf_counter()
    first_epoch = len(history) + 1
    stopped = epochs_without_gain >= config.patience  # a run interrupted after its last epoch's state was saved
    # A context manager, so that an interruption closes the bar before the command prints its last line.
    with tqdm(
        range(first_epoch, config.max_epochs + 1),
        desc=description,
        unit="epoch",
        leave=False,
        initial=first_epoch - 1,
        total=config.max_epochs,
        disable=stopped,
    ) as progress:
        for epoch in [] if stopped else progress:
            model.train()
            total_loss = 0.0
            for index in epoch_batches(train_data.sizes.cpu(), config.batch_size, generator, config.group_by_m):
                batch = train_data.subset(index.to(device))  # padded to this batch's largest m
                loss = masked_loss(model(batch.bits, batch.sizes), batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(batch)
            validation = evaluate(model, data["val"], config.batch_size)
            history.append(
                {"epoch": epoch, "train_loss": total_loss / len(train_data), "val_accuracy": validation["accuracy"]}
            )
            progress.set_postfix(loss=f"{total_loss / len(train_data):.4f}", val_acc=f"{validation['accuracy']:.4f}")
            if validation["accuracy"] > best_accuracy:
                best_accuracy, best_epoch, epochs_without_gain = validation["accuracy"], epoch, 0
                best_state = copy.deepcopy(model.state_dict())
                test_now = evaluate(model, data["test"], config.batch_size)
                history[-1].update(test_accuracy=test_now["accuracy"], test_exact_match=test_now["exact_match"])
            else:
                epochs_without_gain += 1
            if resume_path is not None:
                save_epoch_state(
                    resume_path,
                    {
                        "config": config_as_saved(config),
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "generator": generator.get_state(),
                        "best_accuracy": best_accuracy,
                        "best_epoch": best_epoch,
                        "best_state": best_state,
                        "history": history,
                        "epochs_without_gain": epochs_without_gain,
                        "seconds": seconds_before + time.perf_counter() - start_time,
                    },
                )
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
        "train_seconds": seconds_before + time.perf_counter() - start_time,
        "history": history,
    }


def weights_description(run: dict, m: list[int], config: SyntheticConfig) -> dict:
    """What `models.build_model` needs to rebuild a run's model from its saved weights, and which run they are."""
    return {
        "task": run["task"],
        "model": run["model"],
        "attention": run["attention"],
        "num_pseudo_heads": run["num_pseudo_heads"],
        "learning_rate": run["learning_rate"],
        "max_m": m[1],
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "seed": config.seed,
        "best_epoch": run["best_epoch"],
        "val_accuracy": run["val_accuracy"],
    }


def comparison_data(config: SyntheticConfig, task: str) -> dict[str, CompositionData]:
    """The train / validation / test relations of `task` in the comparison `config` (its seed and data streams), as
    `run_comparison` trains and tests on them: what rebuilds a finished run's test split."""
    seeds = split_seeds(config.seed, task, config.tasks.index(task), config.data_streams)
    sizes = {"train": config.num_train, "val": config.num_val, "test": config.num_test}
    return {split: make_composition_data(task, config.m[task], sizes[split], seeds[split]) for split in sizes}


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
    wait_for_others: bool = True,
) -> dict:
    """Every task x model x learning rate; returns a JSON-ready dict (config, baselines, runs).

    With `checkpoint`, every finished run is saved there at once, and a later call with the same config skips the
    runs it finds; the run in progress keeps its state after every epoch beside the checkpoint (`epoch_state_path`)
    and continues from it: an interrupted comparison resumes where it stopped, to the same result.
    Several processes may work on one checkpoint: each run is claimed by the process that trains it (a lock beside
    the checkpoint), and the others skip it (`wait_for_others=False`: the returned runs then lack it) or wait for
    it and take its result (the default). `device` defaults to CUDA when there is one. `only` ((task, model) pairs)
    trains just those runs now, keeping the checkpoint's other runs, so that a caller can order the work across
    seeds (cheap models first).
    """
    device = torch.device(device) if device is not None else default_device()
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    finished = {run_key(run): run for run in load_checkpoint(checkpoint, config)}
    runs = []
    baselines = {}
    variants = model_variants(config)
    total = len(config.tasks) * len(variants) * len(config.learning_rates)
    with tqdm(total=total, desc="synthetic runs", unit="run", disable=not progress) as overall:
        for task in config.tasks:
            m = config.m[task]
            data = comparison_data(config, task)
            baselines[task] = {
                "m": m,
                **majority_baseline(data["test"]),
                "test_seen_in_train": fraction_seen_in(data["test"], data["train"]),
            }
            data = {split: split_data.to(device) for split, split_data in data.items()}
            for name, attention, num_pseudo_heads in variants:
                if only is not None and (task, name) not in only:
                    overall.update(len(config.learning_rates))
                    continue
                for learning_rate in config.learning_rates:
                    key = (task, name, learning_rate)
                    description = f"{task} m={describe_m(m)} {name} lr={learning_rate:g}"
                    with claim(checkpoint, key, wait=wait_for_others) as claimed:
                        if checkpoint is not None and key not in finished:
                            # Another process may have finished it since this call started.
                            finished = {run_key(run): run for run in load_checkpoint(checkpoint, config)}
                        if key in finished:
                            if checkpoint is not None:  # stopped between saving the result and deleting the state
                                epoch_state_path(checkpoint, key).unlink(missing_ok=True)
                            runs.append(finished[key])
                            overall.update(1)
                            overall.set_postfix_str(f"{description}: done before")
                            continue
                        if not claimed:
                            overall.update(1)
                            overall.set_postfix_str(f"{description}: another process is training it")
                            continue
                        model = build_model(
                            m[1], config.hidden_size, config.num_heads, num_pseudo_heads, config.seed, attention
                        ).to(device)
                        resume_path = epoch_state_path(checkpoint, key) if checkpoint is not None else None
                        result = train_one(model, data, learning_rate, config, description, resume_path)
                        run = {
                            "task": task,
                            "m": m,
                            "model": name,
                            "attention": attention,
                            "num_pseudo_heads": num_pseudo_heads,
                            "learning_rate": learning_rate,
                            "parameters": count_parameters(model),
                            **result,
                        }
                        if checkpoint is not None:
                            # The weights first: a result that names them always has them.
                            weights = weights_path(checkpoint, key)
                            save_run_weights(weights, model.state_dict(), weights_description(run, m, config))
                            run["weights"] = weights.relative_to(checkpoint.parent).as_posix()
                        runs.append(run)
                        if checkpoint is not None:
                            finished = {run_key(saved): saved for saved in save_run(checkpoint, config, run)}
                            # The folder stays (like `.locks`): another process may be writing its run's state there.
                            resume_path.unlink(missing_ok=True)
                    overall.update(1)
                    overall.set_postfix_str(f"{description}: test acc {result['test_accuracy']:.4f}")
    return {
        "config": asdict(config),
        "baselines": baselines,
        "runs": runs,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
    }
