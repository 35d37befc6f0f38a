"""IHA folders for runtimes other than this package's transformers classes.

- `llama.py`: a single-pseudo-head (P = 1) IHA folder folded into a stock Llama / Mistral / Qwen2 / SmolLM3 folder
  (`iha export llama FOLDER OUT`): the mixing and the collapse become part of the projections, so the folder runs
  wherever the source architecture runs, with no IHA code at all.
- `mlx.py`: the MLX model file added to an IHA folder (`iha export mlx FOLDER`), read by stock mlx-lm with
  `--trust-remote-code`.
"""

from .errors import ExportError
from .llama import export_llama


__all__ = ["ExportError", "export_llama"]
