# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Interleaved Head Attention (IHA, arXiv 2602.21371) for Llama-family decoders.

An IHA layer projects q/k/v as usual, mixes the heads into P pseudo-heads per head, interleaves the pseudo-tokens
token-major into N * P virtual tokens, attends over them and folds the H * P pseudo-outputs back to H heads before
`o_proj`. Like transformers' `modular_*.py` files, this file states only what IHA changes (the attention, its caches,
each layer's RoPE inputs, the forward that builds the masks of `masking_iha.py`); the rest is transformers' Llama.
What a layer is comes from `layer_iha.py`. IHA layers attend with transformers' own attention functions; an installed
`iha` registers faster exact paths under `iha|<backend>` (`iha.attention`), and continuous batching, which a folder
loaded without the package refuses. Copied next to the weights: imports only torch, transformers and its siblings, and
never checks `isinstance(config, IHAConfig)` (remote-code classes are other objects than the package's).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

# transformers 5.4 - 5.9 copy into their remote-code cache only the files the loaded module imports itself, not the
# files those import: the module `auto_map` names imports every sibling it needs, directly.
from .configuration_iha import IHAConfig
from .layer_iha import FIELD_DEFAULTS, is_iha_layer
from .masking_iha import INSTALLED_PATH_PREFIX, cache_keyword, create_iha_masks
from .mixing_iha import collapse_matrix, mixing_matrix
from .version_iha import SUPPORTED_TRANSFORMERS  # noqa: F401


# Attention implementations whose functions take IHA's virtual sequence as it is.
IHA_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", *(f"flash_attention_{v}" for v in (2, 3, 4)))
# Engines that run a transformers model's layers with their own paged kernels, by the implementation name they
# register: their cache slots hold one key per real token, which IHA's N * P pseudo-tokens do not fit.
ENGINE_BACKENDS = {"vllm": "vLLM's Transformers backend", "sglang": "SGLang's Transformers backend"}
# The name under which an installed `iha` registers its continuous batching (`iha.attention.continuous_batching`).
CONTINUOUS_BATCHING_PATH = INSTALLED_PATH_PREFIX + "paged"
NEEDS_THE_PACKAGE = (
    "Continuous batching of IHA models (generate_batch, transformers serve) runs IHA's layers request by request on "
    "the paged cache, which the installed iha package provides: pip install iha, and import iha before loading the "
    "model (or serve with `iha serve MODEL --continuous_batching`)."
)


def take_cache_argument(past_key_values, kwargs: dict):
    """The cache passed to a forward under either name (`cache` from transformers 5.24, `past_key_values` before;
    users, TRL and PEFT may use either); removes the other name from `kwargs`. Both at once is refused."""
    other = kwargs.pop("cache", None)
    if other is not None and past_key_values is not None:
        raise ValueError("Pass the cache as `cache` or as `past_key_values`, not both.")
    return past_key_values if past_key_values is not None else other


def is_paged_cache(cache) -> bool:
    """Whether `cache` is continuous batching's paged cache (not a `Cache`: no per-row tensors)."""
    return isinstance(cache, PagedAttentionCache)


def continuous_batching_path():
    """The installed package's continuous batching of IHA layers, or a refusal naming the fix."""
    path = ALL_ATTENTION_FUNCTIONS.get(CONTINUOUS_BATCHING_PATH)
    if path is None:
        raise ValueError(NEEDS_THE_PACKAGE)
    return path


def check_attention_implementation(name: str | None, kwargs: dict, paged: bool | None = None) -> None:
    """Refuse, in one line, an engine's own backend (vLLM and SGLang hand every layer their paged kernels) or an
    interface IHA was not checked with; continuous batching's `paged|...` names run on its paged cache only (`paged`:
    whether this forward has one, None where the model is set up)."""
    name = name or "eager"
    if name in ENGINE_BACKENDS or "attention_instances" in kwargs:
        engine = ENGINE_BACKENDS.get(name, f"an engine's attention backend ({name!r}, passing `attention_instances`)")
        raise ValueError(
            f"IHA layers cannot run under {engine} (attn_implementation={name!r}): its paged kernels and cache slots "
            "hold one key per real token, while an IHA layer attends over N * P pseudo-tokens of mixed heads, so it "
            "would decode wrong tokens without any error. Serve IHA with the iha vLLM plugin (`vllm serve FOLDER`, "
            "`pip install iha[vllm]`) or `iha serve MODEL --continuous_batching`."
        )
    if name.startswith("paged|"):
        continuous_batching_path()
        if paged is False:
            raise ValueError(
                f"attn_implementation {name!r} runs only under continuous batching, with its paged cache; a plain "
                f"forward or generate() runs IHA with {name.removeprefix('paged|')!r}."
            )
    elif name not in IHA_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"IHA layers run with attn_implementation in {list(IHA_ATTENTION_IMPLEMENTATIONS)}, not {name!r}: an "
            "attention interface IHA was not checked with may run ordinary attention over the tokens and give wrong "
            "outputs without any error. Load the model with one of those."
        )


