# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Interleaved Head Attention (IHA) on Gemma 3's text decoder: `modeling_iha.IHAAttention` inside Gemma 3's block
(per-head (1 + w) q/k norms, the `query_pre_attn_scalar` scale, its four norms, scaled embeddings, a RoPE base per
layer type); forward, masks, caches and generation are `IHAModel`'s and `IHAForCausalLM`'s. Travels with the weights.
"""

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3MLP,
    Gemma3PreTrainedModel,
    Gemma3RMSNorm,
    Gemma3RotaryEmbedding,
    Gemma3TextScaledWordEmbedding,
)

# transformers 5.4 - 5.9 copy into their remote-code cache only the files the loaded module imports itself, not the
# files those import: this module, which `auto_map` names, imports every sibling that `modeling_iha` needs, directly.
from .configuration_iha import IHAConfig  # noqa: F401
from .configuration_iha_gemma3 import IHAGemma3Config
from .layer_iha import IHALayerSpec  # noqa: F401
from .masking_iha import create_iha_masks  # noqa: F401
from .mixing_iha import mixing_matrix  # noqa: F401
from .modeling_iha import (
    IHAAttention,
    IHAForCausalLM,
    IHAModel,
    IHAPreTrainedModel,
    RotaryInputs,
    rotary_inputs,
)
from .version_iha import SUPPORTED_TRANSFORMERS  # noqa: F401


class IHAGemma3Attention(IHAAttention):
    """IHA attention with Gemma 3's per-head (1 + w) query and key norms and its `query_pre_attn_scalar` scale."""

    def __init__(self, config: IHAGemma3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.q_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class IHAGemma3DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's block (its forward: norms after attention and around the MLP) around IHA's attention."""

    def __init__(self, config: IHAGemma3Config, layer_idx: int):
        # Gemma 3's modules with IHA's attention, built here: `Gemma3DecoderLayer.__init__` would first build (and
        # randomly initialise) a Gemma 3 attention to throw away.
        GradientCheckpointingLayer.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.attention_type = config.attention_types[layer_idx]
        self.self_attn = IHAGemma3Attention(config=config, layer_idx=layer_idx)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class IHAGemma3PreTrainedModel(IHAPreTrainedModel, Gemma3PreTrainedModel):
    """IHA's flags and mixing init, then Gemma 3's init: (1 + w) norms at zero, the embedding scale and the RoPE
    frequencies of each layer type (buffers not saved with the weights)."""

    config_class = IHAGemma3Config
    config: IHAGemma3Config
    input_modalities = ("text",)
    _no_split_modules = ["IHAGemma3DecoderLayer"]
    _can_record_outputs = {
        "hidden_states": IHAGemma3DecoderLayer,
        "attentions": IHAGemma3Attention,
    }


class IHAGemma3TextModel(IHAGemma3PreTrainedModel, IHAModel):
    """`IHAModel`'s forward on Gemma 3's modules: scaled embeddings, Gemma's block and a RoPE base per layer type."""

    def __init__(self, config: IHAGemma3Config):
        # `IHAModel.__init__` builds Llama's block; this builds Gemma 3's (the forward is `IHAModel`'s).
        IHAGemma3PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = Gemma3TextScaledWordEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=config.hidden_size**0.5
        )
        self.layers = nn.ModuleList(
            [IHAGemma3DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma3RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def layer_rotations(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict[str, RotaryInputs]:
        """The RoPE inputs (`rotary_inputs`) of each layer type, each with its own base (`rope_parameters`)."""
        return {
            layer_type: rotary_inputs(
                self.rotary_emb,
                getattr(self.rotary_emb, f"{layer_type}_attention_scaling"),
                hidden_states,
                position_ids,
                self.config,
                layer_type=layer_type,
            )
            for layer_type in set(self.config.layer_types)
        }


class IHAGemma3ForCausalLM(IHAGemma3PreTrainedModel, IHAForCausalLM):
    """`IHAForCausalLM` (Llama's forward, generation, masks for `generate`, caches) on the Gemma 3 text model."""

    def __init__(self, config: IHAGemma3Config):
        # `IHAForCausalLM.__init__` builds the Llama-block `IHAModel`; this builds Gemma 3's.
        IHAGemma3PreTrainedModel.__init__(self, config)
        self.model = IHAGemma3TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["IHAGemma3ForCausalLM", "IHAGemma3TextModel", "IHAGemma3PreTrainedModel"]
