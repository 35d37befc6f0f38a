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
"""Convert Llama-style checkpoints (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2) to Interleaved Head Attention.

By default the converted model computes what the source computed (design section 3): the weights are copied
unchanged, every attention layer becomes an IHA layer with the source's own window, the head mixing starts at
identity, positions are shared by the P pseudo-tokens of a token, the mask is the paper's flat causal mask and
the collapse selects the last pseudo-head. Other settings (virtual positions, the paper's hybrid layout, a
different collapse init, a narrower dtype) change the function: the converter says so and measures by how much.

Three entry points:

- `llama_to_iha(model, **options)`: an already loaded model, in memory.
- `convert_checkpoint(source, output_dir, **options)`: a local folder or Hub id to a Hub-ready folder, streaming
  the weights tensor by tensor (never two models in memory), verified against the source, written atomically.
- `iha-convert SRC DST [options]` (`main`), and `iha-convert push FOLDER REPO_ID`.
"""

import argparse
import copy
import ctypes
import errno
import gc
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arguments import ArgumentParser
from .atomic_files import write_text_atomic
from .atomic_folders import run_command, staged_folder
from .configuration_iha import (
    IHA_FULL,
    IHA_SLIDING,
    STANDARD_FULL,
    STANDARD_SLIDING,
    IHAConfig,
    is_iha_layer,
    is_sliding_layer,
    paper_hybrid_layout,
)
from .model_card import DEFAULT_TAGS, how_to_load_section, read_model_card, render_model_card
from .modeling_iha import IHAForCausalLM, IHAHeadMixing


logger = logging.getLogger(__name__)

# Architecture name in config.json -> model_type it must come with.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_DESCRIPTION = (
    "LlamaForCausalLM (Llama 2, Llama 3 incl. llama3 rope scaling, SmolLM, SmolLM2), "
    "MistralForCausalLM (with or without sliding window), Qwen2ForCausalLM"
)

# The bar for "exact" in fp32; see `verify_conversion` for how deep models are judged.
EXACT_ATOL = 1e-5
# An exact conversion may differ from the source by fp32 rounding only: allow this multiple of the source model's
# own rounding noise (its logits under sdpa vs eager attention), which grows with depth (about 1e-4 for 30 layers).
NOISE_MULTIPLE = 4.0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# Casts that keep every value exactly.
LOSSLESS_CASTS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}
# Buffers some older checkpoints saved; the model recomputes them.
IGNORED_SOURCE_SUFFIXES = (".rotary_emb.inv_freq",)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Files that travel with the weights under the source's license terms.
LICENSE_FILE_PATTERNS = ("LICENSE*", "NOTICE*", "USE_POLICY.md")
HUB_DOWNLOAD_PATTERNS = [
    "config.json",
    "generation_config.json",
    # transformers' own names only: some repos also hold other formats (e.g. Mistral's consolidated.safetensors).
    "model*.safetensors",
    "model.safetensors.index.json",
    "README.md",
    *LICENSE_FILE_PATTERNS,
    *TOKENIZER_FILES,
]
PICKLE_DOWNLOAD_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
CODE_FILES = ("configuration_iha.py", "modeling_iha.py", "masking_iha.py", "attention_iha.py", "compat_iha.py")
REPORT_NAME = "iha_conversion.json"

VERIFICATION_PROMPTS = (
    "What is the capital of France?",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Write a short poem about the sea.",
)
RANDOM_VERIFICATION_LENGTHS = (48, 37, 20)
# Settings that change the function are also measured on one long input of this many tokens, or twice the smallest
# window they change if that is longer (the change starts past the window); at most the model's positions and
# MAX_LONG_VERIFICATION_TOKENS (the logits of a long input take length x vocabulary floats, twice).
LONG_VERIFICATION_TOKENS = 512
MAX_LONG_VERIFICATION_TOKENS = 4096


class ConversionError(Exception):
    """A conversion that cannot go ahead: bad input, unsupported checkpoint, missing tensors, ..."""


class UnsupportedArchitectureError(ConversionError):
    pass


class VerificationFailedError(ConversionError):
    """The converted model does not compute what it should. Carries the report."""

    def __init__(self, message: str, report: "ConversionReport"):
        super().__init__(message)
        self.report = report


# ---------------------------------------------------------------------------------------------------------------
# Planning: source config -> IHAConfig, and what (if anything) the settings change
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ConversionPlan:
    """The IHA config to build and the reasons, if any, why it will not compute exactly what the source did."""

    config: IHAConfig
    architecture: str
    source_windows: list[int | None]
    function_changes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.function_changes


def source_architecture(source_config) -> str:
    """The supported architecture of `source_config`, or a clear error listing the supported ones."""
    architectures = list(getattr(source_config, "architectures", None) or [])
    model_type = getattr(source_config, "model_type", None)
    if model_type == "iha":
        raise UnsupportedArchitectureError("The source is already an IHA checkpoint (model_type 'iha'); nothing to do.")
    supported = [name for name in architectures if name in SUPPORTED_ARCHITECTURES]
    if supported:
        architecture = supported[0]
        if SUPPORTED_ARCHITECTURES[architecture] != model_type:
            raise UnsupportedArchitectureError(
                f"config.json names architecture {architecture} but model_type {model_type!r} "
                f"(expected {SUPPORTED_ARCHITECTURES[architecture]!r}); the checkpoint looks inconsistent."
            )
        return architecture
    if not architectures:
        for architecture, supported_type in SUPPORTED_ARCHITECTURES.items():
            if supported_type == model_type:
                return architecture
    found = ", ".join(architectures) if architectures else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"Unsupported architecture: {found}. iha converts causal language models of these architectures: "
        f"{SUPPORTED_DESCRIPTION}."
    )


def source_attention_windows(source_config, architecture: str) -> list[int | None]:
    """The window (in tokens) each layer of the source model attends over; None for full attention.

    Read the way the source modeling code reads it: Llama never slides; Mistral slides every layer when
    `sliding_window` is set; Qwen2 slides the layers its `layer_types` mark "sliding_attention" (derived from
    `use_sliding_window` / `max_window_layers` when absent).
    """
    num_layers = source_config.num_hidden_layers
    window = getattr(source_config, "sliding_window", None)
    if architecture == "LlamaForCausalLM":
        return [None] * num_layers
    if architecture == "MistralForCausalLM":
        return [window] * num_layers
    layer_types = getattr(source_config, "layer_types", None) or ["full_attention"] * num_layers
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def parse_layer_spec(layers: str | Sequence[int], num_layers: int) -> str | list[int]:
    """`"all"`, `"hybrid"`, or layer indices (`"0,1,5"` or a list) -> validated form."""
    if isinstance(layers, str):
        spec = layers.strip().lower()
        if spec in ("all", "hybrid"):
            return spec
        try:
            indices = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise ConversionError(
                f"--layers must be 'all', 'hybrid' or comma-separated layer indices like '0,1,5', got {layers!r}."
            ) from None
    else:
        indices = [int(index) for index in layers]
    if not indices:
        raise ConversionError("--layers lists no layer: give at least one index, or 'all' / 'hybrid'.")
    out_of_range = [index for index in indices if not 0 <= index < num_layers]
    if out_of_range:
        raise ConversionError(f"--layers has indices {out_of_range} outside the model's layers 0..{num_layers - 1}.")
    if len(set(indices)) != len(indices):
        raise ConversionError(f"--layers lists a layer twice: {indices}.")
    return sorted(indices)


