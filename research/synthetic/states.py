"""What a synthetic run keeps on disk, as safetensors with its JSON beside the tensors, never a pickle.

Two kinds of file, each one safetensors file whose header metadata holds the JSON (`{"state": "<json>"}`), so
that a file is written atomically as a whole and is read back without unpickling anything:
- an **epoch state** (`save_epoch_state` / `load_epoch_state`): everything an interrupted run needs to continue
  exactly, after every epoch: the weights, the best weights so far, AdamW's state, the batch order's generator,
  history and counters;
- a finished run's **best weights** (`save_run_weights` / `load_run_weights`), with what rebuilds the model, so
  that per-relation tests of a finished comparison need no retraining.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from iha.utils.atomic_files import atomic_destination


EPOCH_STATE_FORMAT = "iha-synthetic-epoch-state/1"
RUN_WEIGHTS_FORMAT = "iha-synthetic-run-weights/1"


def save_tensors_with_json(path: str | os.PathLike, tensors: dict[str, torch.Tensor], info: dict) -> Path:
    """One safetensors file holding `tensors` and `info` (as JSON in the header), written atomically."""
    # safetensors refuses views that share storage (tied or sliced tensors): every tensor gets its own.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}
    with atomic_destination(path) as temporary:
        save_file(tensors, str(temporary), metadata={"state": json.dumps(info)})
    return Path(path)


def load_tensors_with_json(path: str | os.PathLike, expected_format: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the JSON of a file `save_tensors_with_json` wrote; a file of another kind is refused."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no iter)
    info = json.loads(metadata.get("state", "{}"))
    if info.get("format") != expected_format:
        raise ValueError(f"{path} is not a {expected_format} file (it says {info.get('format')!r}).")
    return tensors, info


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": tensor for name, tensor in tensors.items()}


def _unprefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    start = len(prefix) + 1
    return {name[start:]: tensor for name, tensor in tensors.items() if name.startswith(prefix + ".")}


def split_optimizer_state(optimizer_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's `state_dict()` as tensors (`optimizer.<parameter>.<name>`) and JSON (its parameter groups and
    any per-parameter value that is not a tensor)."""
    tensors, plain = {}, {}
    for parameter, values in optimizer_state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{parameter}.{name}"] = value
            else:
                plain.setdefault(str(parameter), {})[name] = value
    return tensors, {"param_groups": optimizer_state["param_groups"], "plain_state": plain}


def join_optimizer_state(tensors: dict[str, torch.Tensor], saved: dict) -> dict:
    """The inverse of `split_optimizer_state`: a dict `optimizer.load_state_dict` takes."""
    state: dict[int, dict] = {}
    for key, tensor in _unprefixed("optimizer", tensors).items():
        parameter, name = key.split(".", 1)
        state.setdefault(int(parameter), {})[name] = tensor
    for parameter, values in saved["plain_state"].items():
        state.setdefault(int(parameter), {}).update(values)
    return {"state": state, "param_groups": saved["param_groups"]}


def save_epoch_state(path: str | os.PathLike, state: dict) -> Path:
    """Write a run's state after an epoch (`train.train_one`'s `resume_path`) atomically: an interruption while
    writing leaves the previous epoch's file. `state` holds `model`, `best_state` (state dicts), `optimizer` (its
    state dict), `generator` (its byte state) and JSON-ready values (config, history, counters)."""
    optimizer_tensors, optimizer_json = split_optimizer_state(state["optimizer"])
    tensors = {
        **_prefixed("model", state["model"]),
        **_prefixed("best", state["best_state"]),
        **optimizer_tensors,
        "generator": state["generator"],
    }
    info = {key: value for key, value in state.items() if key not in ("model", "best_state", "optimizer", "generator")}
    return save_tensors_with_json(path, tensors, {"format": EPOCH_STATE_FORMAT, **info, "optimizer": optimizer_json})


def load_epoch_state(path: str | os.PathLike, with_tensors: bool = True) -> dict:
    """A state `save_epoch_state` wrote, in the same shape it was given (without its tensors when `with_tensors`
    is False: what a report of runs in progress reads)."""
    path = Path(path)
    if not with_tensors:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            info = json.loads((handle.metadata() or {}).get("state", "{}"))
        if info.get("format") != EPOCH_STATE_FORMAT:
            raise ValueError(f"{path} is not a {EPOCH_STATE_FORMAT} file (it says {info.get('format')!r}).")
        info.pop("optimizer")
        return info
    tensors, info = load_tensors_with_json(path, EPOCH_STATE_FORMAT)
    return {
        **info,
        "model": _unprefixed("model", tensors),
        "best_state": _unprefixed("best", tensors),
        "optimizer": join_optimizer_state(tensors, info["optimizer"]),
        "generator": tensors["generator"],
    }


def save_run_weights(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], run: dict) -> Path:
    """A finished run's best weights with what rebuilds its model (`run`: task, model, attention, P, sizes, seed,
    best epoch)."""
    return save_tensors_with_json(path, state_dict, {"format": RUN_WEIGHTS_FORMAT, **run})


def load_run_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The state dict and the description `save_run_weights` wrote."""
    return load_tensors_with_json(path, RUN_WEIGHTS_FORMAT)
