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
"""Interleaved Head Attention (IHA) model configuration.

This file is copied next to the weights by `save_pretrained`, so it may import only torch, transformers and
its siblings (`compat_iha.py`, `modeling_iha.py`, ...): never the `iha` package itself.
"""

# First: importing the compatibility module refuses a transformers below the supported range with one clear error,
# before the imports below fail with unrelated ones (releases before 5.4 cannot even define this class).
from .compat_iha import MINIMUM_TRANSFORMERS  # noqa: F401  # isort: skip

from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


STANDARD_FULL = "full_attention"
STANDARD_SLIDING = "sliding_attention"
IHA_FULL = "iha_full_attention"
IHA_SLIDING = "iha_sliding_attention"
ATTENTION_TYPES = (STANDARD_FULL, STANDARD_SLIDING, IHA_FULL, IHA_SLIDING)

MASK_MODES = ("flat_causal", "token_causal")
POSITION_MODES = ("virtual", "shared")
COLLAPSE_MODES = ("per_head", "global")
COLLAPSE_INITS = ("last", "mean", "first")
CACHE_MODES = ("token", "pseudo")
# The unit of a sliding IHA layer's window (`iha_window_unit`). "token": the pseudo-tokens of the last `sliding_window`
# tokens (the first releases' window; what a config without the field means). "virtual": the paper's flat window of
# `sliding_window * P` virtual tokens, the same width for every pseudo-query, which every stock sliding-window kernel
# computes on the interleaved sequence.
WINDOW_UNITS = ("token", "virtual")

# transformers' sliding-window caches keep `sliding_window - 1` past tokens; with a 1-token window they keep none,
# and decoding fails with a size mismatch.
MINIMUM_SLIDING_WINDOW = 2


def is_iha_layer(attention_type: str) -> bool:
    return attention_type in (IHA_FULL, IHA_SLIDING)


def is_sliding_layer(attention_type: str) -> bool:
    return attention_type in (STANDARD_SLIDING, IHA_SLIDING)


def paper_hybrid_layout(
    num_hidden_layers: int, num_pseudo_heads: int, training_length: int, global_every: int = 5
) -> dict:
    """The paper's FLOP-matched layout: 4 sliding-window IHA layers, then one global standard (MHA) layer.

    The window is `training_length / (2 * P**2)` tokens (`W * P` virtual tokens), so that a sliding IHA layer
    costs about what a global MHA layer costs at the training length. Every `global_every`-th layer (indices
    4, 9, 14, ... for the default 5) is the global one. Returns the `attention_types` and `sliding_window` to
    pass to `IHAConfig`.
    """
    if global_every < 1:
        raise ValueError(f"`global_every` must be >= 1, got {global_every}.")
    window = training_length // (2 * num_pseudo_heads**2)
    if window < MINIMUM_SLIDING_WINDOW:
        raise ValueError(
            f"`training_length` ({training_length}) is too short for P={num_pseudo_heads}: the window "
            f"training_length / (2 * P^2) would be {training_length / (2 * num_pseudo_heads**2):.2f} tokens, and "
            f"sliding layers need at least {MINIMUM_SLIDING_WINDOW}. Use a training length of at least "
            f"{MINIMUM_SLIDING_WINDOW * 2 * num_pseudo_heads**2}."
        )
    attention_types = [
        STANDARD_FULL if (layer_idx + 1) % global_every == 0 else IHA_SLIDING for layer_idx in range(num_hidden_layers)
    ]
    return {"attention_types": attention_types, "sliding_window": window}