def describe_layers(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs, start = [], None
    for position, index in enumerate(indices):
        if start is None:
            start = index
        if position + 1 == len(indices) or indices[position + 1] != index + 1:
            runs.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ", ".join(runs)


def describe_window(window: int | None) -> str:
    return "all earlier tokens" if window is None else f"the last {window} tokens"


def plan_conversion(
    source_config,
    *,
    num_pseudo_heads: int = 2,
    layers: str | Sequence[int] = "all",
    training_length: int | None = None,
    mask_mode: str = "flat_causal",
    position_mode: str = "shared",
    collapse_mode: str = "per_head",
    collapse_init: str = "last",
) -> ConversionPlan:
    """Map a LlamaConfig / MistralConfig / Qwen2Config to an IHAConfig and list what the settings change."""
    architecture = source_architecture(source_config)
    num_layers = source_config.num_hidden_layers
    source_windows = source_attention_windows(source_config, architecture)
    sliding_windows = {window for window in source_windows if window is not None}
    if len(sliding_windows) > 1:
        raise ConversionError(f"The source uses several sliding windows {sorted(sliding_windows)}; IHA has one.")
    source_window = next(iter(sliding_windows), None)

    layer_spec = parse_layer_spec(layers, num_layers)
    if layer_spec == "hybrid":
        if training_length is None:
            training_length = source_config.max_position_embeddings
            logger.info(f"--layers hybrid: window from --training-length {training_length} (max_position_embeddings).")
        layout = paper_hybrid_layout(num_layers, num_pseudo_heads, training_length)
        attention_types, sliding_window = layout["attention_types"], layout["sliding_window"]
    else:
        iha_layers = set(range(num_layers)) if layer_spec == "all" else set(layer_spec)
        attention_types = []
        for layer_idx, window in enumerate(source_windows):
            if layer_idx in iha_layers:
                attention_types.append(IHA_FULL if window is None else IHA_SLIDING)
            else:
                attention_types.append(STANDARD_FULL if window is None else STANDARD_SLIDING)
        sliding_window = source_window

    if architecture == "Qwen2ForCausalLM":
        qkv_bias, o_proj_bias, mlp_bias = True, False, False
    elif architecture == "MistralForCausalLM":
        qkv_bias, o_proj_bias, mlp_bias = False, False, False
    else:
        qkv_bias = o_proj_bias = bool(getattr(source_config, "attention_bias", False))
        mlp_bias = bool(getattr(source_config, "mlp_bias", False))

    copied_fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "attention_dropout",
    )
    fields = {name: getattr(source_config, name) for name in copied_fields if hasattr(source_config, name)}
    head_dim = (
        getattr(source_config, "head_dim", None) or source_config.hidden_size // source_config.num_attention_heads
    )
    config = IHAConfig(
        **fields,
        head_dim=head_dim,
        rope_parameters=copy.deepcopy(source_config.rope_parameters),
        attention_bias=qkv_bias and o_proj_bias,
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        num_pseudo_heads=num_pseudo_heads,
        attention_types=attention_types,
        sliding_window=sliding_window,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
        iha_collapse_mode=collapse_mode,
        iha_collapse_init=collapse_init,
    )
    config.architectures = ["IHAForCausalLM"]
    source_dtype = getattr(source_config, "dtype", None)
    if source_dtype is not None:
        config.dtype = source_dtype

    changes = []
    target_windows = [config.sliding_window if is_sliding_layer(t) else None for t in config.attention_types]
    window_changes: dict[tuple, list[int]] = {}
    for layer_idx, (before, after) in enumerate(zip(source_windows, target_windows)):
        if before != after:
            window_changes.setdefault((before, after), []).append(layer_idx)
    for (before, after), indices in window_changes.items():
        changes.append(
            f"layers {describe_layers(indices)} attend to {describe_window(after)} (the source: {describe_window(before)})"
        )
    if config.iha_layer_indices and num_pseudo_heads > 1:
        if position_mode == "virtual":
            changes.append(
                "virtual positions: pseudo-token (n, p) sits at RoPE position n*P+p, which stretches every relative "
                "distance by P (--position-mode shared keeps the source's positions)"
            )
        if mask_mode == "flat_causal" and collapse_init != "last":
            changes.append(
                f"collapse init {collapse_init!r} with the flat causal mask: pseudo-heads before the last do not see "
                "their own token's later pseudo-keys, so the current token is under-weighted "
                "(--collapse-init last, or --mask-mode token_causal, keep the function)"
            )
    return ConversionPlan(
        config=config, architecture=architecture, source_windows=source_windows, function_changes=changes
    )


def dtype_changes(casts: set[tuple[torch.dtype, torch.dtype]]) -> list[str]:
    lossy = sorted({(str(a), str(b)) for a, b in casts if a != b and (a, b) not in LOSSLESS_CASTS})
    return [f"weights are rounded from {a.removeprefix('torch.')} to {b.removeprefix('torch.')}" for a, b in lossy]


# ---------------------------------------------------------------------------------------------------------------
# In memory
# ---------------------------------------------------------------------------------------------------------------


