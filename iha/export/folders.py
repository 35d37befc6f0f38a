"""What every export reads first: the IHA folder's config, refused where it is not an IHA folder or is one the target
cannot take."""

import json
from pathlib import Path

from ..models.iha.configuration_iha import IHAConfig
from .errors import ExportError


def read_iha_config(folder: Path, gemma3_refusal: str) -> dict:
    """`folder`'s config.json as a dict. A folder without one, a folder of another model type and an IHA Gemma 3
    folder (refused with `gemma3_refusal`, which says why the target cannot take it) raise ExportError."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{folder} has no config.json: give the folder of a converted or trained IHA model.")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type == "iha_gemma3":
        raise ExportError(gemma3_refusal)
    if model_type != "iha":
        raise ExportError(f"{folder} is not an IHA folder (model_type {model_type!r}, expected 'iha').")
    try:  # what transformers would refuse on load (a retired window, inconsistent fields) is refused here too
        IHAConfig.from_dict(config)
    except ValueError as error:
        raise ExportError(f"{folder}: {error}") from None
    return config
