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
"""Planning a conversion: the source's config and the settings -> the `IHAConfig` to build, and what (if anything)
the settings change in what the model computes."""

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..configuration_iha import (
    IHA_FULL,
    IHA_SLIDING,
    STANDARD_FULL,
    STANDARD_SLIDING,
    IHAConfig,
    is_sliding_layer,
    paper_hybrid_layout,
)
from .errors import ConversionError, UnsupportedArchitectureError
from .options import IHAConversionOptions, refuse_unknown_keywords, settings_from


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
# The source config fields the IHA config takes as they are. `head_dim` where the source has one: IHAConfig (a
# LlamaConfig) derives hidden_size // num_attention_heads otherwise, as Qwen2 does.
COPIED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
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


def iha_attention_windows(config: IHAConfig) -> list[int | None]:
    """The window (in tokens) each layer of an IHA config attends over; None for full attention."""
    return [config.sliding_window if is_sliding_layer(t) else None for t in config.attention_types]


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


def plan_conversion(source_config, options: IHAConversionOptions | Mapping | None = None, **settings) -> ConversionPlan:
    """Map a LlamaConfig / MistralConfig / Qwen2Config to an IHAConfig and list what the settings change.

    `options` are the `IHAConversionOptions` (or a dict of them); `settings` set single ones by name, on top.
    """
    options, rest = settings_from(IHAConversionOptions, options, settings)
    refuse_unknown_keywords("plan_conversion", rest, IHAConversionOptions)
    architecture = source_architecture(source_config)
    num_layers = source_config.num_hidden_layers
    source_windows = source_attention_windows(source_config, architecture)
    sliding_windows = {window for window in source_windows if window is not None}
    if len(sliding_windows) > 1:
        raise ConversionError(f"The source uses several sliding windows {sorted(sliding_windows)}; IHA has one.")
    source_window = next(iter(sliding_windows), None)

    layer_spec = parse_layer_spec(options.layers, num_layers)
    if layer_spec == "hybrid":
        training_length = options.training_length
        if training_length is None:
            training_length = source_config.max_position_embeddings
            logger.info(f"--layers hybrid: window from --training_length {training_length} (max_position_embeddings).")
        layout = paper_hybrid_layout(num_layers, options.num_pseudo_heads, training_length)
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

    fields = {name: getattr(source_config, name) for name in COPIED_CONFIG_FIELDS if hasattr(source_config, name)}
    config = IHAConfig(
        **fields,
        rope_parameters=copy.deepcopy(source_config.rope_parameters),
        attention_bias=qkv_bias and o_proj_bias,
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        attention_types=attention_types,
        sliding_window=sliding_window,
        **options.config_fields(),
    )
    config.architectures = ["IHAForCausalLM"]
    source_dtype = getattr(source_config, "dtype", None)
    if source_dtype is not None:
        config.dtype = source_dtype

    changes = []
    window_changes: dict[tuple, list[int]] = {}
    for layer_idx, (before, after) in enumerate(zip(source_windows, iha_attention_windows(config))):
        if before != after:
            window_changes.setdefault((before, after), []).append(layer_idx)
    for (before, after), indices in window_changes.items():
        changes.append(
            f"layers {describe_layers(indices)} attend to {describe_window(after)} (the source: {describe_window(before)})"
        )
    if config.iha_layer_indices and options.num_pseudo_heads > 1:
        if options.position_mode == "virtual":
            changes.append(
                "virtual positions: pseudo-token (n, p) sits at RoPE position n*P+p, which stretches every relative "
                "distance by P (--position_mode shared keeps the source's positions)"
            )
        if options.mask_mode == "flat_causal" and options.collapse_init != "last":
            changes.append(
                f"collapse init {options.collapse_init!r} with the flat causal mask: pseudo-heads before the last do "
                "not see their own token's later pseudo-keys, so the current token is under-weighted "
                "(--collapse_init last, or --mask_mode token_causal, keep the function)"
            )
    return ConversionPlan(
        config=config, architecture=architecture, source_windows=source_windows, function_changes=changes
    )


def dtype_changes(casts: set[tuple[torch.dtype, torch.dtype]]) -> list[str]:
    """What a set of (source dtype, output dtype) casts changes: one line per cast that rounds."""
    lossy = sorted({(str(a), str(b)) for a, b in casts if a != b and (a, b) not in LOSSLESS_CASTS})
    return [f"weights are rounded from {a.removeprefix('torch.')} to {b.removeprefix('torch.')}" for a, b in lossy]