def llama_to_iha(model, *, share_weights: bool = False, **iha_options) -> IHAForCausalLM:
    """Convert a loaded LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM to an `IHAForCausalLM`.

    `iha_options` are those of `plan_conversion` (num_pseudo_heads, layers, training_length, mask_mode,
    position_mode, collapse_mode, collapse_init). With their defaults the result computes the same logits as
    `model` (up to fp32 rounding). The new model gets copies of the weights, or, with `share_weights=True`, the
    very same tensors (no extra memory; training one then changes the other). Settings that change the function
    are logged as a warning; see `plan_conversion(...).function_changes`.
    """
    plan = plan_conversion(model.config, **iha_options)
    for change in plan.function_changes:
        logger.warning(f"This conversion changes what the model computes: {change}.")
    config = plan.config
    config._attn_implementation = model.config._attn_implementation
    config.dtype = model.dtype

    # Build on the meta device and take the source tensors in place: no random init, no second full model.
    with torch.device("meta"):
        iha_model = IHAForCausalLM(config)
    state_dict = {
        name: tensor if share_weights else tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if not name.endswith(IGNORED_SOURCE_SUFFIXES) and not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    result = iha_model.load_state_dict(state_dict, strict=False, assign=True)
    expected_missing = {name for name in iha_model.state_dict() if ".head_mixing." in name}
    if config.tie_word_embeddings:
        expected_missing.add("lm_head.weight")
    unexpected_missing = sorted(set(result.missing_keys) - expected_missing)
    if unexpected_missing or result.unexpected_keys:
        raise ConversionError(
            f"The source model's weights do not fit the IHA model: missing {unexpected_missing}, "
            f"unexpected {sorted(result.unexpected_keys)}."
        )
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    for module in iha_model.modules():
        if isinstance(module, IHAHeadMixing):
            for name, value in module.identity_tensors().items():
                setattr(module, name, torch.nn.Parameter(value.to(device=device, dtype=dtype).contiguous()))
    # Non-persistent buffers (RoPE inverse frequencies) are not in the state dict: take the source's, computed
    # from the same rope parameters.
    source_buffers = dict(model.named_buffers())
    for name, buffer in list(iha_model.named_buffers()):
        if buffer.is_meta:
            if name not in source_buffers:
                raise ConversionError(f"The IHA model's buffer {name} has no counterpart in the source model.")
            module_name, _, buffer_name = name.rpartition(".")
            iha_model.get_submodule(module_name)._buffers[buffer_name] = source_buffers[name].clone()
    if config.tie_word_embeddings:
        iha_model.tie_weights()
    iha_model.generation_config = copy.deepcopy(model.generation_config)
    iha_model.train(model.training)
    return iha_model


# ---------------------------------------------------------------------------------------------------------------
# Reading the source checkpoint
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SourceTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    reader: "SafetensorsReader | PickleReader"


class SafetensorsReader:
    """Reads tensors from one .safetensors file one at a time with plain reads (no mmap of the whole file)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as file:
                header_size = int.from_bytes(file.read(8), "little")
                if not 2 <= header_size <= path.stat().st_size - 8:
                    raise ValueError(f"header size {header_size}")
                header = json.loads(file.read(header_size))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
            raise ConversionError(f"{path} is not a valid safetensors file ({error}).") from None
        self.data_start = 8 + header_size
        data_size = path.stat().st_size - self.data_start
        self.entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if not self.valid_entry(entry):
                raise ConversionError(
                    f"{path} is not a valid safetensors file: the header entry of tensor {name} is "
                    f'{repr(entry)[:100]}, not {{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}}.'
                )
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ConversionError(
                    f"{path.name}: tensor {name} has dtype {entry['dtype']}, which iha cannot convert."
                )
            if entry["data_offsets"][1] > data_size:
                raise ConversionError(
                    f"{path} is truncated: tensor {name} ends at byte {entry['data_offsets'][1]} of the data, but the "
                    f"file holds {data_size} bytes of data. Download or copy the checkpoint again."
                )
            self.entries[name] = (SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), *entry["data_offsets"])
        self.file = open(path, "rb")  # kept open for the tensor reads; closed by `close`

    @staticmethod
    def valid_entry(entry) -> bool:
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            return False
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(size, int) and size >= 0 for size in shape):
            return False
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
            return False
        return 0 <= offsets[0] <= offsets[1]

    def tensors(self) -> list[SourceTensor]:
        return [SourceTensor(name, dtype, shape, self) for name, (dtype, shape, _, _) in self.entries.items()]

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        self.file.seek(self.data_start + begin)
        data = bytearray(self.file.read(end - begin))
        if len(data) != end - begin:
            raise ConversionError(f"{self.path} is truncated: tensor {name} is incomplete.")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def copy_raw(self, name: str, out_file, chunk_size: int = 1 << 24) -> None:
        """Copy the tensor's bytes unchanged (same dtype in and out) to the unbuffered `out_file`.

        No tensor is built: the kernel copies file to file where it can (copy_file_range), else 16 MiB chunks.
        """
        _, _, begin, end = self.entries[name]
        offset, remaining = self.data_start + begin, end - begin
        if hasattr(os, "copy_file_range"):
            try:
                while remaining:
                    copied = os.copy_file_range(self.file.fileno(), out_file.fileno(), remaining, offset)
                    if copied == 0:
                        raise ConversionError(f"{self.path} is truncated: tensor {name} is incomplete.")
                    offset, remaining = offset + copied, remaining - copied
                return
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
        self.file.seek(offset)
        while remaining:
            chunk = self.file.read(min(chunk_size, remaining))
            if not chunk:
                raise ConversionError(f"{self.path} is truncated: tensor {name} is incomplete.")
            write_all(out_file, chunk)
            remaining -= len(chunk)

    def close(self):
        self.file.close()


class PickleReader:
    """Reads a PyTorch .bin file with `torch.load(weights_only=True)`: tensors only, no arbitrary objects."""

    def __init__(self, path: Path):
        self.path = path
        try:
            try:
                self.state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                # Files in the legacy (pre-zip) format cannot be memory-mapped.
                self.state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConversionError(
                f"Could not read {path.name} with torch.load(weights_only=True): {error}. The file holds more than "
                "tensors, or is damaged; iha does not load arbitrary pickled objects."
            ) from error
        if not isinstance(self.state_dict, dict):
            raise ConversionError(f"{path.name} does not hold a state dict (got {type(self.state_dict).__name__}).")

    def tensors(self) -> list[SourceTensor]:
        return [
            SourceTensor(name, tensor.dtype, tuple(tensor.shape), self)
            for name, tensor in self.state_dict.items()
            if isinstance(tensor, torch.Tensor)
        ]

    def read(self, name: str) -> torch.Tensor:
        return self.state_dict[name]

    def close(self):
        self.state_dict = None


def find_weight_files(folder: Path, allow_pickle: bool) -> tuple[str, list[Path]]:
    """("safetensors" | "pickle", files) for a transformers checkpoint folder; refuses pickle unless allowed."""
    for kind, index_name, single_name in (
        ("safetensors", "model.safetensors.index.json", "model.safetensors"),
        ("pickle", "pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (folder / index_name).is_file():
            try:
                weight_map = json.loads((folder / index_name).read_text(encoding="utf-8"))["weight_map"]
                files = [folder / name for name in sorted(set(weight_map.values()))]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConversionError(
                    f"{folder / index_name} is not a valid weight index (JSON with a 'weight_map' from tensor names "
                    "to file names); the checkpoint looks damaged."
                ) from None
        elif (folder / single_name).is_file():
            files = [folder / single_name]
        else:
            continue
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ConversionError(f"{folder} lists weight files that are not there: {missing}.")
        if kind == "pickle" and not allow_pickle:
            raise ConversionError(
                f"{folder} has only pickle weights ({files[0].name}). Loading a pickle can run arbitrary code, so "
                "iha refuses it by default. If you trust this checkpoint, pass --allow-pickle (allow_pickle=True): "
                "it is then read with torch.load(weights_only=True), which loads tensors only."
            )
        return kind, files
    raise ConversionError(
        f"No weights found in {folder}: expected model.safetensors, model.safetensors.index.json (sharded), or, "
        "with --allow-pickle, pytorch_model.bin."
    )


def looks_like_hub_id(source: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", source)) and not source.startswith((".", "/"))


def resolve_source(
    source: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    allow_pickle: bool = False,
) -> tuple[Path, str | None]:
    """(local folder, Hub id or None): a local folder as is; a Hub id is downloaded with huggingface_hub's
    `snapshot_download` (config, tokenizer, safetensors; pickle weights only with `allow_pickle`), which also
    serves it from the local Hugging Face cache when offline."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise ConversionError(f"{source} is a file; give the checkpoint folder (with config.json) or a Hub id.")
    source = str(source)
    if not looks_like_hub_id(source):
        raise ConversionError(f"{source} is neither an existing folder nor a Hub id like 'org/name'.")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def download(patterns):
        return Path(
            snapshot_download(source, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=patterns)
        )

    try:
        folder = download(HUB_DOWNLOAD_PATTERNS)
        has_safetensors = any(folder.glob("model*.safetensors"))
        if not has_safetensors and allow_pickle:
            folder = download(HUB_DOWNLOAD_PATTERNS + PICKLE_DOWNLOAD_PATTERNS)
    except LocalEntryNotFoundError as error:
        raise ConversionError(
            f"{source} is not a local folder, and the Hub cannot be reached to download it ({error}). Check the "
            "network and that HF_HUB_OFFLINE is not set, or pass a local folder."
        ) from error
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ConversionError(
            f"The Hub repository {source} was not found or is not accessible ({type(error).__name__}). Check the id; "
            "for private or gated models log in with `hf auth login` or pass --token."
        ) from error
    except RevisionNotFoundError as error:
        raise ConversionError(f"The Hub repository {source} has no revision {revision!r}.") from error
    except Exception as error:  # network and HTTP errors
        raise ConversionError(f"Downloading {source} from the Hub failed: {error}") from error
    if not (folder / "config.json").is_file():
        raise ConversionError(f"The Hub repository {source} has no config.json; it is not a transformers checkpoint.")
    if not has_safetensors and not allow_pickle:
        raise ConversionError(
            f"The Hub repository {source} has no safetensors weights. If it has pickle (.bin) weights and you trust "
            "it, pass --allow-pickle (allow_pickle=True): they are then read with torch.load(weights_only=True)."
        )
    return folder, source


# ---------------------------------------------------------------------------------------------------------------
# Writing the IHA checkpoint
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: SourceTensor | None = None
    value: torch.Tensor | None = None  # generated tensors (the head mixing at identity)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def parse_size(size: int | str) -> int:
    """5000000000, "5GB", "500MB", "2GiB" -> bytes (decimal units for KB/MB/GB as transformers reads them)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if not match:
        raise ConversionError(f"--max-shard-size must look like 5GB, 500MB or a number of bytes, got {size!r}.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    if number <= 0:
        raise ConversionError(f"--max-shard-size must be positive, got {size!r}.")
    factors = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    factors.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    return int(number * factors[unit])


def natural_key(name: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def plan_output_tensors(
    iha_config: IHAConfig, sources: dict[str, SourceTensor], dtype: torch.dtype | None
) -> tuple[list[OutputTensor], set[tuple[torch.dtype, torch.dtype]]]:
    """Every tensor of the IHA checkpoint with its source (or identity value); checks names and shapes.

    The expected names and shapes come from the IHA model itself, built on the meta device (no memory).
    Returns the tensors and the set of (source dtype, output dtype) casts for floating-point weights.
    """
    with torch.device("meta"):
        meta_model = IHAForCausalLM(iha_config)
    expected = {name: tuple(tensor.shape) for name, tensor in meta_model.state_dict().items()}
    if iha_config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ignored = {name for name in sources if name.endswith(IGNORED_SOURCE_SUFFIXES)}
    if iha_config.tie_word_embeddings and "lm_head.weight" in sources:
        ignored.add("lm_head.weight")  # tied: the model rebuilds it from the embedding

    generated_names = {name for name in expected if ".head_mixing." in name}
    missing = sorted(set(expected) - generated_names - set(sources), key=natural_key)
    unexpected = sorted(set(sources) - set(expected) - ignored, key=natural_key)
    if missing or unexpected:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " The config says tie_word_embeddings=false but the checkpoint has no lm_head.weight."
        raise ConversionError(
            f"The checkpoint's tensors do not match its config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
            + hint
        )
    mismatched = [
        f"{name}: {sources[name].shape} vs {shape}"
        for name, shape in expected.items()
        if name in sources and sources[name].shape != shape
    ]
    if mismatched:
        raise ConversionError(f"Tensor shapes do not match the config: {mismatched[:8]}.")

    embedding_dtype = sources["model.embed_tokens.weight"].dtype
    identity = IHAHeadMixing(
        iha_config.num_attention_heads,
        iha_config.num_key_value_heads,
        iha_config.num_pseudo_heads,
        collapse_mode=iha_config.iha_collapse_mode,
        collapse_init=iha_config.iha_collapse_init,
    ).identity_tensors()

    outputs, casts = [], set()
    for name in sorted(expected, key=natural_key):
        if name in generated_names:
            target_dtype = dtype or embedding_dtype
            value = identity[name.rpartition(".")[2]].to(target_dtype).contiguous()
            outputs.append(OutputTensor(name, target_dtype, tuple(value.shape), value=value))
            continue
        source = sources[name]
        target_dtype = dtype if (dtype is not None and source.dtype.is_floating_point) else source.dtype
        if source.dtype.is_floating_point:
            casts.add((source.dtype, target_dtype))
        outputs.append(OutputTensor(name, target_dtype, source.shape, source=source))
    return outputs, casts


def shard_tensors(tensors: list[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    """Fill shards in order up to `max_shard_bytes` (a tensor bigger than that gets a shard of its own)."""
    shards, current, current_bytes = [], [], 0
    for tensor in tensors:
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current:
        shards.append(current)
    return shards


def write_all(file, data) -> None:
    """Write every byte to an unbuffered file (a raw write may write only part of a large buffer)."""
    view = memoryview(data).cast("B")
    while view:
        written = file.write(view)
        view = view[written:]


def tensor_bytes(tensor: torch.Tensor):
    """A tensor's raw little-endian bytes as a buffer (works for bfloat16, which numpy cannot hold)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors_file(path: Path, tensors: list[OutputTensor], progress) -> None:
    """Write one .safetensors file tensor by tensor: the header first (all shapes are known), then the data."""
    header, offset = {}, 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    # Unbuffered: raw tensor copies go straight to the file descriptor, interleaved with our own writes.
    with open(path, "wb", buffering=0) as file:
        write_all(file, len(header_bytes).to_bytes(8, "little") + header_bytes)
        for tensor in tensors:
            source = tensor.source
            if source is None:
                write_all(file, tensor_bytes(tensor.value))
            elif source.dtype == tensor.dtype and isinstance(source.reader, SafetensorsReader):
                source.reader.copy_raw(source.name, file)
            else:
                write_all(file, tensor_bytes(source.reader.read(source.name).to(tensor.dtype)))
            progress.update(tensor.nbytes)


def write_weights(folder: Path, tensors: list[OutputTensor], max_shard_bytes: int, show_progress: bool) -> list[str]:
    """Write the safetensors shard(s), and the index when there is more than one. Returns the file names."""
    from tqdm.auto import tqdm

    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total_bytes = sum(tensor.nbytes for tensor in tensors)
    with tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="Writing IHA weights",
        disable=not show_progress,
    ) as progress:
        for name, shard in zip(names, shards):
            write_safetensors_file(folder / name, shard, progress)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {tensor.name: name for name, shard in zip(names, shards) for tensor in shard},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_config_and_code(folder: Path, config: IHAConfig) -> None:
    """config.json with `auto_map`, and the code files (CODE_FILES), so the folder loads without `iha`."""
    config = copy.deepcopy(config)
    config.auto_map = {
        "AutoConfig": "configuration_iha.IHAConfig",
        "AutoModel": "modeling_iha.IHAModel",
        "AutoModelForCausalLM": "modeling_iha.IHAForCausalLM",
    }
    config.save_pretrained(folder)
    package_dir = Path(__file__).resolve().parent
    for name in CODE_FILES:
        shutil.copyfile(package_dir / name, folder / name)


