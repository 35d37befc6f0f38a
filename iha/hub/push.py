"""Uploading an IHA folder (converted or fine-tuned) to the Hugging Face Hub: `iha push FOLDER USER/NAME`.

The upload is one commit made with huggingface_hub (`create_repo` + `create_commit`). The model card that goes up
names the repository in its "How to load" section; the card in your folder is left as it is, so a failed upload
changes nothing on disk and the folder keeps loading from its own path.

```python
>>> from iha.hub.push import push_to_hub
>>> push_to_hub("smollm2-iha", "me/smollm2-iha")
```
"""

import json
import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .. import IHA_MODEL_TYPES
from ..utils.errors import WorkFailedError
from ..utils.model_source import check_model_source
from .model_card import MODEL_CARD_NAME, how_to_load_section, read_model_card, render_model_card


class HubUploadError(WorkFailedError):
    """The upload failed; the message says why and how to retry. (A folder that cannot be uploaded is a ValueError.)"""


def check_iha_folder(folder: Path) -> None:
    """Refuse anything but a folder whose config.json (readable JSON) names an IHA model type ('iha', ...)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or config.get("model_type") not in IHA_MODEL_TYPES:
        raise ValueError(
            f"{folder} is not an IHA checkpoint folder (no config.json with model_type "
            f"{' or '.join(map(repr, IHA_MODEL_TYPES))})."
        )


def check_push_target(repo_id: str, flag: str = "--push_to_hub") -> None:
    """Refuse, before the work whose result is to be uploaded (a conversion), an upload that cannot succeed from
    here: a repository id the Hub does not accept, or huggingface_hub told to stay offline (HF_HUB_OFFLINE)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"{flag} {repo_id} is not a Hub repository id ('user/name'): {error}") from None
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"{flag} needs the Hub, and HF_HUB_OFFLINE is set: unset it, or leave {flag} out and upload the folder "
            "later with `iha push FOLDER REPO_ID`"
        )


def card_for_repo(folder: Path, repo_id: str) -> str | None:
    """The folder's model card with its "How to load" section naming `repo_id` (None when there is no card)."""
    card = read_model_card(folder)
    if card is None:
        return None
    card.sections["How to load"] = how_to_load_section(repo_id)
    return render_model_card(card.sections, title=card.title, metadata=card.metadata, intro=card.intro)


def is_training_state(relative: Path) -> bool:
    """A training run's `checkpoint-N` folders (optimizer and RNG state, pickles among them, for resuming) and the
    Trainer's pickled `training_args.bin` (`trl sft` writes one): neither is part of the model."""
    return relative.parts[0].startswith("checkpoint-") or relative.name == "training_args.bin"


def upload_operations(folder: str | os.PathLike, repo_id: str) -> list:
    """The files of one upload commit: every file of `folder` but hidden ones and training state
    (`is_training_state`), the card rewritten for `repo_id`."""

    folder = Path(folder)
    card_text = card_for_repo(folder, repo_id)
    operations = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts) or is_training_state(relative):
            continue
        if relative.as_posix() == MODEL_CARD_NAME and card_text is not None:
            content = card_text.encode("utf-8")  # the rewritten copy; the file on disk stays as it is
        else:
            content = str(path)
        operations.append(CommitOperationAdd(path_in_repo=relative.as_posix(), path_or_fileobj=content))
    return operations


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    retry_command: str = "iha push",
) -> str:
    """Upload an IHA folder to the Hub in one commit; returns the commit URL the Hub gives (or names the repository).

    The uploaded model card loads the model from `repo_id`; the folder itself is not modified. On failure the
    error says to retry with `retry_command FOLDER REPO_ID`.
    """
    folder = Path(check_model_source(folder, hub=False))
    check_iha_folder(folder)

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.create_commit(
            repo_id=repo_id,
            repo_type="model",
            operations=upload_operations(folder, repo_id),
            revision=revision,
            commit_message=commit_message or "Upload IHA checkpoint with the iha package",
        )
    except Exception as error:
        raise HubUploadError(
            f"Uploading {folder} to the Hub repository {repo_id} failed: {error}. The folder is unchanged; retry "
            f"with `{retry_command} {folder} {repo_id}` once the Hub is reachable and you are logged in "
            "(`hf auth login`)."
        ) from error
    return str(getattr(commit, "commit_url", None) or f"the Hub repository {repo_id}")


__all__ = ["HubUploadError", "card_for_repo", "check_push_target", "push_to_hub", "upload_operations"]