@dataclass
class IHAAttentionFields:
    """The IHA fields of every IHA config, one name and one type each: `IHAConfig` (Llama-family blocks) and
    `IHAGemma3Config` (Gemma 3's block) both carry them, and the attention, masks and caches read them alike.

    A config class that carries them calls `set_up_attention_types(default_types)` in its `__post_init__`, before its
    base class's: it fills `attention_types`, checks the IHA fields and derives `layer_types` (what transformers'
    caches and mask helpers read) from `attention_types`.
    """

    num_pseudo_heads: int = 2
    attention_types: list[str] | None = None
    iha_mask_mode: str = "flat_causal"
    iha_position_mode: str = "virtual"
    iha_collapse_mode: str = "per_head"
    iha_collapse_init: str = "last"
    iha_cache_mode: str = "token"
    iha_window_unit: str = "token"

    def set_up_attention_types(self, default_types: list[str]) -> None:
        if self.attention_types is None:
            self.attention_types = list(default_types)
        else:
            self.attention_types = list(self.attention_types)
        self._validate_iha_fields()
        # Caches (DynamicCache, StaticCache) and transformers' mask helpers read `layer_types`: they only need
        # to know which layers are windowed, in token units.
        derived_layer_types = [
            STANDARD_SLIDING if is_sliding_layer(attention_type) else STANDARD_FULL
            for attention_type in self.attention_types
        ]
        if self.layer_types is not None and list(self.layer_types) != derived_layer_types:
            raise ValueError(
                f"`layer_types` {list(self.layer_types)} disagrees with `attention_types` {self.attention_types}. "
                "Set only `attention_types`; `layer_types` is derived from it."
            )
        self.layer_types = derived_layer_types

    def _validate_iha_fields(self):
        choices = {
            "iha_mask_mode": MASK_MODES,
            "iha_position_mode": POSITION_MODES,
            "iha_collapse_mode": COLLAPSE_MODES,
            "iha_collapse_init": COLLAPSE_INITS,
            "iha_cache_mode": CACHE_MODES,
            "iha_window_unit": WINDOW_UNITS,
        }
        for field_name, allowed in choices.items():
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"`{field_name}` must be one of {list(allowed)}, got {value!r}.")
        if not isinstance(self.num_pseudo_heads, int) or self.num_pseudo_heads < 1:
            raise ValueError(f"`num_pseudo_heads` must be an integer >= 1, got {self.num_pseudo_heads!r}.")
        check_per_layer("attention_types", self.attention_types, self.num_hidden_layers)
        unknown = sorted({t for t in self.attention_types if t not in ATTENTION_TYPES})
        if unknown:
            raise ValueError(f"`attention_types` entries must be in {list(ATTENTION_TYPES)}, got {unknown}.")
        has_sliding = any(is_sliding_layer(t) for t in self.attention_types)
        if has_sliding and (self.sliding_window is None or self.sliding_window < MINIMUM_SLIDING_WINDOW):
            raise ValueError(
                f"`attention_types` has sliding layers but `sliding_window` is {self.sliding_window!r}: "
                f"set `sliding_window` to the window in tokens (an integer >= {MINIMUM_SLIDING_WINDOW}; "
                "transformers' sliding caches cannot decode with a 1-token window)."
            )
        if self.num_key_value_heads is not None and self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )

    @property
    def iha_layer_indices(self) -> list[int]:
        return [i for i, attention_type in enumerate(self.attention_types) if is_iha_layer(attention_type)]


def check_per_layer(field_name: str, values: list, num_hidden_layers: int) -> None:
    if len(values) != num_hidden_layers:
        raise ValueError(
            f"`{field_name}` has {len(values)} entries but `num_hidden_layers` is {num_hidden_layers}: give exactly "
            "one entry per layer."
        )