def pin_tokenizer_class(source_dir: Path, folder: Path) -> None:
    """Name the source's tokenizer class in the converted `tokenizer_config.json` where the source leaves it out.

    Without a `tokenizer_class`, `AutoTokenizer` picks the class from the model type in `config.json`: `llama`,
    `qwen2`, ... for the source, but `iha` (unknown to transformers) for the converted folder, which would then get
    a generic tokenizer instead of the source's. Naming the class the source resolves to keeps them the same.
    """
    from transformers import AutoTokenizer

    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if tokenizer_config.get("tokenizer_class"):
        return
    try:
        tokenizer_class = type(AutoTokenizer.from_pretrained(source_dir)).__name__
    except Exception as error:  # an unusable tokenizer stays as copied; verification reports on the weights anyway
        logger.warning(f"The tokenizer of {source_dir} does not load ({error}); copied as it is.")
        return
    tokenizer_config["tokenizer_class"] = tokenizer_class
    write_text_atomic(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", config_path)


def copy_source_files(source_dir: Path, folder: Path, source_config) -> None:
    """Tokenizer files (with the chat template), license files, and the generation config (made if absent)."""
    tokenizer_files = [name for name in TOKENIZER_FILES if (source_dir / name).is_file()]
    for name in tokenizer_files:
        shutil.copyfile(source_dir / name, folder / name)
    if not tokenizer_files:
        logger.warning(
            f"{source_dir} has no tokenizer files, so the converted folder has none either: copy the tokenizer in "
            "before using it with pipeline() or pushing it."
        )
    else:
        pin_tokenizer_class(source_dir, folder)
    for pattern in LICENSE_FILE_PATTERNS:
        for path in source_dir.glob(pattern):
            if path.is_file():
                shutil.copyfile(path, folder / path.name)
    if (source_dir / "generation_config.json").is_file():
        shutil.copyfile(source_dir / "generation_config.json", folder / "generation_config.json")
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(source_config).save_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class VerificationResult:
    max_abs_diff: float
    top1_agreement: float
    positions: int
    batch_shape: list[int]
    reference_noise: float  # the source's own fp32 rounding noise: its logits with sdpa vs eager attention
    tolerance: float | None  # None when the settings are not meant to be exact
    exact_expected: bool
    passed: bool
    message: str
    # The same figures for each input (and, for the long input, each half or each side of the window): where a
    # change that depends on the length shows, and where it does not.
    by_length: list[dict] = field(default_factory=list)


def verification_batch(tokenizer, vocab_size: int) -> dict[str, torch.Tensor]:
    """A fixed, left-padded batch: chat prompts when there is a tokenizer, seeded random tokens otherwise."""
    if tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is not None:
            if tokenizer.chat_template:
                texts = [
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                    )
                    for prompt in VERIFICATION_PROMPTS
                ]
            else:
                texts = list(VERIFICATION_PROMPTS)
            encoded = tokenizer(
                texts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template
            )
            if int(encoded["input_ids"].max()) < vocab_size:
                return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    generator = torch.Generator().manual_seed(0)
    length = max(RANDOM_VERIFICATION_LENGTHS)
    input_ids = torch.randint(0, vocab_size, (len(RANDOM_VERIFICATION_LENGTHS), length), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, row_length in enumerate(RANDOM_VERIFICATION_LENGTHS):
        attention_mask[row, length - row_length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def long_verification_input(tokenizer, vocab_size: int, length: int) -> dict[str, torch.Tensor]:
    """One unpadded sequence of exactly `length` tokens: a chat of the package's own arithmetic word problems with
    their worked answers (ordinary text) when there is a tokenizer, seeded random tokens otherwise."""
    from .demo_data import arithmetic_word_problems

    if tokenizer is not None:
        count = 8
        while True:
            problems = arithmetic_word_problems(count, seed=0)
            if tokenizer.chat_template:
                messages = []
                for problem in problems:
                    messages += [
                        {"role": "user", "content": problem["question"]},
                        {"role": "assistant", "content": problem["answer"]},
                    ]
                text = tokenizer.apply_chat_template(messages, tokenize=False)
            else:
                text = "\n\n".join(f"Question: {p['question']}\nAnswer: {p['answer']}" for p in problems)
            input_ids = tokenizer(text, add_special_tokens=not tokenizer.chat_template)["input_ids"]
            if len(input_ids) >= length or count >= 64 * length:
                break
            count *= 2
        if len(input_ids) >= length and max(input_ids[:length]) < vocab_size:
            input_ids = torch.tensor([input_ids[:length]])
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (1, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def long_verification_plan(config: IHAConfig, source_windows: Sequence[int | None]) -> tuple[int, int | None]:
    """(length of the long verification input, the smallest window the settings change or None).

    A changed window changes the outputs of tokens past it only, so the input is at least twice that window;
    other changes (positions, collapse, dtype) show at every token and grow with distance. See
    LONG_VERIFICATION_TOKENS and MAX_LONG_VERIFICATION_TOKENS for the bounds.
    """
    target_windows = [config.sliding_window if is_sliding_layer(t) else None for t in config.attention_types]
    changed = [
        window
        for before, after in zip(source_windows, target_windows)
        if before != after
        for window in (before, after)
        if window is not None
    ]
    window = min(changed) if changed else None
    wanted = max(2 * window, LONG_VERIFICATION_TOKENS) if window is not None else LONG_VERIFICATION_TOKENS
    return min(wanted, config.max_position_embeddings, MAX_LONG_VERIFICATION_TOKENS), window


def compared_figures(source_logits: torch.Tensor, converted_logits: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, top-1 agreement) over the rows (positions) of two [positions, vocab] tensors."""
    top1 = float((converted_logits.argmax(-1) == source_logits.argmax(-1)).float().mean())
    return float((converted_logits - source_logits).abs().max()), top1


@contextmanager
def hidden_progress_bars(hide: bool) -> Iterator[None]:
    """Silence transformers' ("Loading weights") and huggingface_hub's (downloads) progress bars in the block."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    if not hide:
        yield
        return
    transformers_was_on = transformers_logging.is_progress_bar_enabled()
    hub_was_on = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        if transformers_was_on:
            transformers_logging.enable_progress_bar()
        if hub_was_on:
            enable_progress_bars()


def logits_of_real_tokens(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[real tokens, vocab] logits: the LM head runs on non-padding positions only (a vocab-wide logits tensor
    for the padding too would be the largest allocation of the verification)."""
    hidden_states = model.base_model(**batch).last_hidden_state
    return model.get_output_embeddings()(hidden_states[batch["attention_mask"].bool()])


def release_memory() -> None:
    """Free a model before loading the next one, and hand freed heap back to the OS (glibc keeps it otherwise),
    so the verification's peak is one model, not one model plus the last one's leftovers."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def verify_conversion(
    source_dir: str | os.PathLike,
    converted_dir: str | os.PathLike,
    *,
    exact_expected: bool = True,
    tolerance: float | None = None,
    long_length: int | None = None,
    window: int | None = None,
) -> VerificationResult:
    """Run the source and the converted model in fp32 on a fixed batch and compare the logits.

    The models run one after the other, so memory holds one model at a time. Only non-padding positions count.
    Exact settings pass when the largest logit difference is at most `tolerance`; by default that is
    `max(1e-5, 4 x the source's own rounding noise)`, the noise being how far the source's logits move when
    only its attention kernel changes (sdpa vs eager). A 2-layer model gets 1e-5; a 30-layer one like SmolLM2
    differs from itself by about 1e-4 under that change, and any other summation order (IHA's included) lands
    at the same level in fp32, however exact the function.
    Settings that change the function pass when the logits are finite: the result measures the change. With
    `long_length`, the models also run on one input of that many tokens, whose figures are reported for the
    tokens up to and past `window` (the smallest window the settings change), or for each half when no window
    changes: a window change shows only past the window, where the short batch never reaches.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, converted_dir = Path(source_dir), Path(converted_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    except Exception:  # no or unusable tokenizer: random tokens still verify the weights
        tokenizer = None
    vocab_size = json.loads((converted_dir / "config.json").read_text())["vocab_size"]
    batch = verification_batch(tokenizer, vocab_size)
    long_input = long_verification_input(tokenizer, vocab_size, long_length) if long_length else None
    del tokenizer
    release_memory()

    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    valid = batch["attention_mask"].bool()
    source_logits = logits_of_real_tokens(source, batch)
    source_long_logits = logits_of_real_tokens(source, long_input) if long_input is not None else None
    other_implementation = "eager" if source.config._attn_implementation != "eager" else "sdpa"
    source.set_attn_implementation(other_implementation)
    # In place: a second logits-sized temporary would be the verification's largest allocation after the model.
    reference_noise = float(logits_of_real_tokens(source, batch).sub_(source_logits).abs_().max())
    if not math.isfinite(reference_noise):  # the other kernel failed on this input: fall back to the fixed bar
        reference_noise = 0.0
    del source
    release_memory()

    converted, loading_info = IHAForCausalLM.from_pretrained(
        converted_dir, dtype=torch.float32, output_loading_info=True
    )
    if any(loading_info.values()):
        raise ConversionError(f"The converted checkpoint does not load cleanly: {loading_info}.")
    converted.eval()
    converted_logits = logits_of_real_tokens(converted, batch)
    converted_long_logits = logits_of_real_tokens(converted, long_input) if long_input is not None else None
    del converted
    release_memory()

    lengths = batch["attention_mask"].sum(-1)
    by_length = [
        {
            "input": f"{len(lengths)} prompts of {int(lengths.min())}-{int(lengths.max())} tokens",
            "tokens": f"1-{int(lengths.max())}",
            "positions": int(valid.sum()),
            **dict(zip(("max_abs_diff", "top1_agreement"), compared_figures(source_logits, converted_logits))),
        }
    ]
    if long_input is not None:
        split = window if window is not None and window < long_length else long_length // 2
        for first, last, where in (
            (1, split, f"up to the {window}-token window" if window is not None else "first half"),
            (split + 1, long_length, f"past the {window}-token window" if window is not None else "second half"),
        ):
            if window is not None and window >= long_length and first > 1:
                continue  # the model's positions end before the window: nothing lies past it
            figures = compared_figures(source_long_logits[first - 1 : last], converted_long_logits[first - 1 : last])
            by_length.append(
                {
                    "input": f"one {long_length}-token text, {where}",
                    "tokens": f"{first}-{last}",
                    "positions": last - first + 1,
                    **dict(zip(("max_abs_diff", "top1_agreement"), figures)),
                }
            )
        converted_logits = torch.cat([converted_logits, converted_long_logits])
        source_logits = torch.cat([source_logits, source_long_logits])
        del converted_long_logits, source_long_logits

    positions = converted_logits.shape[0]
    top1_agreement = float((converted_logits.argmax(-1) == source_logits.argmax(-1)).float().mean())
    finite = bool(torch.isfinite(converted_logits).all())
    difference = converted_logits.sub_(source_logits).abs_().amax(dim=-1)  # per position
    max_abs_diff = float(difference.max())
    figures = (
        f"max |logit difference| {max_abs_diff:.2e} over {positions} positions, top-1 agreement "
        f"{100 * top1_agreement:.2f}% (the source against itself, sdpa vs eager: {reference_noise:.2e})"
    )
    if long_input is not None:
        figures += "; by input length: " + "; ".join(
            f"{entry['input']} (tokens {entry['tokens']}): {entry['max_abs_diff']:.2e}, top-1 "
            f"{100 * entry['top1_agreement']:.2f}%"
            for entry in by_length
        )
        if window is not None and window >= long_length:
            figures += (
                f"; the {window}-token window is not shorter than the longest input the model takes here "
                f"({long_length} tokens), so its change is not measured"
            )
    if exact_expected:
        if tolerance is None:
            tolerance = max(EXACT_ATOL, NOISE_MULTIPLE * reference_noise)
        passed = finite and max_abs_diff <= tolerance
        if passed:
            message = f"exact: {figures}, within the tolerance {tolerance:.1e}"
        else:
            worst = int(difference.argmax())
            if worst < int(valid.sum()):
                row, token = valid.nonzero()[worst].tolist()
                where = f"batch row {row}, token {token}"
            else:
                where = f"token {worst - int(valid.sum())} of the {long_length}-token input"
            message = (
                f"NOT exact: {figures} exceeds the tolerance {tolerance:.1e}; the largest difference is at {where}"
            )
    else:
        passed = finite
        message = (
            f"changed as intended: {figures}" if finite else f"the converted model gives non-finite logits: {figures}"
        )
    return VerificationResult(
        max_abs_diff=max_abs_diff,
        top1_agreement=top1_agreement,
        positions=positions,
        batch_shape=list(batch["input_ids"].shape),
        reference_noise=reference_noise,
        tolerance=tolerance if exact_expected else None,
        exact_expected=exact_expected,
        passed=passed,
        message=message,
        by_length=by_length,
    )


# ---------------------------------------------------------------------------------------------------------------
# The whole conversion
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ConversionReport:
    source: str
    output_dir: str
    architecture: str
    num_pseudo_heads: int
    attention_types: list[str]
    sliding_window: int | None
    mask_mode: str
    position_mode: str
    collapse_mode: str
    collapse_init: str
    dtype: str
    exact: bool
    function_changes: list[str]
    weight_files: list[str]
    total_bytes: int
    head_mixing_parameters: int
    verification: VerificationResult | None
    seconds: float
    base_model: str | None = None

    @property
    def iha_layers(self) -> list[int]:
        return [i for i, attention_type in enumerate(self.attention_types) if is_iha_layer(attention_type)]

    def to_dict(self) -> dict:
        return asdict(self)


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"The output path {output_dir} is a file; give a folder.")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"The output folder {output_dir} exists and is not empty. Choose another folder, or pass --overwrite "
            "(overwrite=True) to replace it once the new conversion has succeeded."
        )


def convert_checkpoint(
    source: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str = "auto",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool = True,
    tolerance: float | None = None,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    base_model: str | None = None,
    show_progress: bool = True,
    **iha_options,
) -> ConversionReport:
    """Convert a Llama / Mistral / Qwen2 checkpoint (local folder or Hub id) into a Hub-ready IHA folder.

    `iha_options` are those of `plan_conversion` (num_pseudo_heads, layers, training_length, mask_mode,
    position_mode, collapse_mode, collapse_init); their defaults give an exact conversion.

    The weights stream from the source shards to the output shards one tensor at a time (memory holds one
    tensor, plus one model at a time during verification). Everything is written to a temporary folder next
    to `output_dir` and renamed into place at the end, so a failed or interrupted conversion leaves nothing.
    With `verify` (the default) both models run on a fixed batch in fp32; when the settings are meant to be
    exact and the logits differ, `VerificationFailedError` is raised and no output is kept.

    `dtype`: "auto" keeps each tensor's dtype; "float32", "bfloat16" or "float16" casts the floating-point
    weights (a narrowing cast changes the function, and the report says so).
    """
    started = time.perf_counter()
    output_dir = Path(output_dir).expanduser().resolve()
    prepare_output_dir(output_dir, overwrite)
    if dtype != "auto" and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}.")
    if tolerance is not None and not tolerance > 0:
        raise ConversionError(f"--tolerance must be a positive number of logits, got {tolerance!r}.")
    max_shard_bytes = parse_size(max_shard_size)
    if sys.byteorder != "little":
        raise ConversionError("Writing safetensors needs a little-endian machine.")

    with hidden_progress_bars(not show_progress):
        source_dir, hub_id = resolve_source(
            source, revision=revision, token=token, cache_dir=cache_dir, allow_pickle=allow_pickle
        )
    if source_dir.resolve() == output_dir:
        raise ConversionError("The output folder is the source folder; write the IHA checkpoint somewhere else.")
    source_config = read_source_config(source_dir)
    plan = plan_conversion(source_config, **iha_options)
    config = plan.config
    kind, weight_files = find_weight_files(source_dir, allow_pickle)
    logger.info(f"Converting {hub_id or source_dir} ({plan.architecture}, {len(weight_files)} {kind} file(s)).")

    readers = []
    try:
        reader_class = SafetensorsReader if kind == "safetensors" else PickleReader
        sources: dict[str, SourceTensor] = {}
        for path in weight_files:
            reader = reader_class(path)
            readers.append(reader)
            for tensor in reader.tensors():
                if tensor.name in sources:
                    raise ConversionError(f"Tensor {tensor.name} appears in two weight files.")
                sources[tensor.name] = tensor
        target_dtype = None if dtype == "auto" else DTYPES[dtype]
        tensors, casts = plan_output_tensors(config, sources, target_dtype)
        function_changes = plan.function_changes + dtype_changes(casts)
        out_dtype = target_dtype or sources["model.embed_tokens.weight"].dtype
        config.dtype = out_dtype

        # Written in a staging folder next to output_dir, renamed into place at the end: a failure, Ctrl-C, SIGTERM or
        # SIGHUP removes it (and the parent folders it created); a SIGKILLed run's is removed by the next run.
        with staged_folder(output_dir, "iha-convert", replace=overwrite) as staging:
            weight_names = write_weights(staging, tensors, max_shard_bytes, show_progress)
            for reader in readers:
                reader.close()
            readers = []
            write_config_and_code(staging, config)
            copy_source_files(source_dir, staging, source_config)

            verification = None
            if verify:
                long_length, changed_window = long_verification_plan(config, plan.source_windows)
                logger.info(
                    "Verifying: source and converted model on a fixed batch in fp32"
                    + (
                        f", and on one {long_length}-token input (the settings change the function)"
                        if function_changes
                        else ""
                    )
                    + " ..."
                )
                with hidden_progress_bars(not show_progress):
                    verification = verify_conversion(
                        source_dir,
                        staging,
                        exact_expected=not function_changes,
                        tolerance=tolerance,
                        long_length=long_length if function_changes else None,
                        window=changed_window,
                    )
            report = ConversionReport(
                source=hub_id or str(source_dir),
                output_dir=str(output_dir),
                architecture=plan.architecture,
                num_pseudo_heads=config.num_pseudo_heads,
                attention_types=list(config.attention_types),
                sliding_window=config.sliding_window,
                mask_mode=config.iha_mask_mode,
                position_mode=config.iha_position_mode,
                collapse_mode=config.iha_collapse_mode,
                collapse_init=config.iha_collapse_init,
                dtype=str(out_dtype).removeprefix("torch."),
                exact=not function_changes,
                function_changes=function_changes,
                weight_files=weight_names,
                total_bytes=sum(tensor.nbytes for tensor in tensors),
                head_mixing_parameters=sum(math.prod(t.shape) for t in tensors if t.source is None),
                verification=verification,
                seconds=0.0,
                base_model=base_model or hub_id or builtin_base_model(source_dir),
            )
            if verification is not None and not verification.passed:
                raise VerificationFailedError(f"Verification failed: {verification.message}.", report)

            write_conversion_card(staging, report, source_dir)
            report.seconds = round(time.perf_counter() - started, 2)
            # The folder may go to the Hub: keep the local output path out of it.
            saved_report = {key: value for key, value in report.to_dict().items() if key != "output_dir"}
            (staging / REPORT_NAME).write_text(json.dumps(saved_report, indent=2) + "\n")
    finally:
        for reader in readers:
            reader.close()
    if not report.exact:
        logger.warning(function_change_warning(report))
    return report


def function_change_warning(report: ConversionReport) -> str:
    lines = ["WARNING: these settings change what the model computes; this is not an exact conversion:"]
    lines += [f"  - {change}" for change in report.function_changes]
    if report.verification is not None:
        lines.append(
            f"  measured change: max |logit difference| {report.verification.max_abs_diff:.2e}, top-1 agreement "
            f"{100 * report.verification.top1_agreement:.2f}% over {report.verification.positions} positions; "
            "by input length:"
        )
        lines += [
            f"    {entry['input']} (tokens {entry['tokens']}): max |logit difference| {entry['max_abs_diff']:.2e}, "
            f"top-1 agreement {100 * entry['top1_agreement']:.2f}%"
            for entry in report.verification.by_length
        ]
    else:
        lines.append("  (not measured: verification was skipped)")
    return "\n".join(lines)


def read_source_config(source_dir: Path):
    """The source's config through AutoConfig, or one clear error when config.json is missing or unreadable."""
    from transformers import AutoConfig

    path = source_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{source_dir} has no config.json; it is not a transformers checkpoint folder.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ConversionError(f"{path} is not valid JSON ({error}); the checkpoint folder looks damaged.") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object; it is not a model config.")
    try:
        return AutoConfig.from_pretrained(source_dir)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"transformers cannot read {path}: {error}") from None


def builtin_base_model(source_dir: Path) -> str | None:
    """The base model recorded by `iha.builtin` in folders it made (e.g. the offline SmolLM2)."""
    stamp = source_dir / "iha_builtin.json"
    if stamp.is_file():
        return json.loads(stamp.read_text()).get("base_model")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------


def conversion_card_sections(report: ConversionReport, model_id: str) -> dict[str, str]:
    """The model card sections a conversion writes: settings, verification, how to load."""
    iha_layers = report.iha_layers
    standard_layers = [i for i in range(len(report.attention_types)) if i not in iha_layers]
    sliding = [i for i, t in enumerate(report.attention_types) if is_sliding_layer(t)]
    settings = [
        "| setting | value |",
        "|---|---|",
        f"| pseudo-heads per head (P) | {report.num_pseudo_heads} |",
        f"| IHA layers | {describe_layers(iha_layers) or 'none'} (of {len(report.attention_types)}) |",
        f"| standard attention layers | {describe_layers(standard_layers) or 'none'} |",
        f"| sliding window | {f'{report.sliding_window} tokens, layers {describe_layers(sliding)}' if sliding else 'none'} |",
        f"| mask | {report.mask_mode} |",
        f"| positions | {report.position_mode} |",
        f"| collapse | {report.collapse_mode}, initialised to `{report.collapse_init}` |",
        f"| head-mixing parameters added | {report.head_mixing_parameters:,} |",
        f"| dtype | {report.dtype} |",
    ]
    if report.exact:
        function = (
            "With these settings the model computes the same function as the source: the head mixing starts at "
            "identity (every pseudo-head is a copy of its head), all pseudo-tokens of a token share its position, "
            "and the collapse reads the last pseudo-head, which under the flat causal mask sees exactly what the "
            "source head saw. Fine-tuning then moves the mixing away from identity."
        )
    else:
        function = "These settings change what the model computes, compared with the source:\n\n" + "\n".join(
            f"- {change}" for change in report.function_changes
        )
    verification = report.verification
    if verification is None:
        checked = "Verification was skipped (`--no-verify`)."
    else:
        inputs = f"a fixed batch of {verification.batch_shape[0]} left-padded sequences"
        if len(verification.by_length) > 1:
            inputs += " and on one longer text"
        checked = "\n".join(
            [
                f"Source and converted model ran in fp32 on {inputs} ({verification.positions} token positions "
                "compared).",
                "",
                "| measure | value |",
                "|---|---|",
                f"| max absolute logit difference | {verification.max_abs_diff:.2e} |",
                f"| top-1 agreement | {100 * verification.top1_agreement:.2f}% |",
                f"| the source against itself (sdpa vs eager attention) | {verification.reference_noise:.2e} |",
                f"| tolerance | {f'{verification.tolerance:.1e}' if verification.tolerance is not None else 'none (not meant to be exact)'} |",
                f"| result | {verification.message.split(':')[0]} |",
            ]
        )
        if len(verification.by_length) > 1:  # settings that change the function: measured on a long input too
            checked += "\n\nBy input length (a changed window only changes the tokens past it):\n\n" + "\n".join(
                ["| input | tokens | max absolute logit difference | top-1 agreement |", "|---|---|---|---|"]
                + [
                    f"| {entry['input']} | {entry['tokens']} | {entry['max_abs_diff']:.2e} | "
                    f"{100 * entry['top1_agreement']:.2f}% |"
                    for entry in verification.by_length
                ]
            )
    source_label = (
        f"`{report.base_model}`" if report.base_model else f"a local checkpoint (`{Path(report.source).name}`)"
    )
    return {
        "IHA settings": "\n".join(settings) + "\n\n" + function,
        "Verification": checked,
        "How to load": how_to_load_section(model_id),
        "Conversion": (
            f"Converted from {source_label} ({report.architecture}) with `iha-convert` "
            f"(the `iha` package, transformers {transformers_version()}). The folder holds `config.json` (with "
            f"`auto_map`), `configuration_iha.py` and `modeling_iha.py`, the weights as safetensors "
            f"({', '.join(report.weight_files)}), the source's tokenizer and generation config, and "
            f"`{REPORT_NAME}` with these figures."
        ),
    }


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def write_conversion_card(folder: Path, report: ConversionReport, source_dir: Path, model_id: str | None = None):
    source_card = read_model_card(source_dir)
    metadata = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(DEFAULT_TAGS) + (["conversational"] if (folder / "chat_template.jinja").is_file() else []),
    }
    if report.base_model:
        metadata["base_model"] = report.base_model
    if source_card is not None and source_card.metadata.get("license"):
        metadata["license"] = source_card.metadata["license"]
    base = report.base_model or Path(report.source).name
    base_link = f"[{base}](https://huggingface.co/{base})" if report.base_model else f"`{base}`"
    intro = (
        f"{base_link} converted to **Interleaved Head Attention** (IHA, "
        f"[arXiv 2602.21371](https://arxiv.org/abs/2602.21371)) with P = {report.num_pseudo_heads} pseudo-heads per "
        "head. "
        + (
            "It computes what the source model computes and is ready to fine-tune."
            if report.exact
            else "These settings change the function (see below): fine-tune before use."
        )
    )
    text = render_model_card(
        conversion_card_sections(report, model_id or Path(report.output_dir).name),
        title=f"{Path(base).name} with Interleaved Head Attention (P={report.num_pseudo_heads})",
        metadata=metadata,
        intro=intro,
    )
    write_text_atomic(text, folder / "README.md")


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="iha-convert",
        description=(
            "Convert a Llama-style checkpoint (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2) to Interleaved Head "
            "Attention. The defaults are exact: the converted model computes what the source computed. "
            "To upload an existing converted folder: iha-convert push FOLDER REPO_ID."
        ),
    )
    parser.add_argument("source", help="local checkpoint folder or Hub model id (org/name)")
    parser.add_argument("output_dir", help="folder to write; must not exist or be empty unless --overwrite")
    iha_group = parser.add_argument_group("IHA settings")
    iha_group.add_argument("--num-pseudo-heads", "-P", type=int, default=2, help="pseudo-heads per head (default 2)")
    iha_group.add_argument(
        "--layers",
        default="all",
        help="which layers become IHA: 'all' (default, exact), 'hybrid' (the paper's 4 sliding IHA : 1 global "
        "standard layout, changes the function), or indices like '0,1,5' (others stay standard attention)",
    )
    iha_group.add_argument(
        "--training-length",
        type=int,
        help="with --layers hybrid: the sequence length you will train at; the window is N/(2 P^2) tokens "
        "(default: max_position_embeddings)",
    )
    iha_group.add_argument(
        "--mask-mode",
        default="flat_causal",
        choices=["flat_causal", "token_causal"],
        help="flat_causal (the paper's, default) or token_causal (a pseudo-token sees all of its own token)",
    )
    iha_group.add_argument(
        "--position-mode", default="shared", choices=["shared", "virtual"], help="virtual is the paper's, not exact"
    )
    iha_group.add_argument(
        "--collapse-mode", default="per_head", choices=["per_head", "global"], help="collapse R: [H, P] or [H, H, P]"
    )
    iha_group.add_argument(
        "--collapse-init",
        default="last",
        choices=["last", "mean", "first"],
        help="initial collapse; with flat_causal only 'last' is exact, with token_causal all are",
    )
    output_group = parser.add_argument_group("output")
    output_group.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="default: keep the source's")
    output_group.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB")
    output_group.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    output_group.add_argument("--base-model", help="Hub id to name as base model in the model card")
    source_group = parser.add_argument_group("source")
    source_group.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickle (.bin) weights, read with torch.load(weights_only=True); refused by default",
    )
    source_group.add_argument("--revision", help="Hub revision (branch, tag or commit) of SOURCE")
    source_group.add_argument("--token", help="Hub token (default: the logged-in one)")
    source_group.add_argument("--cache-dir", help="Hugging Face cache folder for Hub downloads (default: HF_HUB_CACHE)")
    check_group = parser.add_argument_group("verification")
    check_group.add_argument("--no-verify", action="store_true", help="skip running both models on a fixed batch")
    check_group.add_argument(
        "--tolerance",
        type=float,
        help=f"max logit difference for exact settings (default: max({EXACT_ATOL:g}, {NOISE_MULTIPLE:g} x the "
        "source's own sdpa-vs-eager difference))",
    )
    hub_group = parser.add_argument_group("Hub")
    hub_group.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the converted folder to this Hub repo")
    hub_group.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars or progress messages")
    return parser


