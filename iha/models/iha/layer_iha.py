# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""What an IHA layer is: the attention types, the IHA config fields with their defaults, the window and which stock
kernels can run a layer. The configurations, the model, its masks and caches, the installed fast paths
(`iha.attention`), the vLLM plugin, the converter and the exports read it here; the MLX model file (one file) restates
what it needs, held equal by `tests/models/mlx/test_mlx_layer.py`. Travels with the weights; standard library only,
so that configurations load where torch is absent.
"""

import dataclasses
from dataclasses import dataclass


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

    The window is `training_length / (2 * P**2)` tokens (`W * P` virtual tokens), so that a sliding IHA layer costs
    about what a global MHA layer costs at the training length. Every `global_every`-th layer (indices 4, 9, 14, ...
    for the default 5) is the global one. Returns the `attention_types` and `sliding_window` of the config.
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


def stock_kernel_refusal(kernel: str, mask_mode: str) -> str | None:
    """Why `kernel`, a stock causal kernel (FlashAttention, vLLM's paged kernels), cannot run IHA layers with this
    mask, or None. Causal attention over the interleaved sequence is the paper's flat causal mask, and the kernel's own
    window of W * P virtual tokens the paper's window; the token causal mask is no causal pattern."""
    if mask_mode == "flat_causal":
        return None
    return (
        f"{kernel} runs causal attention over the interleaved sequence, which is IHA's flat causal mask; "
        f"iha_mask_mode={mask_mode!r} needs an explicit mask. Run it with transformers' sdpa, eager or flex_attention, "
        "or convert the model with the flat causal mask (`iha-convert --mask_mode flat_causal`, the default)."
    )


# The field of the first versions' second window ("token": the pseudo-tokens of the last W tokens), retired (CHANGELOG):
# a config that records it is refused where it changes the function.
RETIRED_WINDOW_FIELD = "iha_window_unit"


@dataclass
class IHAAttentionFields:
    """The IHA fields of every IHA config (`IHAConfig`, `IHAGemma3Config`), one name, type and default each, written
    here only; a config.json without one of them means its default.

    num_pseudo_heads: P, the pseudo-heads each head builds; attention runs over N * P virtual tokens.
    attention_types: one entry per layer of `ATTENTION_TYPES` (the config class fills the default).
    iha_mask_mode: "flat_causal" (the paper's: causal attention over the interleaved sequence) or "token_causal" (a
        pseudo-token sees every pseudo-token of its own and earlier tokens).
    iha_position_mode: "virtual" (the paper's: pseudo-token (n, p) at RoPE position n * P + p) or "shared" (at n;
        what an exact conversion of a pretrained model needs).
    iha_collapse_mode: "per_head" (R [H, P]) or "global" (R [H, H, P]).
    iha_collapse_init: "last" (exact with the flat mask), "mean" or "first".
    iha_cache_mode: "token" (the un-mixed keys and values, Llama's cache memory, re-mixed every step) or "pseudo" (the
        mixed and rotated pseudo keys and values, P times the memory, nothing re-mixed).

    Config classes call `set_up_attention_types` in `__post_init__`, before their base class's: it fills and checks
    the fields and derives `layer_types` (what transformers' caches and mask helpers read) from `attention_types`.
    """

    num_pseudo_heads: int = 2
    attention_types: list[str] | None = None
    iha_mask_mode: str = "flat_causal"
    iha_position_mode: str = "virtual"
    iha_collapse_mode: str = "per_head"
    iha_collapse_init: str = "last"
    iha_cache_mode: str = "token"

    def set_up_attention_types(self, default_types: list[str], kwargs: dict) -> None:
        """`kwargs`: the config's extra keyword arguments, from which the retired window field is taken."""
        self.attention_types = list(default_types if self.attention_types is None else self.attention_types)
        self._validate_iha_fields()
        self._refuse_token_window(kwargs.pop(RETIRED_WINDOW_FIELD, "virtual"))
        # Caches and transformers' mask helpers need to know only which layers are windowed.
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

    def _refuse_token_window(self, window_unit) -> None:
        # Sliding IHA layers at P > 1 are the only ones whose function the unit changed.
        if window_unit == "virtual" or self.num_pseudo_heads == 1 or IHA_SLIDING not in self.attention_types:
            return
        raise ValueError(
            f"This config was written with {RETIRED_WINDOW_FIELD}={window_unit!r}, a sliding window IHA no longer "
            "computes: sliding IHA layers now see the paper's flat window of sliding_window * P virtual tokens. "
            "Re-convert the source checkpoint (`iha-convert SOURCE OUTPUT`); weights trained under the token window "
            "compute another function under the paper's."
        )

    def _validate_iha_fields(self) -> None:
        for field in dataclasses.fields(IHAAttentionFields):
            allowed = FIELD_CHOICES.get(field.name)
            value = getattr(self, field.name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"`{field.name}` must be one of {list(allowed)}, got {value!r}.")
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

    def layer_spec(self, layer_idx: int) -> "IHALayerSpec":
        """What layer `layer_idx` is (`IHALayerSpec`)."""
        attention_type = self.attention_types[layer_idx]
        return IHALayerSpec(
            attention_type=attention_type,
            num_pseudo_heads=self.num_pseudo_heads if is_iha_layer(attention_type) else 1,
            sliding_window=self.sliding_window if is_sliding_layer(attention_type) else None,
            mask_mode=self.iha_mask_mode,
            position_mode=self.iha_position_mode,
            cache_mode=self.iha_cache_mode,
        )

    @property
    def iha_layer_indices(self) -> list[int]:
        return [i for i, attention_type in enumerate(self.attention_types) if is_iha_layer(attention_type)]


@dataclass(frozen=True)
class IHALayerSpec:
    """One attention layer of an IHA model, what every engine that runs it needs, derived in one place; built by a
    config's `layer_spec(layer_idx)`. Standard layers have P = 1: their virtual sequence is the token sequence."""

    attention_type: str
    num_pseudo_heads: int
    sliding_window: int | None
    mask_mode: str = IHAAttentionFields.iha_mask_mode
    position_mode: str = IHAAttentionFields.iha_position_mode
    cache_mode: str = IHAAttentionFields.iha_cache_mode

    @property
    def is_iha(self) -> bool:
        return is_iha_layer(self.attention_type)

    @property
    def is_sliding(self) -> bool:
        return is_sliding_layer(self.attention_type)

    @property
    def virtual_window(self) -> int | None:
        """The window in virtual tokens, what a stock kernel is told: virtual query i sees keys i - virtual_window < j
        (under the causal pattern). The paper's W * P for every pseudo-query; W on standard layers; None on full ones."""
        if not self.is_sliding:
            return None
        return self.sliding_window * self.num_pseudo_heads

    @property
    def reach_tokens(self) -> int | None:
        """How many tokens before its own a query can reach (None: all). W tokens reach W - 1 back; W * P virtual tokens
        reach from (n, 0) to virtual index (n - W) * P + 1, into token n - W: one more when P > 1. The last pseudo-query
        (n, P - 1) sees exactly the pseudo-tokens of tokens n - W + 1 .. n, the source's window."""
        if not self.is_sliding:
            return None
        return -(-(self.virtual_window - 1) // self.num_pseudo_heads)

    @property
    def cache_window(self) -> int | None:
        """The `sliding_window` a sliding cache layer must be built with (transformers' and vLLM's keep one token less):
        `sliding_window` on standard layers and at P = 1, one more when P > 1."""
        if not self.is_sliding:
            return None
        return self.reach_tokens + 1

    def virtual_position(self, token_position: int, pseudo_index: int) -> int:
        """The RoPE position of pseudo-token (n, p): n * P + p (the paper's "virtual" mode), or n ("shared")."""
        if self.is_iha and self.position_mode == "virtual":
            return token_position * self.num_pseudo_heads + pseudo_index
        return token_position

    def stock_kernel_refusal(self, kernel: str) -> str | None:
        """`stock_kernel_refusal` for this layer (standard layers: always None)."""
        return stock_kernel_refusal(kernel, self.mask_mode) if self.is_iha else None


# The choices of the fields that have them, by field name.
FIELD_CHOICES = {
    "iha_mask_mode": MASK_MODES,
    "iha_position_mode": POSITION_MODES,
    "iha_collapse_mode": COLLAPSE_MODES,
    "iha_collapse_init": COLLAPSE_INITS,
    "iha_cache_mode": CACHE_MODES,
}
# Every IHA field with its default: what a config.json without the field means.
FIELD_DEFAULTS = {field.name: field.default for field in dataclasses.fields(IHAAttentionFields)}


def check_per_layer(field_name: str, values: list, num_hidden_layers: int) -> None:
    if len(values) != num_hidden_layers:
        raise ValueError(
            f"`{field_name}` has {len(values)} entries but `num_hidden_layers` is {num_hidden_layers}: give exactly "
            "one entry per layer."
        )