@strict
class IHAConfig(IHAAttentionFields, LlamaConfig):
    r"""
    Configuration of a Llama-family decoder whose attention layers are Interleaved Head Attention (IHA) layers.

    Every `LlamaConfig` field keeps its meaning (GQA through `num_key_value_heads`, `head_dim`, `rope_parameters`
    with every rope type transformers offers, `tie_word_embeddings`, ...). The IHA fields:

    num_pseudo_heads (`int`, defaults to 2):
        P, the number of pseudo-heads each head builds. Attention runs over N * P virtual tokens.
    attention_types (`list[str]`, *optional*):
        One entry per layer: `"iha_full_attention"`, `"iha_sliding_attention"`, `"full_attention"` (standard
        multi-head attention) or `"sliding_attention"` (standard, windowed). Defaults to IHA everywhere, sliding
        when `sliding_window` is set. `layer_types` (what caches and mask helpers read) is derived from it.
    sliding_window (`int`, *optional*):
        Window in tokens for the sliding layers. What an IHA sliding layer sees within it is set by `iha_window_unit`.
    iha_mask_mode (`str`, defaults to `"flat_causal"`):
        `"flat_causal"` (the paper's: ordinary causal attention over the interleaved sequence) or
        `"token_causal"` (a pseudo-token sees every pseudo-token of its own and earlier tokens).
    iha_position_mode (`str`, defaults to `"virtual"`):
        `"virtual"` (the paper's: pseudo-token (n, p) sits at RoPE position n * P + p) or `"shared"` (all
        pseudo-tokens of token n sit at position n; needed for an exact conversion of a pretrained model).
    iha_collapse_mode (`str`, defaults to `"per_head"`):
        How the H * P pseudo-outputs fold back to H heads: `"per_head"` (R of shape [H, P]) or `"global"`
        (R of shape [H, H, P], every head reads every pseudo-output).
    iha_collapse_init (`str`, defaults to `"last"`):
        Initial collapse weights: `"last"` (select pseudo-head P-1; exact with the flat mask), `"mean"` or
        `"first"`.
    iha_cache_mode (`str`, defaults to `"token"`):
        What the KV cache of IHA layers stores. `"token"`: the un-mixed keys and values, one entry per token and KV
        head like Llama (the base model's cache memory); every decoding step re-mixes the cached keys and values.
        `"pseudo"`: the mixed (and rotated) pseudo keys and values, P times the memory, nothing re-mixed per step.
        Both keep the cache in token units, so every transformers cache class and `generate()` work unchanged.
    iha_window_unit (`str`, defaults to `"token"`):
        The unit of the window of sliding IHA layers. `"virtual"` (the paper's, written by `paper_hybrid` and by
        conversions): a flat window of `sliding_window * P` virtual tokens on the interleaved sequence, the same width
        for every pseudo-query (virtual query i sees virtual keys j with i - sliding_window * P < j <= i, on top of the
        causal pattern), which is what every stock sliding-window kernel computes; the last pseudo-head of a token
        sees exactly the pseudo-tokens of the last `sliding_window` tokens, and the first reaches one token further
        back, so the sliding caches of these layers keep one token more than a standard sliding layer's.
        `"token"` (the first releases' window, and what a config without the field means): every pseudo-token of
        token n sees the pseudo-tokens of tokens n - sliding_window + 1 .. n, so earlier pseudo-heads of a token see
        slightly fewer virtual tokens than the last one.
    qkv_bias (`bool`, *optional*):
        Bias on the q/k/v projections (Qwen2 style). Defaults to `attention_bias`.
    o_proj_bias (`bool`, *optional*):
        Bias on the output projection. Defaults to `attention_bias`.
    use_qk_norm (`bool`, defaults to `False`):
        Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, over `head_dim`), applied to the
        projections of every layer before RoPE and before the head mixing.
    no_rope_layers (`list[int]`, *optional*):
        SmolLM3's per-layer switch, one entry per layer: 1 rotates queries and keys with RoPE, 0 gives the layer no
        positional encoding (NoPE). Defaults to RoPE in every layer.

    ```python
    >>> from iha import IHAConfig, IHAForCausalLM
    >>> config = IHAConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
    >>> model = IHAForCausalLM(config)
    ```
    """

    model_type = "iha"
    # Tensor parallelism that shards q/k/v by heads would cut the cross-head mixing apart: no TP plan for
    # attention (the MLP could still be split, but we keep one consistent rule: no inherited Llama plan). `None` says
    # "no plan"; an empty dict would read as a plan that covers no parameter.
    base_model_tp_plan = None

    layer_types: list[str] | None = None
    sliding_window: int | None = None
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    use_qk_norm: bool = False
    no_rope_layers: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        default_type = IHA_FULL if self.sliding_window is None else IHA_SLIDING
        self.set_up_attention_types([default_type] * self.num_hidden_layers)
        if self.no_rope_layers is None:
            self.no_rope_layers = [1] * self.num_hidden_layers
        check_per_layer("no_rope_layers", self.no_rope_layers, self.num_hidden_layers)
        if any(flag not in (0, 1) for flag in self.no_rope_layers):
            raise ValueError(
                f"`no_rope_layers` entries must be 1 (RoPE) or 0 (no positional encoding), got {self.no_rope_layers}."
            )
        self.no_rope_layers = [int(flag) for flag in self.no_rope_layers]
        super().__post_init__(**kwargs)

    @classmethod
    def paper_hybrid(cls, training_length: int, global_every: int = 5, **kwargs) -> "IHAConfig":
        """A config with the paper's FLOP-matched hybrid layout (4 sliding IHA : 1 global MHA, W = N / (2 P^2)), its
        sliding IHA layers windowed in virtual units (`iha_window_unit="virtual"`, unless `kwargs` say otherwise)."""
        probe = cls(**kwargs)
        layout = paper_hybrid_layout(probe.num_hidden_layers, probe.num_pseudo_heads, training_length, global_every)
        kwargs.pop("layer_types", None)
        return cls(**{"iha_window_unit": "virtual", **kwargs, **layout})


__all__ = ["IHAAttentionFields", "IHAConfig", "paper_hybrid_layout"]
