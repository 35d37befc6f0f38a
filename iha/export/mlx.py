"""The MLX model file in an IHA folder: `iha export mlx FOLDER` copies `iha/models/mlx/modeling_iha_mlx.py` next to
the weights and names it in config.json (`model_file`), which stock mlx-lm reads with `--trust-remote-code`
(`trust_remote_code=True` in `mlx_lm.load`). transformers ignores the key, so the folder loads as before. The MLX
file reads every IHA field from config.json, without defaults of its own: the export writes what the folder's config
means for every field (`IHAConfig`'s value: `layer_iha.FIELD_DEFAULTS` for a missing field, the attention types the
config class fills in when `attention_types` is missing)."""

import json
import shutil
from pathlib import Path

from ..models.iha.configuration_iha import IHAConfig
from ..models.iha.layer_iha import FIELD_DEFAULTS
from .folders import read_iha_config


MLX_MODEL_FILE = "modeling_iha_mlx.py"
MLX_MODEL_SOURCE = Path(__file__).resolve().parent.parent / "models" / "mlx" / MLX_MODEL_FILE


GEMMA3_REFUSAL = (
    "Gemma 3 IHA folders do not run on MLX yet: the MLX model file writes the Llama-family block, not Gemma "
    "3's (four norms per layer, scaled embeddings, a RoPE base per layer type); serve them with transformers "
    "or vLLM."
)


def add_mlx_model_file(folder: str | Path) -> Path:
    """Copy the MLX model file into `folder` and name it in its config.json; returns the file's path."""
    folder = Path(folder)
    config = read_iha_config(folder, GEMMA3_REFUSAL)
    target = folder / MLX_MODEL_FILE
    shutil.copyfile(MLX_MODEL_SOURCE, target)
    resolved = IHAConfig.from_dict(config)  # read_iha_config checked that it loads
    complete = {**config, **{name: getattr(resolved, name) for name in FIELD_DEFAULTS}, "model_file": MLX_MODEL_FILE}
    if complete != config:
        (folder / "config.json").write_text(json.dumps(complete, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return target


__all__ = ["MLX_MODEL_FILE", "add_mlx_model_file"]
