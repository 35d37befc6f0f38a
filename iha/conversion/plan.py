"""Planning a conversion: the source's config and the settings -> the IHA config to build (`IHAConfig` for
Llama-family blocks, `IHAGemma3Config` for Gemma 3's), and what (if anything) the settings change in what the model
computes. Every field a source config declares is copied, read into the per-layer layout, or refused."""

import copy
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig

from .. import IHA_MODEL_TYPES
from ..models.iha.configuration_iha import IHAConfig
from ..models.iha.configuration_iha_gemma3 import UNSUPPORTED_GEMMA3_FIELDS, IHAGemma3Config
from ..models.iha.layer_iha import (
    IHA_FULL,
    IHA_SLIDING,
    STANDARD_FULL,
    STANDARD_SLIDING,
    is_sliding_layer,
    paper_hybrid_layout,
)
from ..models.iha.modeling_iha import IHAForCausalLM
from ..models.iha.modeling_iha_gemma3 import IHAGemma3ForCausalLM
from .architectures import SUPPORTED_ARCHITECTURES, SUPPORTED_DESCRIPTION
from .errors import ConversionError, UnsupportedArchitectureError
from .options import IHAConversionOptions, refuse_unknown_keywords, settings_from


logger = logging.getLogger(__name__)

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
# Gemma 3 fields `IHAGemma3Config` (a Gemma3TextConfig) takes as they are.
GEMMA3_COPIED_CONFIG_FIELDS = (
    *(name for name in COPIED_CONFIG_FIELDS if name != "hidden_act"),
    "hidden_activation",
    "attention_bias",
    "query_pre_attn_scalar",
)
# The other fields each source config class declares (beyond PreTrainedConfig's), which the plan reads itself: into
# the window, bias, q/k norm and RoPE of every layer. `pretraining_tp` has no effect in transformers 5; Gemma 3's
# softcapping and bidirectional attention are refused unless off (`IHAGemma3Config` checks them). A field of a
# config class that is neither copied nor read here (one a newer transformers adds) is refused when it is set to
# anything but its default, rather than converted without it.
READ_CONFIG_FIELDS = {
    "LlamaForCausalLM": {"rope_parameters", "attention_bias", "mlp_bias", "pretraining_tp"},
    "MistralForCausalLM": {"rope_parameters", "sliding_window"},
    "Qwen2ForCausalLM": {"rope_parameters", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "Qwen3ForCausalLM": {
        "rope_parameters",
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    },
    "SmolLM3ForCausalLM": {
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "use_sliding_window",
        "sliding_window",
        "layer_types",
        "no_rope_layers",
        "no_rope_layer_interval",
    },
    "Gemma3ForCausalLM": {
        "rope_parameters",
        "sliding_window",
        "layer_types",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "use_bidirectional_attention",
    },
}
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

    config: IHAConfig  # or an IHAGemma3Config
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
    if model_type in IHA_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"The source is already an IHA checkpoint (model_type {model_type!r}); nothing to do."
        )
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
    `sliding_window` is set; Qwen2, Qwen3, SmolLM3 and Gemma 3 slide the layers their `layer_types` mark
    "sliding_attention" (derived, when absent, from `use_sliding_window` / `max_window_layers`, from SmolLM3's NoPE
    layers, or from Gemma 3's five sliding layers to one full layer).
    """
    num_layers = source_config.num_hidden_layers
    window = getattr(source_config, "sliding_window", None)
    if architecture == "LlamaForCausalLM":
        return [None] * num_layers
    if architecture == "MistralForCausalLM":
        return [window] * num_layers
    layer_types = list(getattr(source_config, "layer_types", None) or ["full_attention"] * num_layers)[:num_layers]
    sliding_layers = [index for index, layer_type in enumerate(layer_types) if layer_type == "sliding_attention"]
    if sliding_layers and window is None:
        raise ConversionError(
            f"`layer_types` marks layers {describe_layers(sliding_layers)} 'sliding_attention' but `sliding_window` is "
            "None (`use_sliding_window` false): the source's masks and caches disagree on these layers; set "
            "`use_sliding_window` and `sliding_window`, or mark the layers 'full_attention'."
        )
    if sliding_layers and architecture == "SmolLM3ForCausalLM" and not source_config.use_sliding_window:
        raise ConversionError(
            f"`layer_types` marks layers {describe_layers(sliding_layers)} 'sliding_attention' but "
            "`use_sliding_window` is false: SmolLM3 then windows its masks and caches but not FlashAttention; set "
            "`use_sliding_window` true, or mark the layers 'full_attention'."
        )
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def refuse_unread_fields(source_config, architecture: str) -> None:
    """Refuse a field of the source config class that the plan neither copies nor reads, set to anything but its
    default (see READ_CONFIG_FIELDS)."""

    understood = {config_field.name for config_field in dataclasses.fields(PreTrainedConfig)}
    understood |= set(COPIED_CONFIG_FIELDS) | set(GEMMA3_COPIED_CONFIG_FIELDS) | READ_CONFIG_FIELDS[architecture]
    for config_field in dataclasses.fields(source_config):
        if config_field.name in understood:
            continue
        if config_field.default_factory is not dataclasses.MISSING:
            default = config_field.default_factory()
        else:
            default = None if config_field.default is dataclasses.MISSING else config_field.default
        value = getattr(source_config, config_field.name, default)
        if value != default:
            raise ConversionError(
                f"The source config sets `{config_field.name}` = {value!r} (default {default!r}), a field of "
                f"{type(source_config).__name__} that iha does not know how to convert."
            )


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
    """Map the config of a supported source (see `architectures.SUPPORTED_ARCHITECTURES`) to an IHA config and list
    what the settings change.

    `options` are the `IHAConversionOptions` (or a dict of them); `settings` set single ones by name, on top.
    """
    options, rest = settings_from(IHAConversionOptions, options, settings)
    refuse_unknown_keywords("plan_conversion", rest, IHAConversionOptions)
    architecture = source_architecture(source_config)
    refuse_unread_fields(source_config, architecture)
    num_layers = source_config.num_hidden_layers
    source_windows = source_attention_windows(source_config, architecture)
    sliding_windows = {window for window in source_windows if window is not None}
    if len(sliding_windows) > 1:
        raise ConversionError(f"The source uses several sliding windows {sorted(sliding_windows)}; IHA has one.")
    source_window = next(iter(sliding_windows), None)

    layer_spec = parse_layer_spec(options.layers, num_layers)
    if layer_spec == "hybrid" and architecture == "Gemma3ForCausalLM":
        raise ConversionError(
            "--layers hybrid would move Gemma 3 layers between its sliding and full layer types, and with them "
            "between its two RoPE bases. Gemma 3 already has a hybrid layout (5 sliding : 1 full layer), which the "
            "default keeps with IHA in every layer; to keep some layers standard attention, list the IHA layers "
            "with --layers."
        )
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

    if architecture == "Gemma3ForCausalLM":
        config = gemma3_config(source_config, attention_types, sliding_window, options)
    else:
        config = llama_family_config(source_config, architecture, attention_types, sliding_window, options)
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
        has_sliding_iha = IHA_SLIDING in config.attention_types
        if has_sliding_iha and options.collapse_init != "last":
            changes.append(
                f"collapse init {options.collapse_init!r} with sliding IHA layers: under the paper's window of W * P "
                "virtual tokens, pseudo-heads before the last also see part of the token just before the source's "
                "window (--collapse_init last keeps the function)"
            )
    return ConversionPlan(
        config=config, architecture=architecture, source_windows=source_windows, function_changes=changes
    )


def llama_family_config(
    source_config, architecture: str, attention_types: list[str], sliding_window: int | None, options
) -> IHAConfig:
    """The `IHAConfig` of a Llama, Mistral, Qwen2, Qwen3 or SmolLM3 source: its sizes, RoPE and biases, the
    per-head q/k norm of Qwen3, the NoPE layers of SmolLM3, and the given layout and IHA settings."""
    if architecture == "Qwen2ForCausalLM":
        qkv_bias, o_proj_bias, mlp_bias = True, False, False
    elif architecture == "MistralForCausalLM":
        qkv_bias, o_proj_bias, mlp_bias = False, False, False
    else:  # Llama, Qwen3 and SmolLM3: `attention_bias` on all four projections, `mlp_bias` where the config has it
        qkv_bias = o_proj_bias = bool(getattr(source_config, "attention_bias", False))
        mlp_bias = bool(getattr(source_config, "mlp_bias", False))
    architecture_fields = {}
    if architecture == "Qwen3ForCausalLM":
        architecture_fields["use_qk_norm"] = True
    if architecture == "SmolLM3ForCausalLM":
        # SmolLM3 allows a longer list than there are layers; its layers read the first entries.
        architecture_fields["no_rope_layers"] = list(source_config.no_rope_layers)[: source_config.num_hidden_layers]

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
        **architecture_fields,
        **options.config_fields(),
    )
    config.architectures = ["IHAForCausalLM"]
    return config


def gemma3_config(source_config, attention_types: list[str], sliding_window: int | None, options):
    """The `IHAGemma3Config` of a Gemma 3 text source: its sizes, scale, norms' epsilon and RoPE per layer type, and
    the given layout and IHA settings. Softcapping and bidirectional attention are refused unless off."""

    for field_name, supported in UNSUPPORTED_GEMMA3_FIELDS:
        if getattr(source_config, field_name) != supported:
            raise ConversionError(
                f"The source config sets `{field_name}` = {getattr(source_config, field_name)!r}; IHA Gemma 3 models "
                f"support only {supported!r} (what Gemma 3 language models use)."
            )
    fields = {name: getattr(source_config, name) for name in GEMMA3_COPIED_CONFIG_FIELDS}
    config = IHAGemma3Config(
        **fields,
        rope_parameters=copy.deepcopy(source_config.rope_parameters),
        attention_types=attention_types,
        # Gemma 3 has no "no window" setting: a source whose layers all attend fully keeps its (unused) window.
        sliding_window=sliding_window if sliding_window is not None else source_config.sliding_window,
        **options.config_fields(),
    )
    config.architectures = ["IHAGemma3ForCausalLM"]
    return config


def iha_causal_lm_class(model_type: str):
    """The causal LM class of an IHA model type: `IHAGemma3ForCausalLM` for "iha_gemma3", else `IHAForCausalLM`."""
    if model_type == "iha_gemma3":
        return IHAGemma3ForCausalLM

    return IHAForCausalLM


def dtype_changes(casts: set[tuple[torch.dtype, torch.dtype]]) -> list[str]:
    """What a set of (source dtype, output dtype) casts changes: one line per cast that rounds."""
    lossy = sorted({(str(a), str(b)) for a, b in casts if a != b and (a, b) not in LOSSLESS_CASTS})
    return [f"weights are rounded from {a.removeprefix('torch.')} to {b.removeprefix('torch.')}" for a, b in lossy]
