"""Writing files so that an interrupted or failing run never leaves a half-written one behind.

Every writer here writes a temporary file in the destination's own folder and renames it over the destination
only once it is complete (a rename within one filesystem is atomic); on any error the temporary file is removed
and whatever was at the destination before is left untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_destination(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it to `path` when the block succeeds, delete it if it fails.

    The temporary name keeps the destination's suffix, so writers that infer a format from the name (matplotlib's
    `savefig`) behave as they would on the destination itself.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(handle)
    temporary = Path(temporary_name)
    try:
        yield temporary
        # mkstemp creates the file readable by its owner only: give it the mode a new file gets (the user's umask).
        os.chmod(temporary, default_mode(executable=False))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def current_umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it: put it back at once
    os.umask(umask)
    return umask


def default_mode(executable: bool) -> int:
    """The mode `open()` / `mkdir` give a new file (0o666) or folder / executable (0o777) under the user's umask."""
    return (0o777 if executable else 0o666) & ~current_umask()


def give_default_modes(folder: str | os.PathLike) -> None:
    """Give every file and folder under `folder` the mode a new one gets under the user's umask (executables stay
    executable). Writers that stage through mkstemp or mkdtemp, transformers' `save_pretrained` among them, leave
    files and folders readable by their owner only; an output folder is meant to be shared and uploaded."""
    file_mode, folder_mode = default_mode(executable=False), default_mode(executable=True)
    for root, folders, files in os.walk(folder):
        for name in folders:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), folder_mode)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, folder_mode if os.stat(path).st_mode & 0o111 else file_mode)


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    with atomic_destination(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(data, path: str | os.PathLike, default=None) -> Path:
    """Indented, UTF-8 JSON with a final newline. Numpy and torch scalars are written as plain numbers; `default`
    converts anything else `json` cannot (as in `json.dumps`)."""
    return write_text_atomic(
        json.dumps(data, indent=2, ensure_ascii=False, default=lambda value: plain_scalar(value, default)) + "\n", path
    )


def plain_scalar(value, default=None):
    """A numpy / torch scalar as the Python number it holds; anything else through `default` (TypeError without)."""
    if hasattr(value, "item"):
        return value.item()
    if default is not None:
        return default(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def write_jsonl_atomic(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """One JSON object a line; `rows` may be a generator (it is consumed while writing, never held in memory)."""
    with atomic_destination(path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return Path(path)


def save_figure_atomic(figure, path: str | os.PathLike, dpi: int = 110) -> Path:
    """`figure.savefig` through a temporary file (format from the destination's suffix)."""
    with atomic_destination(path) as temporary:
        figure.savefig(temporary, dpi=dpi)
    return Path(path)


@contextmanager
def saved_figure(path: str | os.PathLike, dpi: int = 110, **subplots) -> Iterator[tuple]:
    """A new matplotlib figure and its axes (`figsize` and the rest of `Figure.subplots`' arguments) to draw on in the block; when the block
    ends the figure is laid out (`tight_layout`) and saved to `path` with `save_figure_atomic`.

    The figure is made without pyplot: no backend is chosen or switched (a notebook keeps its own), no display is
    needed, and nothing keeps the figure alive afterwards. matplotlib is imported here, when a figure is drawn, so
    that the modules that plot stay light to import.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=subplots.pop("figsize", None))
    axes = figure.subplots(**subplots)
    yield figure, axes
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=dpi)
