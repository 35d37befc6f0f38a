# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Interleaved Head Attention (IHA) model configuration. Travels with the weights: imports only transformers and its
siblings, and no torch, like transformers' own configurations (a config or tokenizer loads where torch is absent)."""

# First: the version check refuses a transformers below the supported range with one clear error, before the imports
# below fail with unrelated ones (releases before 5.4 cannot even define this class).
from .version_iha import SUPPORTED_TRANSFORMERS  # noqa: F401  # isort: skip

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .layer_iha import IHA_FULL, IHA_SLIDING, IHAAttentionFields, check_per_layer, paper_hybrid_layout


@strict
class IHAConfig(IHAAttentionFields, LlamaConfig):
    r"""
    Configuration of a Llama-family decoder whose attention layers are Interleaved Head Attention (IHA) layers.

    Every `LlamaConfig` field keeps its meaning (GQA through `num_key_value_heads`, `head_dim`, `rope_parameters`
    with every rope type transformers offers, `tie_word_embeddings`, ...). The IHA fields (`num_pseudo_heads`,
    `attention_types`, `iha_mask_mode`, `iha_position_mode`, `iha_collapse_mode`, `iha_collapse_init`,
    `iha_cache_mode`) are `IHAAttentionFields`'s, documented with their defaults in `layer_iha.py`. Here:

    attention_types (`list[str]`, *optional*):
        Defaults to IHA in every layer, sliding when `sliding_window` is set. `layer_types` (what caches and mask
        helpers read) is derived from it.
    sliding_window (`int`, *optional*):
        The window of the sliding layers in tokens. A sliding IHA layer sees the paper's flat window of
        `sliding_window * P` virtual tokens (`layer_iha.IHALayerSpec.virtual_window`).
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
        self.set_up_attention_types([default_type] * self.num_hidden_layers, kwargs)
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
        """A config with the paper's FLOP-matched hybrid layout (4 sliding IHA : 1 global MHA, W = N / (2 P^2))."""
        probe = cls(**kwargs)
        layout = paper_hybrid_layout(probe.num_hidden_layers, probe.num_pseudo_heads, training_length, global_every)
        kwargs.pop("layer_types", None)
        return cls(**{**kwargs, **layout})


__all__ = ["IHAAttentionFields", "IHAConfig", "paper_hybrid_layout"]
