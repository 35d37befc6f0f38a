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
"""Interleaved Head Attention (IHA, arXiv 2602.21371) for Llama-family decoders.

An IHA layer projects q/k/v as usual, mixes the heads into P pseudo-heads per head with learned coefficients,
interleaves the pseudo-tokens token-major into a sequence of N * P virtual tokens, runs ordinary attention over it
and folds the H * P pseudo-outputs back to H heads with a learned collapse before `o_proj`.

The masks live in `masking_iha.py`, the choice of kernel in `attention_iha.py`, and the two fast paths on SDPA in
their own files (`blocked_local_iha.py`, `packed_documents_iha.py`); `iha.models.iha.naive_iha` is the plain reference every
path is tested against. This file is copied next to the weights by `save_pretrained`, so it imports only torch,
transformers and its siblings (those above, `configuration_iha.py`, and `compat_iha.py`, where every difference
between transformers releases is handled). Remote-code classes are different objects from the installed package's: nothing here may check
`isinstance(config, IHAConfig)`.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention_iha import IHA_ATTENTION_PATHS, choose_attention_path, virtual_flash_kwargs

# transformers 5.4 - 5.9 copy into their remote-code cache only the files the loaded module imports itself, not the
# files those import: the module `auto_map` names imports every sibling it needs, directly.
from .blocked_local_iha import BlockedLocalMask  # noqa: F401
from .compat_iha import (
    CACHE_ARGUMENT_NAMES,
    cache_keyword,
    check_untested_release,
    output_cache,
    paged_cache_update,
    take_cache_argument,
)
from .configuration_iha import IHAConfig, is_iha_layer, is_sliding_layer
from .masking_iha import create_iha_masks, kernel_sliding_window
from .packed_documents_iha import PackedDocumentsMask  # noqa: F401
from .serving_iha import (
    PAGED_ATTENTION_IMPLEMENTATIONS,
    check_attention_engine,
    continuous_batching_config_for_iha,
    create_paged_iha_masks,
    is_paged_cache,
    paged_attention_implementation,
)


logger = logging.get_logger(__name__)


class IHARMSNorm(LlamaRMSNorm):
    pass


class IHAMLP(LlamaMLP):
    pass


class IHARotaryEmbedding(LlamaRotaryEmbedding):
    pass


def mix_and_interleave(states: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Mix heads into pseudo-heads and interleave them token-major.

    states [B, M, N, d] (M source heads), alpha [M, H, P] -> [B, H, N * P, d] where virtual index n * P + p holds
    pseudo-head p of token n: `out[b, h, n * P + p] = sum_m alpha[m, h, p] * states[b, m, n]`.

    The result is a transposed view of a contiguous [B, N * P, H, d] tensor (the layout `q_proj` produces and SDPA
    reads without a copy): one [P * H, M] @ [M, d] product per token writes every pseudo-head of that token in
    place, where an einsum into [B, H, N, P, d] would need two extra permuting copies.
    """
    batch_size, _, seq_len, head_dim = states.shape
    num_source_heads, num_target_heads, num_pseudo_heads = alpha.shape
    # Row p * H + h of the mixing matrix holds alpha[:, h, p].
    mixing_matrix = alpha.permute(2, 1, 0).reshape(num_pseudo_heads * num_target_heads, num_source_heads)
    mixed = torch.matmul(mixing_matrix.to(states.dtype), states.transpose(1, 2))  # [B, N, P * H, d]
    return mixed.view(batch_size, seq_len * num_pseudo_heads, num_target_heads, head_dim).transpose(1, 2)