def print_report(report: ConversionReport, write: Callable[[str], None]) -> None:
    write(f"Converted {report.source} ({report.architecture}) -> {report.output_dir}")
    write(
        f"  P={report.num_pseudo_heads}, IHA layers {describe_layers(report.iha_layers) or 'none'} of "
        f"{len(report.attention_types)}, mask {report.mask_mode}, positions {report.position_mode}, collapse "
        f"{report.collapse_mode}/{report.collapse_init}, dtype {report.dtype}, files {', '.join(report.weight_files)}"
    )
    if report.verification is not None:
        write(f"  verification: {report.verification.message}")
    else:
        write("  verification: skipped (--no-verify)")


def run_conversion(args: argparse.Namespace) -> int:
    """What `iha-convert SRC DST` does once its arguments are parsed; failures propagate to `run_command`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    loggers = [logger, logging.getLogger("iha.atomic_folders")]
    previous_levels = [each.level for each in loggers]
    for each in loggers:
        each.addHandler(handler)
        each.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        report = convert_checkpoint(
            args.source,
            args.output_dir,
            num_pseudo_heads=args.num_pseudo_heads,
            layers=args.layers,
            training_length=args.training_length,
            mask_mode=args.mask_mode,
            position_mode=args.position_mode,
            collapse_mode=args.collapse_mode,
            collapse_init=args.collapse_init,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            verify=not args.no_verify,
            tolerance=args.tolerance,
            revision=args.revision,
            token=args.token,
            cache_dir=args.cache_dir,
            base_model=args.base_model,
            show_progress=not args.quiet,
        )
    except VerificationFailedError as error:
        print(f"iha-convert: error: {error} Nothing was written to {args.output_dir}.", file=sys.stderr, flush=True)
        return 1
    finally:
        for each, level in zip(loggers, previous_levels):
            each.removeHandler(handler)
            each.setLevel(level)
    print_report(report, lambda message: print(message, flush=True))
    if args.push_to_hub:
        from .hub import HubUploadError, push_to_hub

        try:
            url = push_to_hub(
                report.output_dir,
                args.push_to_hub,
                private=args.private or None,
                token=args.token,
                retry_command="iha-convert push",
            )
        except HubUploadError as error:
            print(f"iha-convert: error: {error}", file=sys.stderr, flush=True)
            return 1
        print(f"Uploaded to {url}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`iha-convert SRC DST [options]` and `iha-convert push FOLDER REPO_ID`: the exit status, 0 on success.

    Bad input prints one line and exits 2 (1 when verification fails, or an upload does); Ctrl-C, SIGTERM and
    SIGHUP remove everything the run wrote and exit with 128 + the signal number (130 for Ctrl-C).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["push"]:
        from .hub import main as push_main

        return push_main(argv[1:], prog="iha-convert push")
    args = build_parser().parse_args(argv)
    return run_command(
        "iha-convert",
        lambda: run_conversion(args),
        errors=(ConversionError, ValueError),
        interrupted=f"nothing was written to {args.output_dir}",
    )


if __name__ == "__main__":
    sys.exit(main())
