# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Interleaved Head Attention (IHA) on Gemma 3's text decoder: the configuration. Travels with the weights: imports
only transformers and its siblings, no torch (a config or tokenizer loads where torch is absent)."""

# First: the version check refuses a transformers below the supported range with one clear error.
from .version_iha import SUPPORTED_TRANSFORMERS  # noqa: F401  # isort: skip

from huggingface_hub.dataclasses import strict
from transformers import Gemma3TextConfig

from .layer_iha import IHA_FULL, IHA_SLIDING, STANDARD_SLIDING, IHAAttentionFields


# Gemma 3 fields whose non-default value IHA layers cannot compute: (field, the value Gemma 3 language models use).
UNSUPPORTED_GEMMA3_FIELDS = (
    ("attn_logit_softcapping", None),
    ("final_logit_softcapping", None),
    ("use_bidirectional_attention", False),
)


@strict
class IHAGemma3Config(IHAAttentionFields, Gemma3TextConfig):
    r"""
    Configuration of a Gemma 3 text decoder whose attention layers are Interleaved Head Attention (IHA) layers.

    Every `Gemma3TextConfig` field keeps its meaning (`query_pre_attn_scalar`, `rope_parameters` keyed by layer type,
    `sliding_window`, ...). The IHA fields are `IHAAttentionFields`'s (`layer_iha.py`); `attention_types` defaults to
    IHA layers in Gemma 3's own layout (`layer_types` when given, else five sliding layers to one full layer).
    `attn_logit_softcapping`, `final_logit_softcapping` and `use_bidirectional_attention` must keep the values Gemma 3
    language models use (None, None, False).

    ```python
    >>> from iha import IHAGemma3Config, IHAGemma3ForCausalLM
    >>> config = IHAGemma3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    ...                          num_key_value_heads=1, head_dim=16, sliding_window=8)
    >>> model = IHAGemma3ForCausalLM(config)
    ```
    """

    model_type = "iha_gemma3"
    # No tensor parallel plan: sharding q/k/v by heads would cut the cross-head mixing apart (see `IHAConfig`).
    base_model_tp_plan = None
    # `IHAConfig`'s switches of the other Llama-family blocks, which IHA's attention reads, as Gemma 3 has them: no
    # Qwen3 q/k norm (its attention sets Gemma's own), one `attention_bias` for all four projections, RoPE in every
    # layer. Declared, not fields: a Gemma 3 config.json never carries them.
    use_qk_norm = False

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias

    @property
    def no_rope_layers(self) -> list[int]:
        return [1] * self.num_hidden_layers

    def __post_init__(self, **kwargs):
        for field_name, supported in UNSUPPORTED_GEMMA3_FIELDS:
            if getattr(self, field_name) != supported:
                raise ValueError(
                    f"`{field_name}` is {getattr(self, field_name)!r}, but IHA Gemma 3 models support only "
                    f"{supported!r} (what Gemma 3 language models use)."
                )
        if self.layer_types is not None:
            source_types = list(self.layer_types)
        else:  # Gemma 3's layout: every `sliding_window_pattern`-th layer is full, the others slide.
            pattern = kwargs.get("sliding_window_pattern", 6)
            source_types = [
                "full_attention" if (layer_idx + 1) % pattern == 0 else STANDARD_SLIDING
                for layer_idx in range(self.num_hidden_layers)
            ]
        if self.attention_types is None:
            self.layer_types = None  # derived again from `attention_types` below
        self.set_up_attention_types(
            [IHA_SLIDING if layer_type == STANDARD_SLIDING else IHA_FULL for layer_type in source_types], kwargs
        )
        super().__post_init__(**kwargs)


__all__ = ["IHAGemma3Config"]