def apply_pseudo_rotation(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pseudo-token p of every token by RoPE at position p (states [B, H, N * P, d], cos/sin [P, d]).

    Virtual positions are n * P + p and Rot(n * P + p) = Rot(p) . Rot(n * P): the token-level rotation at n * P was
    applied before mixing (it commutes with mixing across heads), so only this small per-p rotation is left.
    """
    num_pseudo_heads = cos.shape[0]
    states = states.unflatten(2, (states.shape[2] // num_pseudo_heads, num_pseudo_heads))  # [B, H, N, P, d]
    half = states.shape[-1] // 2
    # states * cos + rotate_half(states) * sin, with rotate_half(x) = (-x2, x1) added half by half in place: on these
    # P-times larger tensors, fewer passes over memory than materialising rotate_half (this runs on the whole
    # re-mixed cache at every decoding step in token cache mode).
    rotated = states * cos
    rotated[..., :half].addcmul_(states[..., half:], sin[..., :half], value=-1)
    rotated[..., half:].addcmul_(states[..., :half], sin[..., half:])
    return rotated.flatten(2, 3)


def mixing_dtype() -> torch.dtype:
    """The dtype of new mixing parameters: fp32 where the default dtype is 16-bit, else the default (fp32 or fp64).

    Most mixing entries start at exactly 0 or 1, and an optimizer step of about the learning rate (1e-3) is below half
    the spacing of bf16 numbers near 1.0 (2^-8 below, 2^-7 above): in bf16 the update rounds away and the identity
    entries never move. The forward casts the mixing to the activations' dtype, which keeps identity exact.
    """
    return torch.promote_types(torch.get_default_dtype(), torch.float32)


class IHAHeadMixing(nn.Module):
    """The learned parameters of one IHA layer: head mixing into pseudo-heads and the collapse back to heads.

    They live in their own submodule so that PEFT can keep them trainable with `modules_to_save=["head_mixing"]`.
    They are kept in fp32 whatever the model's dtype (see `mixing_dtype`): built so here (`from_config(dtype=...)`,
    a 16-bit default dtype) and loaded so by `from_pretrained` (`_keep_in_fp32_modules_strict`).

    - `alpha_q` [H, H, P]: `Q~[n, h, p] = sum_m alpha_q[m, h, p] * Q[n, m]` (m source head, h target head).
    - `alpha_k`, `alpha_v` [H_kv, H_kv, P]: keys and values mix only among the KV heads ("group-preserving" GQA),
      so query head h attends the pseudo-streams of its own KV group, exactly like `repeat_kv`.
    - `collapse`: [H, P] (`per_head`: head h reads its own P pseudo-outputs) or [H, H, P] (`global`: target head,
      source head, pseudo index).
    """

    def __init__(
        self,
        num_heads: int,
        num_key_value_heads: int,
        num_pseudo_heads: int,
        collapse_mode: str = "per_head",
        collapse_init: str = "last",
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
        collapse_matrix = collapse.permute(0, 2, 1).reshape(num_heads, self.num_pseudo_heads * num_heads)
        pseudo = attn_output.reshape(batch_size, num_tokens, self.num_pseudo_heads * num_heads, head_dim)
        return torch.matmul(collapse_matrix, pseudo)

    def extra_repr(self):
        return (
            f"heads={self.num_heads}, kv_heads={self.num_key_value_heads}, pseudo_heads={self.num_pseudo_heads}, "
            f"collapse={self.collapse_mode}"
        )


def update_pseudo_cache(
    cache: Cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, num_pseudo_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pseudo cache mode: cache the mixed, rotated keys and values of the new tokens; return all of them.

    A token's P pseudo-keys sit side by side in the head dimension ([B, H_kv, N, P * d]), so the cache still counts
    tokens (sliding windows, static caches and `generate` bookkeeping unchanged) and reading it back as the
    [B, H_kv, N * P, d] virtual sequence is a view.
    """
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
        self.attention_type = config.attention_types[layer_idx]
        self.is_iha = is_iha_layer(self.attention_type)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.num_pseudo_heads = config.num_pseudo_heads if self.is_iha else 1
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if is_sliding_layer(self.attention_type) else None
        # What the kernel is told (FlashAttention reads it): the window in tokens, or in virtual tokens on IHA layers
        # with the virtual window; None where only the mask can carry it (IHA layers with the token window).
        self.kernel_sliding_window = kernel_sliding_window(config, self.attention_type)
        # SmolLM3's NoPE layers: no rotation of queries and keys at all. Configs without the field (Gemma 3's) rotate
        # in every layer.
        no_rope_layers = getattr(config, "no_rope_layers", None)
        self.use_rope = no_rope_layers is None or bool(no_rope_layers[layer_idx])
        # Gemma 3's config has one `attention_bias` for all four projections.
        qkv_bias = getattr(config, "qkv_bias", config.attention_bias)
        o_proj_bias = getattr(config, "o_proj_bias", config.attention_bias)

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_proj_bias)
        # Qwen3's per-head norm of queries and keys over head_dim (Gemma 3's attention sets its own kind).
        self.q_norm = self.k_norm = None
        if getattr(config, "use_qk_norm", False):
            self.q_norm = IHARMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = IHARMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # Where the cache stands, fixed per layer: before the mixing (`iha_cache_mode="token"`, Llama's layout and
        # memory; every step mixes the whole cache again), or after it ("pseudo": P times the memory, nothing mixed
        # again). Continuous batching's paged cache is always before the mixing (`serving_iha`).
        self.caches_mixed_states = self.is_iha and config.iha_cache_mode == "pseudo"
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
        rotation: "LayerRotation",
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
            cos, sin = rotation.token
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        # A token-level cache (Llama's layout) holds the un-mixed keys and values: continuous batching's pages always.
        paged = is_paged_cache(past_key_values)
        if paged:
            key_states, value_states = paged_cache_update(
                past_key_values, key_states, value_states, self.layer_idx, kwargs
            )
        elif past_key_values is not None and not self.caches_mixed_states:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attn_implementation = self.config._attn_implementation
        attn_implementation = paged_attention_implementation(attn_implementation) if paged else attn_implementation
        if self.is_iha:
            query_states, key_states, value_states, kwargs = self.pseudo_tokens(
                query_states, key_states, value_states, rotation, past_key_values, attn_implementation, kwargs
            )

        attention_interface = self.attention_interface(attention_mask, attn_implementation, query_states.device)
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

    def pseudo_tokens(
        self, query_states, key_states, value_states, rotation, past_key_values, attn_implementation, kwargs
    ):
        """The heads mixed into the interleaved N * P pseudo-tokens (rotated by p in virtual mode), the mixed keys and
        values cached where this layer caches them, and FlashAttention's arguments in virtual units."""
        query_states, key_states, value_states = self.head_mixing.mix_and_rotate(
            query_states, key_states, value_states, rotation.pseudo if self.use_rope else None
        )
        if past_key_values is not None and self.caches_mixed_states and not is_paged_cache(past_key_values):
            key_states, value_states = update_pseudo_cache(
                past_key_values, key_states, value_states, self.layer_idx, self.num_pseudo_heads
            )
        if attn_implementation.startswith("flash"):
            kwargs = virtual_flash_kwargs(kwargs, kwargs.get("position_ids"), self.num_pseudo_heads)
        return query_states, key_states, value_states, kwargs

    def attention_interface(self, attention_mask, attn_implementation: str, device: torch.device) -> Callable:
        """The kernel of this call: one of IHA's own paths (`attention_iha.choose_attention_path`), or the backend's."""
        attention_path = choose_attention_path(attention_mask, attn_implementation, self.is_iha, device)
        if attention_path == "backend":
            return ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, eager_attention_forward)
        return IHA_ATTENTION_PATHS[attention_path]