def virtual_flash_kwargs(kwargs: dict, num_pseudo_heads: int) -> dict:
    """FlashAttention finds packed sequences from position ids / cumulative lengths: give them in virtual units."""
    kwargs = dict(kwargs)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        virtual_offsets = torch.arange(num_pseudo_heads, device=position_ids.device)
        kwargs["position_ids"] = (position_ids[..., None] * num_pseudo_heads + virtual_offsets).flatten(-2)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key] * num_pseudo_heads
    return kwargs


def mix_and_interleave(states: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """states [B, M, N, d] (M source heads), alpha [M, H, P] -> [B, H, N * P, d]: `out[b, h, n * P + p] =
    sum_m alpha[m, h, p] * states[b, m, n]`, a transposed view of a contiguous [B, N * P, H, d] tensor (one
    [P * H, M] @ [M, d] product per token, no permuting copies; SDPA reads the layout without a copy)."""
    batch_size, _, seq_len, head_dim = states.shape
    _, num_target_heads, num_pseudo_heads = alpha.shape
    mixed = torch.matmul(mixing_matrix(alpha).to(states.dtype), states.transpose(1, 2))  # [B, N, P * H, d]
    return mixed.view(batch_size, seq_len * num_pseudo_heads, num_target_heads, head_dim).transpose(1, 2)


def apply_pseudo_rotation(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pseudo-token p of every token by RoPE at position p (states [B, H, N * P, d], cos/sin [P, d]): with
    virtual positions Rot(n * P + p) = Rot(p) . Rot(n * P), and Rot(n * P) ran before the mixing (it commutes)."""
    num_pseudo_heads = cos.shape[0]
    states = states.unflatten(2, (states.shape[2] // num_pseudo_heads, num_pseudo_heads))  # [B, H, N, P, d]
    half = states.shape[-1] // 2
    # states * cos + rotate_half(states) * sin, added half by half in place: fewer passes over these P-times larger
    # tensors (the whole re-mixed cache at every decoding step in token cache mode) than materialising rotate_half.
    rotated = states * cos
    rotated[..., :half].addcmul_(states[..., half:], sin[..., :half], value=-1)
    rotated[..., half:].addcmul_(states[..., :half], sin[..., half:])
    return rotated.flatten(2, 3)


def mixing_dtype() -> torch.dtype:
    """The dtype of new mixing parameters: fp32 where the default dtype is 16-bit. Most entries start at 0 or 1, and
    a step of ~1e-3 is below half the spacing of bf16 numbers near 1.0: in bf16 the identity entries would never move.
    The forward casts the mixing to the activations' dtype, which keeps identity exact."""
    return torch.promote_types(torch.get_default_dtype(), torch.float32)


class IHAHeadMixing(nn.Module):
    """The learned parameters of one IHA layer, in a submodule of their own (PEFT's `modules_to_save=["head_mixing"]`)
    and in fp32 whatever the model's dtype (`mixing_dtype`, `_keep_in_fp32_modules_strict`): `alpha_q` [H, H, P]
    (`Q~[n, h, p] = sum_m alpha_q[m, h, p] * Q[n, m]`), `alpha_k`, `alpha_v` [H_kv, H_kv, P] (keys and values mix
    within the KV heads, group-preserving GQA) and `collapse`, [H, P] (per head) or [H, H, P] (global)."""

    def __init__(
        self,
        num_heads: int,
        num_key_value_heads: int,
        num_pseudo_heads: int,
        collapse_mode: str = FIELD_DEFAULTS["iha_collapse_mode"],
        collapse_init: str = FIELD_DEFAULTS["iha_collapse_init"],
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_pseudo_heads = num_pseudo_heads
        self.collapse_mode = collapse_mode
        self.collapse_init = collapse_init
        dtype = mixing_dtype()
        kv_shape = (num_key_value_heads, num_key_value_heads, num_pseudo_heads)
        self.alpha_q = nn.Parameter(torch.empty(num_heads, num_heads, num_pseudo_heads, dtype=dtype))
        self.alpha_k = nn.Parameter(torch.empty(kv_shape, dtype=dtype))
        self.alpha_v = nn.Parameter(torch.empty(kv_shape, dtype=dtype))
        if collapse_mode == "per_head":
            self.collapse = nn.Parameter(torch.empty(num_heads, num_pseudo_heads, dtype=dtype))
        else:
            self.collapse = nn.Parameter(torch.empty(num_heads, num_heads, num_pseudo_heads, dtype=dtype))
        self.reset_to_identity()

    def identity_tensors(self) -> dict[str, torch.Tensor]:
        """Identity mixing (every pseudo-head a copy of its own head) and the configured collapse init."""
        num_pseudo = self.num_pseudo_heads
        identity_q = torch.eye(self.num_heads).unsqueeze(-1).expand(-1, -1, num_pseudo)
        identity_kv = torch.eye(self.num_key_value_heads).unsqueeze(-1).expand(-1, -1, num_pseudo)
        pseudo_weights = torch.zeros(num_pseudo)
        if self.collapse_init == "last":
            pseudo_weights[-1] = 1.0
        elif self.collapse_init == "first":
            pseudo_weights[0] = 1.0
        else:
            pseudo_weights.fill_(1.0 / num_pseudo)
        if self.collapse_mode == "per_head":
            collapse = pseudo_weights.expand(self.num_heads, -1)
        else:
            collapse = torch.eye(self.num_heads).unsqueeze(-1) * pseudo_weights
        return {"alpha_q": identity_q, "alpha_k": identity_kv, "alpha_v": identity_kv.clone(), "collapse": collapse}

    def reset_to_identity(self):
        # `init.copy_` leaves parameters that were loaded from a checkpoint untouched.
        for name, value in self.identity_tensors().items():
            parameter = getattr(self, name)
            init.copy_(parameter, value.to(device=parameter.device, dtype=parameter.dtype))

    def mix_queries(self, query_states: torch.Tensor) -> torch.Tensor:
        return mix_and_interleave(query_states, self.alpha_q)

    def mix_keys_values(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mix_and_interleave(key_states, self.alpha_k), mix_and_interleave(value_states, self.alpha_v)

    def mix_and_rotate(
        self,
        query_states: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        pseudo_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of the H (H_kv) heads -> the interleaved N * P pseudo-tokens, with the per-p
        rotation of virtual positions applied to the mixed queries and keys when it is given."""
        query_states = self.mix_queries(query_states)
        key_states, value_states = self.mix_keys_values(key_states, value_states)
        if pseudo_rotation is not None:
            pseudo_cos, pseudo_sin = pseudo_rotation
            query_states = apply_pseudo_rotation(query_states, pseudo_cos, pseudo_sin)
            key_states = apply_pseudo_rotation(key_states, pseudo_cos, pseudo_sin)
        return query_states, key_states, value_states

    def collapse_heads(self, attn_output: torch.Tensor) -> torch.Tensor:
        """[B, N * P, H, d] pseudo-outputs -> [B, N, H, d] head outputs."""
        batch_size, virtual_len, num_heads, head_dim = attn_output.shape
        num_tokens = virtual_len // self.num_pseudo_heads
        collapse = self.collapse.to(attn_output.dtype)
        if self.collapse_mode == "per_head":
            # out[n, h] = sum_p R[h, p] * o[n, p, h]: a weighted sum over the pseudo axis, accumulated in place.
            pseudo = attn_output.view(batch_size, num_tokens, self.num_pseudo_heads, num_heads, head_dim)
            collapsed = pseudo[:, :, 0] * collapse[:, 0, None]
            for pseudo_index in range(1, self.num_pseudo_heads):
                collapsed.addcmul_(pseudo[:, :, pseudo_index], collapse[:, pseudo_index, None])
            return collapsed
        # out[n, h] = sum_{p, m} R[h, m, p] * o[n, p, m]: one [H, P * H] @ [P * H, d] product per token.
        pseudo = attn_output.reshape(batch_size, num_tokens, self.num_pseudo_heads * num_heads, head_dim)
        return torch.matmul(collapse_matrix(collapse), pseudo)

    def extra_repr(self):
        return (
            f"heads={self.num_heads}, kv_heads={self.num_key_value_heads}, pseudo_heads={self.num_pseudo_heads}, "
            f"collapse={self.collapse_mode}"
        )


def update_pseudo_cache(
    cache: Cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, num_pseudo_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pseudo cache mode: cache the mixed, rotated keys and values of the new tokens side by side in the head
    dimension ([B, H_kv, N, P * d], so the cache still counts tokens); return all of them as [B, H_kv, N * P, d]."""
    batch_size, num_kv_heads, virtual_len, head_dim = key_states.shape
    token_shape = (batch_size, num_kv_heads, virtual_len // num_pseudo_heads, num_pseudo_heads * head_dim)
    keys, values = cache.update(key_states.reshape(token_shape), value_states.reshape(token_shape), layer_idx)
    virtual_shape = (batch_size, num_kv_heads, -1, head_dim)
    return keys.reshape(virtual_shape), values.reshape(virtual_shape)


class IHAAttention(nn.Module):
    """Attention of one layer: Interleaved Head Attention on IHA layers, Llama's multi-head attention otherwise."""

    def __init__(self, config: IHAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.spec = config.layer_spec(layer_idx)  # what this layer is: type, P, window (`layer_iha.IHALayerSpec`)
        self.attention_type = self.spec.attention_type
        self.is_iha = self.spec.is_iha
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.num_pseudo_heads = self.spec.num_pseudo_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = self.spec.sliding_window
        # What a kernel with its own window is told (FlashAttention reads it; the others take it from the mask): the
        # window in tokens on standard layers, in virtual tokens (W * P) on IHA layers.
        self.kernel_sliding_window = self.spec.virtual_window
        # SmolLM3's NoPE layers (0: no rotation of queries and keys at all).
        self.use_rope = bool(config.no_rope_layers[layer_idx])

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3's per-head norm of queries and keys over head_dim (Gemma 3's attention sets its own kind).
        self.q_norm = self.k_norm = None
        if config.use_qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # Where the cache stands: before the mixing ("token", Llama's memory, the cache re-mixed every step), or after
        # it ("mixed": `iha_cache_mode="pseudo"`, P times the memory, nothing re-mixed). `update_cache` writes there.
        self.cache_stage = "mixed" if self.is_iha and config.iha_cache_mode == "pseudo" else "token"
        self.head_mixing = None
        if self.is_iha:
            self.head_mixing = IHAHeadMixing(
                self.num_heads,
                self.num_key_value_heads,
                config.num_pseudo_heads,
                collapse_mode=config.iha_collapse_mode,
                collapse_init=config.iha_collapse_init,
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: "LayerRotation",
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The decoder layer (Llama's or Gemma 3's) passes the cache under its release's name.
        past_key_values = take_cache_argument(past_key_values, kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.q_norm is not None:
            # Qwen3 / Gemma 3 normalise each projected head before the mixing (a per-head norm does not commute with it).
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)

        if self.use_rope:
            # At token level (n, or n * P in virtual mode): a rotation commutes with the mixing across heads.
            cos, sin = position_embeddings.token
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        # Continuous batching's paged cache is the installed package's to write and attend (`iha.attention`).
        continuous_batching = continuous_batching_path() if is_paged_cache(past_key_values) else None
        key_states, value_states = self.update_cache(past_key_values, key_states, value_states, "token", kwargs)

        attn_implementation = self.config._attn_implementation
        if continuous_batching is not None:
            attn_implementation = continuous_batching.attention_implementation(attn_implementation)
        if self.is_iha:
            # The heads mixed into the interleaved N * P pseudo-tokens (rotated by p in virtual position mode).
            query_states, key_states, value_states = self.head_mixing.mix_and_rotate(
                query_states, key_states, value_states, position_embeddings.pseudo if self.use_rope else None
            )
            key_states, value_states = self.update_cache(past_key_values, key_states, value_states, "mixed", kwargs)
            if attn_implementation.startswith("flash"):
                kwargs = virtual_flash_kwargs(kwargs, self.num_pseudo_heads)

        attention_interface = self.attention_interface(attn_implementation, continuous_batching)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.kernel_sliding_window,
            **kwargs,
        )

        if self.is_iha:
            attn_output = self.head_mixing.collapse_heads(attn_output)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def update_cache(self, cache, key_states, value_states, stage: str, kwargs: dict):
        """Write the keys and values of `stage` ("token": before the mixing, "mixed": after it) into `cache` where this
        layer's cache stands (`cache_stage`), and return every key and value to attend. Continuous batching's pages
        always stand before the mixing."""
        if is_paged_cache(cache):
            if stage != "token":
                return key_states, value_states
            return continuous_batching_path().update_cache(cache, key_states, value_states, self.layer_idx, kwargs)
        if cache is None or stage != self.cache_stage:
            return key_states, value_states
        if stage == "mixed":
            return update_pseudo_cache(cache, key_states, value_states, self.layer_idx, self.num_pseudo_heads)
        return cache.update(key_states, value_states, self.layer_idx)

    def attention_interface(self, attn_implementation: str, continuous_batching=None) -> Callable:
        """The attention function of this call. IHA layers take the installed package's exact fast path where it
        registered one (`iha|<implementation>`; under continuous batching its per-request attention); everything else
        is transformers' own function."""
        if self.is_iha and continuous_batching is not None:
            return continuous_batching
        if self.is_iha and INSTALLED_PATH_PREFIX + attn_implementation in ALL_ATTENTION_FUNCTIONS:
            return ALL_ATTENTION_FUNCTIONS[INSTALLED_PATH_PREFIX + attn_implementation]
        return ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, eager_attention_forward)


class LayerRotation(NamedTuple):
    """The RoPE inputs of one layer: `token` rotates queries and keys before the mixing (at n, or n * P on IHA layers
    with virtual positions), `pseudo` (virtual positions only) pseudo-head p by p after it."""

    token: tuple[torch.Tensor, torch.Tensor]
    pseudo: tuple[torch.Tensor, torch.Tensor] | None = None


class RotaryInputs(NamedTuple):
    """The RoPE inputs of a forward for each kind of layer (`rotary_inputs`)."""

    standard: LayerRotation
    iha: LayerRotation

    def for_layer(self, attention_type: str) -> LayerRotation:
        return self.iha if is_iha_layer(attention_type) else self.standard


def rotary_inputs(
    rotary_emb: nn.Module,
    attention_scaling: float,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    config,
    **rotary_kwargs,
) -> RotaryInputs:
    """RoPE for standard layers (at n), IHA layers (at n, or n * P) and the per-p rotation; `rotary_kwargs` go to
    `rotary_emb` (Gemma 3's `layer_type`), `attention_scaling` is what it multiplies cos and sin by (yarn, longrope)."""
    token_rotation = LayerRotation(rotary_emb(hidden_states, position_ids=position_ids, **rotary_kwargs))
    if config.iha_position_mode == "shared":
        return RotaryInputs(standard=token_rotation, iha=token_rotation)
    num_pseudo = config.num_pseudo_heads
    iha_rotation = rotary_emb(hidden_states, position_ids=position_ids * num_pseudo, **rotary_kwargs)
    pseudo_positions = torch.arange(num_pseudo, device=hidden_states.device)[None]
    pseudo_cos, pseudo_sin = rotary_emb(hidden_states, position_ids=pseudo_positions, **rotary_kwargs)
    # The token-level rotation already carries `attention_scaling`: the per-p rotation must be a pure rotation.
    pseudo_rotation = (pseudo_cos[0] / attention_scaling, pseudo_sin[0] / attention_scaling)
    return RotaryInputs(standard=token_rotation, iha=LayerRotation(iha_rotation, pseudo_rotation))


class IHADecoderLayer(LlamaDecoderLayer):
    """Llama's block around IHA's attention (`position_embeddings` is the layer's `LayerRotation`)."""

    def __init__(self, config: IHAConfig, layer_idx: int):
        # Not `LlamaDecoderLayer.__init__`, which would build (and initialise) a Llama attention to throw away.
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.attention_type = config.attention_types[layer_idx]
        self.self_attn = IHAAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class IHAPreTrainedModel(LlamaPreTrainedModel):
    config_class = IHAConfig
    config: IHAConfig
    _no_split_modules = ["IHADecoderLayer"]
    # Under any 16-bit load dtype the mixing loads in fp32 (`mixing_dtype`; the non-strict list acts for fp16 only).
    _keep_in_fp32_modules_strict = ["head_mixing"]
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache's names in the supported releases
    _can_record_outputs = {"hidden_states": IHADecoderLayer, "attentions": IHAAttention}

    def _init_weights(self, module):
        super()._init_weights(module)
        # A new IHA layer starts at identity: a converted checkpoint computes what the original computed.
        if isinstance(module, IHAHeadMixing):
            module.reset_to_identity()

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # Where transformers settles the attention implementation: refuse a wrong one before any forward.
        attn_implementation = super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        self._check_attention_implementation(attn_implementation)
        return attn_implementation

    @property
    def supports_context_parallel(self) -> bool:
        # Context parallelism shards the token sequence and runs plain causal attention per shard, not what an IHA
        # layer computes over its interleaved pseudo-tokens: accelerate refuses a model that says so.
        return False

    def _check_attention_implementation(self, name: str | None = None):
        name = name or self.config._attn_implementation
        iha_layers = self.config.iha_layer_indices
        if not iha_layers:
            return
        # An engine that builds the model under its own attention name (vLLM, SGLang) stops here, at load time.
        check_attention_implementation(name, kwargs={})
        if (name or "").startswith("flash"):
            refusal = self.config.layer_spec(iha_layers[0]).stock_kernel_refusal("FlashAttention")
            if refusal is not None:
                raise ValueError(refusal)


class IHAModel(IHAPreTrainedModel):
    def __init__(self, config: IHAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [IHADecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def layer_rotations(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict[str, RotaryInputs]:
        """The RoPE inputs of each layer type: one for every layer here (Gemma 3 has one per layer type)."""
        rotations = rotary_inputs(
            self.rotary_emb, self.rotary_emb.attention_scaling, hidden_states, position_ids, self.config
        )
        return dict.fromkeys(self.config.layer_types, rotations)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        past_key_values = take_cache_argument(past_key_values, kwargs)

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)
        if inputs_embeds.shape[1] == 0:
            # Caught here with a clear message, before the attention reshapes an empty sequence.
            raise ValueError(
                "IHA got an input of 0 tokens: give at least one token per row (an empty prompt, or one that "
                "tokenizes to nothing, has nothing to attend to)"
            )

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if self.config.iha_layer_indices:
            # Once per forward, not in every layer: an engine's kernels IHA layers cannot be right under stop it here.
            check_attention_implementation(self.config._attn_implementation, kwargs, is_paged_cache(past_key_values))
        if is_paged_cache(past_key_values):
            # Continuous batching: one packed row of requests (the installed package's; refused without it).
            mask_mapping = continuous_batching_path().create_masks(self.config, attention_mask, kwargs, past_key_values)
        # Masks may come prepared (a dict per attention type, from `create_masks_for_generate`).
        elif isinstance(attention_mask, dict):
            mask_mapping = attention_mask
        else:
            mask_mapping = create_iha_masks(self.config, inputs_embeds, attention_mask, past_key_values, position_ids)

        hidden_states = inputs_embeds
        rotations_by_layer_type = self.layer_rotations(hidden_states, position_ids)

        for layer_idx, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            rotations = rotations_by_layer_type[self.config.layer_types[layer_idx]]
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.attention_type],
                position_embeddings=rotations.for_layer(decoder_layer.attention_type),
                position_ids=position_ids,
                use_cache=use_cache,
                **cache_keyword(past_key_values),
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **cache_keyword(past_key_values))


class IHAForCausalLM(IHAPreTrainedModel, LlamaForCausalLM):
    """Llama's causal LM (its forward: logits, loss) on `IHAModel`, with what generation needs to know of IHA."""

    def __init__(self, config: IHAConfig):
        # Not `LlamaForCausalLM.__init__`, which would build a Llama model to throw away.
        IHAPreTrainedModel.__init__(self, config)
        self.model = IHAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @staticmethod
    def create_masks_for_generate(
        config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None, **kwargs
    ) -> dict:
        # `generate` prepares masks ahead of compiled forwards with static caches; token-level 4D masks would be
        # wrong for IHA layers, so hand over the per-type masks the model itself would build.
        past_key_values = take_cache_argument(past_key_values, kwargs)
        return create_iha_masks(config, inputs_embeds, attention_mask, past_key_values, position_ids)

    def init_continuous_batching(self, *args, **kwargs):
        # Continuous batching is the installed package's: it starts the engine with what IHA layers need.
        return continuous_batching_path().init_continuous_batching(
            self, super().init_continuous_batching, *args, **kwargs
        )

    def _get_static_cache_init_shape(self):
        # A StaticCache allocated ahead of the first forward: in pseudo cache mode IHA layers store P * d per head.
        init_shape = super()._get_static_cache_init_shape()
        if init_shape is None or self.config.iha_cache_mode != "pseudo":
            return init_shape
        num_heads, head_dim = init_shape
        head_dims = head_dim if isinstance(head_dim, list) else [head_dim] * self.config.num_hidden_layers
        head_dims = [
            dim * self.config.num_pseudo_heads if is_iha_layer(attention_type) else dim
            for dim, attention_type in zip(head_dims, self.config.attention_types)
        ]
        return num_heads, head_dims


__all__ = ["IHAForCausalLM", "IHAModel", "IHAPreTrainedModel", "IHAHeadMixing"]
