"""Where a command's model comes from: an existing local folder or a Hugging Face Hub id, checked before any loading.

Every command that takes a model (`iha convert`, `demo`, `sft`, `eval`, `serve`, `chat-template`, `card`, `push`,
`ab`) checks it here first, so that a folder that does not exist is reported as such, in one line, rather than as
whatever the loader makes of it (huggingface_hub reads `./my-model` as a malformed repository id).
"""

import os
import re
from pathlib import Path


def looks_like_hub_id(source: str) -> bool:
    """`org/name`, as the Hub names repositories (a bare `name` is taken for a local folder)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", source)) and not source.startswith((".", "/"))


def check_model_source(source: str | os.PathLike, *, hub: bool = True) -> str:
    """`source` as given, once it names an existing local folder or (with `hub`) looks like a Hub id; otherwise a
    ValueError of one line: the folder does not exist, or is a file.
    """
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return text
    if path.exists():
        raise ValueError(f"{text} is a file: give the model folder that holds config.json{' or a Hub id' * hub}.")
    # Written as a path: `./x`, `/x`, `~/x`, `a/b/c`, or `runs/x` beside an existing `runs/` (a typo in a run's name
    # should not send the command to the Hub, nor be reported as a bad Hub id).
    parent_exists = "/" in text and Path(text).parent.is_dir()
    written_as_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or parent_exists
    if hub and looks_like_hub_id(text) and not written_as_path:
        return text
    hub_note = " (nor is it a Hub id like 'org/name')" if hub and not written_as_path else ""
    raise ValueError(f"The folder {text} does not exist{hub_note}.")


__all__ = ["check_model_source", "looks_like_hub_id"]