class LayerRotation(NamedTuple):
    """The RoPE inputs of one layer: `token` (cos, sin) rotates queries and keys before the mixing, at position n
    (or n * P on IHA layers in virtual position mode); `pseudo` (cos, sin), IHA layers in virtual mode only, adds the
    rotation by p to pseudo-head p after the mixing (Rot(n * P + p) = Rot(p) . Rot(n * P))."""

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
    """RoPE for standard layers (at n), IHA layers (at n, or n * P in virtual mode) and the per-p rotation.

    `rotary_emb` is the model's rotary embedding, called with `rotary_kwargs` (Gemma 3's takes the `layer_type` whose
    RoPE base it computes); `attention_scaling` the factor it multiplies cos and sin by (yarn, longrope).
    """
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


class IHADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: IHAConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention_type = config.attention_types[layer_idx]
        self.self_attn = IHAAttention(config=config, layer_idx=layer_idx)
        self.mlp = IHAMLP(config)
        self.input_layernorm = IHARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = IHARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        rotation: LayerRotation | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        # The model passes the cache under this release's name, the one `GradientCheckpointingLayer` clears when it
        # recomputes the layer (a cache updated again on the backward replay would hold every token twice).
        past_key_values = take_cache_argument(past_key_values, kwargs)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            rotation=rotation,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class IHAPreTrainedModel(PreTrainedModel):
    config_class = IHAConfig
    config: IHAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["IHADecoderLayer"]
    # Under any 16-bit load dtype the mixing is loaded in fp32 (see `mixing_dtype`); the non-strict list acts for fp16
    # only.
    _keep_in_fp32_modules_strict = ["head_mixing"]
    _skip_keys_device_placement = list(CACHE_ARGUMENT_NAMES)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True  # one graph on every layout and input kind: tests/models/test_compile.py
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": IHADecoderLayer,
        "attentions": IHAAttention,
    }

    def _init_weights(self, module):
        super()._init_weights(module)
        # A new IHA layer starts at identity: every pseudo-head a copy of its head, the collapse picking one copy
        # (or their mean), so a converted checkpoint computes what the original computed.
        if isinstance(module, IHAHeadMixing):
            module.reset_to_identity()


