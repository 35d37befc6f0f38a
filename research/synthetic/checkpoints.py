"""A comparison's files while it runs: its checkpoint of finished runs (`results.partial.json`, merged under a lock
when several processes share it), each unfinished run's epoch state and each finished run's weights beside it, the
claim a process holds on the run it trains, and the runs in progress as far as they got."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from filelock import FileLock, Timeout

from iha.utils.atomic_files import write_json_atomic

from .config import SyntheticConfig, config_from_saved, model_variants
from .states import load_epoch_state


def config_as_saved(config: SyntheticConfig) -> dict:
    """The config as it reads back from a results file (JSON turns tuples into lists, int keys into strings), so
    that a saved comparison can be matched against the one asked for."""
    return json.loads(json.dumps(asdict(config)))


def same_config(saved: dict | None, config: SyntheticConfig) -> bool:
    """Whether a results file's or epoch state's config is `config` (fields it predates at their old values)."""
    return saved is not None and config_as_saved(config_from_saved(saved)) == config_as_saved(config)


def load_checkpoint(path: Path | None, config: SyntheticConfig) -> list[dict]:
    """Finished runs from an earlier, interrupted call with the same config (none if there is no checkpoint)."""
    if path is None or not path.is_file():
        return []
    saved = json.loads(path.read_text(encoding="utf-8"))
    if not same_config(saved.get("config"), config):
        raise ValueError(
            f"{path} holds runs of a different configuration. Delete it (or pass --fresh) to start over, or use "
            "another output folder."
        )
    return saved["runs"]


def run_key(run: dict) -> tuple[str, str, float]:
    return run["task"], run["model"], run["learning_rate"]


def run_file_name(key: tuple[str, str, float]) -> str:
    """A file-name form of a run's key: ("ternary", "IHA P=2", 0.001) -> "ternary-IHAP2-lr0.001"."""
    task, model, learning_rate = key
    return f"{task}-{model}-lr{learning_rate:g}".replace(" ", "").replace("=", "")


def epoch_state_path(checkpoint: Path, key: tuple[str, str, float]) -> Path:
    """Where a run of `checkpoint` keeps its state between epochs (`train_one`'s `resume_path`), in a hidden
    `.epochs` folder beside it. A pickled state of an older release (`.pt`) there is refused, not unpickled."""
    path = checkpoint.parent / ".epochs" / f"{checkpoint.stem}.{run_file_name(key)}.safetensors"
    pickled = path.with_suffix(".pt")
    if pickled.exists():
        raise ValueError(
            f"{pickled} is an epoch state in the old pickle format, which is never unpickled: delete it to train "
            "that run from its start (the runs already finished are kept)."
        )
    return path


def weights_path(checkpoint: Path, key: tuple[str, str, float]) -> Path:
    """Where a finished run of `checkpoint` keeps its best weights: `weights/<run>.safetensors` beside it."""
    return checkpoint.parent / "weights" / f"{run_file_name(key)}.safetensors"


def epoch_states(checkpoint: Path) -> list[Path]:
    """The epoch states of `checkpoint`'s unfinished runs (`epoch_state_path`)."""
    return sorted((checkpoint.parent / ".epochs").glob(f"{checkpoint.stem}.*.safetensors"))


def runs_in_progress(config: SyntheticConfig, checkpoint: Path) -> list[dict]:
    """The runs of `config` that are being trained (or were left unfinished) beside `checkpoint`, as far as they got:
    from each one's epoch state (`epoch_state_path`), its task, model, learning rate, seed, epochs run, best
    validation accuracy and its epoch, epochs since a gain, seconds and per-epoch history (the weights are not
    returned). A run already in `checkpoint` is finished, even if its state is still there (a process stopped
    between saving the result and deleting the state)."""
    finished = {run_key(run) for run in load_checkpoint(checkpoint, config)}
    progress = []
    for task in config.tasks:
        for name, _, _ in model_variants(config):
            for learning_rate in config.learning_rates:
                key = (task, name, learning_rate)
                if key in finished:
                    continue
                # States are replaced atomically (`save_epoch_state`): a file read while its run trains is whole,
                # but it is deleted when the run finishes, which may happen between the listing and the reading.
                try:
                    state = load_epoch_state(epoch_state_path(checkpoint, key), with_tensors=False)
                except FileNotFoundError:
                    continue
                if not same_config(state["config"], config):
                    raise ValueError(
                        f"{epoch_state_path(checkpoint, key)} holds an unfinished run of another configuration: give "
                        "the preset and settings that made it."
                    )
                progress.append(
                    {
                        "task": task,
                        "model": name,
                        "learning_rate": learning_rate,
                        "seed": config.seed,
                        "epochs_run": len(state["history"]),
                        "best_epoch": state["best_epoch"],
                        "val_accuracy": state["best_accuracy"],
                        "epochs_without_gain": state["epochs_without_gain"],
                        "train_seconds": state["seconds"],
                        "history": state["history"],
                    }
                )
    return progress


def lock_path(checkpoint: Path, name: str) -> Path:
    """A lock file beside `checkpoint`, in a hidden `.locks` folder (the files stay; they are empty)."""
    return checkpoint.parent / ".locks" / f"{checkpoint.name}.{name}.lock"


@contextmanager
def claim(checkpoint: Path | None, key: tuple[str, str, float], wait: bool) -> Iterator[bool]:
    """Hold the run `key` of `checkpoint` for this process while the block trains it, so that another process
    running the same comparison trains something else. Yields False when another process holds it and `wait` is
    False; with `wait`, blocks until that process lets go (it has finished the run, or died).
    """
    if checkpoint is None:
        yield True
        return
    path = lock_path(checkpoint, run_file_name(key))
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=-1 if wait else 0)
    try:
        lock.acquire()
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def save_run(checkpoint: Path, config: SyntheticConfig, run: dict) -> list[dict]:
    """Add a finished run to the checkpoint, merged with what other processes wrote there meanwhile; returns the
    checkpoint's runs."""
    with FileLock(lock_path(checkpoint, "write")):
        runs = [saved for saved in load_checkpoint(checkpoint, config) if run_key(saved) != run_key(run)]
        runs.append(run)
        write_json_atomic({"config": asdict(config), "runs": runs}, checkpoint)
    return runs