class IHAModel(IHAPreTrainedModel):
    def __init__(self, config: IHAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [IHADecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = IHARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = IHARotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()
        self._check_attention_implementation()

    def _check_attention_implementation(self):
        has_iha_layers = any(is_iha_layer(t) for t in self.config.attention_types)
        if has_iha_layers:
            # An engine that builds the model under its own attention name (vLLM, SGLang) stops here, at load time.
            name = self.config._attn_implementation
            check_attention_engine(name, paged=name in PAGED_ATTENTION_IMPLEMENTATIONS, kwargs={})
        if not (has_iha_layers and (self.config._attn_implementation or "").startswith("flash")):
            return
        if self.config.iha_mask_mode != "flat_causal":
            raise ValueError(
                "FlashAttention only runs the flat causal pattern; `iha_mask_mode='token_causal'` needs a mask. "
                "Use attn_implementation='sdpa' or 'flex_attention', or iha_mask_mode='flat_causal'."
            )
        if "iha_sliding_attention" in self.config.attention_types and self.config.iha_window_unit != "virtual":
            raise ValueError(
                "FlashAttention's window counts virtual tokens, while these sliding IHA layers keep a window of whole "
                "tokens (iha_window_unit='token'). Use attn_implementation='sdpa' or 'flex_attention', or the "
                "paper's window in virtual units (iha_window_unit='virtual', which changes what the layers compute)."
            )

    def layer_rotations(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict[str, RotaryInputs]:
        """The RoPE inputs (`rotary_inputs`) of each layer type: one RoPE for every layer here (Gemma 3 has one per
        layer type)."""
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

        if any(is_iha_layer(attention_type) for attention_type in self.config.attention_types):
            # Once per forward (per batch under continuous batching), not in every layer: an attention interface or
            # an engine's kernels IHA layers cannot be right under stop the call here.
            check_attention_engine(self.config._attn_implementation, is_paged_cache(past_key_values), kwargs)
        if is_paged_cache(past_key_values):
            # Continuous batching: one packed row of requests; IHA layers attend request by request.
            mask_mapping = create_paged_iha_masks(self.config, attention_mask, kwargs)
        # Masks may come prepared (a dict per attention type, from `create_masks_for_generate`).
        elif isinstance(attention_mask, dict):
            mask_mapping = attention_mask
        else:
            mask_mapping = create_iha_masks(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )

        hidden_states = inputs_embeds
        rotations_by_layer_type = self.layer_rotations(hidden_states, position_ids)

        for layer_idx, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            rotations = rotations_by_layer_type[self.config.layer_types[layer_idx]]
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.attention_type],
                rotation=rotations.for_layer(decoder_layer.attention_type),
                position_ids=position_ids,
                use_cache=use_cache,
                **cache_keyword(past_key_values),
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **cache_keyword(past_key_values))


class IHAForCausalLM(IHAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: IHAConfig):
        super().__init__(config)
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

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, *args, **kwargs):
        # Continuous batching (`generate_batch`, the server) may switch the model to FlashAttention by itself, which
        # IHA refuses under it: run it with the model's own attention implementation.
        continuous_batching_config = continuous_batching_config_for_iha(continuous_batching_config, generation_config)
        return super().init_continuous_batching(generation_config, continuous_batching_config, *args, **kwargs)

    def _get_static_cache_init_shape(self):
        # `generate` may allocate a StaticCache ahead of the first forward: in pseudo cache mode an IHA layer stores
        # [B, H_kv, N, P * d], so its head dim is P times the model's.
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

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        Example:

        ```python
        >>> import iha  # registers the model with the Auto classes
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer

        >>> model = AutoModelForCausalLM.from_pretrained("path/to/converted-iha-model")
        >>> tokenizer = AutoTokenizer.from_pretrained("path/to/converted-iha-model")
        >>> inputs = tokenizer("The capital of France is", return_tensors="pt")
        >>> output_ids = model.generate(**inputs, max_new_tokens=8)
        ```"""
        past_key_values = take_cache_argument(past_key_values, kwargs)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_keyword(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# On a transformers newer than the newest tested release, prove the cache path on a tiny model before any model runs.
check_untested_release(IHAConfig, IHAForCausalLM)


__all__ = ["IHAForCausalLM", "IHAModel", "IHAPreTrainedModel", "IHAHeadMixing"]
