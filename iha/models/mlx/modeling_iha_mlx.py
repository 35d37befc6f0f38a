# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Interleaved Head Attention (IHA, arXiv 2602.21371) for MLX: the model file stock mlx-lm reads from an IHA folder.

`iha export mlx FOLDER` copies this file next to the weights and names it in config.json (`model_file`); mlx-lm then
builds the model from it when asked to trust the folder's code:
`mlx_lm.generate --model FOLDER --trust-remote-code --prompt "..."`. mlx-lm loads it as one module, so it imports only
mlx and mlx-lm, never the `iha` package or a sibling file.

An IHA layer projects q/k/v as Llama does (Qwen3's per-head q/k norm and SmolLM3's NoPE layers included), mixes the
heads into P pseudo-heads per head, interleaves the pseudo-tokens token-major into N * P virtual tokens (virtual index
n * P + p), attends over them with one boolean mask built from the definitions (flat or token causal, the paper's
window of W * P virtual tokens, left padding), and folds the H * P pseudo-outputs back to H heads before `o_proj`. The
mixing parameters stay float32 under `mlx_lm.convert` (`Model.cast_predicate`) and its quantization (they are not
linear layers).

The cache counts tokens like every mlx-lm cache (batching, left padding, prompt caches). Under the folder's
`iha_cache_mode`: "pseudo" holds each token's P mixed, rotated pseudo-keys and values side by side ([B, H_kv, tokens,
P * d]; reading them back as the N * P virtual sequence is a reshape); "token" holds the un-mixed keys and values (the
base model's memory) and mixes the whole cache again at every step. Sliding layers keep every token in the cache and
apply their window in the mask.

What an IHA layer is (its fields, window and mixing matrix) is `iha/models/iha/layer_iha.py`'s and `mixing_iha.py`'s;
this file restates what it needs, and `tests/models/mlx/test_mlx_layer.py` holds it equal. The IHA fields carry no
default here: `iha export mlx` writes every one of them into config.json, with what the folder's config means for a
field it lacks (`IHAConfig`'s value).
"""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_pseudo_heads: int
    attention_types: list[str]
    iha_mask_mode: str
    iha_position_mode: str
    iha_collapse_mode: str
    iha_cache_mode: str
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    num_key_value_heads: int | None = None
    attention_bias: bool = False
    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    sliding_window: int | None = None
    use_qk_norm: bool = False
    no_rope_layers: list[int] | None = None

    def __post_init__(self):
        if self.model_type != "iha":
            raise ValueError(
                f"This MLX model file runs Llama-family IHA folders (model_type 'iha'), not {self.model_type!r}: "
                "Gemma 3's block (its four norms, scaled embeddings and per-layer RoPE bases) is not written for MLX."
            )
        if self.hidden_act != "silu":
            raise ValueError(f"IHA's MLX model runs SiLU MLPs (Llama's); this folder's is {self.hidden_act!r}.")
        if self.iha_cache_mode not in ("token", "pseudo"):
            raise ValueError(f"`iha_cache_mode` must be 'token' or 'pseudo', got {self.iha_cache_mode!r}.")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        if self.no_rope_layers is None:
            self.no_rope_layers = [1] * self.num_hidden_layers


def make_rope(args: ModelArgs):
    """mlx-lm's RoPE for the folder's `rope_parameters` (transformers 5's one field for the base and the scaling)."""
    parameters = dict(args.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    base = parameters.pop("rope_theta", 10000.0)
    scaling = parameters if parameters.get("rope_type", "default") != "default" else None
    return initialize_rope(args.head_dim, base, False, scaling, args.max_position_embeddings)


def virtual_mask(
    num_new: int,
    num_cached: int,
    num_pseudo: int,
    mask_mode: str,
    virtual_window: int | None,
    left_padding: mx.array | None,
) -> mx.array:
    """Boolean [B or 1, 1, num_new * P, num_cached * P]: True where a new virtual query may attend a virtual key.

    Keys are the `num_cached` tokens of the cache (the new ones last), each as its P pseudo-tokens; queries are the
    new tokens' pseudo-tokens. Flat causal: virtual key j <= virtual query i; token causal: key token <= query token.
    The window (`virtual_window`, W * P) keeps i - virtual_window < j.
    `left_padding` (a batch's, per row) hides the padded key tokens.
    """
    query = mx.arange((num_cached - num_new) * num_pseudo, num_cached * num_pseudo)[:, None]
    key = mx.arange(num_cached * num_pseudo)[None]
    query_token, key_token = query // num_pseudo, key // num_pseudo
    if mask_mode == "flat_causal":
        allowed = key <= query
    else:
        allowed = key_token <= query_token
    if virtual_window is not None:
        allowed = allowed & (key > query - virtual_window)
    if left_padding is None:
        return allowed[None, None]
    key_is_real = key_token[None] >= left_padding[:, None, None]
    return (allowed[None] & key_is_real)[:, None]


def mixing_matrix(alpha: mx.array) -> mx.array:
    """alpha [M, H, P] -> [P * H, M]: row p * H + h holds alpha[:, h, p] (`mixing_iha.mixing_matrix`)."""
    num_sources, num_targets, num_pseudo = alpha.shape
    return alpha.transpose(2, 1, 0).reshape(num_pseudo * num_targets, num_sources)


def collapse_matrix(collapse: mx.array) -> mx.array:
    """A global collapse R [H, H, P] -> [H, P * H]: column p * H + m holds R[:, m, p] (`mixing_iha.collapse_matrix`)."""
    num_heads, _, num_pseudo = collapse.shape
    return collapse.transpose(0, 2, 1).reshape(num_heads, num_pseudo * num_heads)


def virtual_window(attention_type: str, sliding_window: int | None, num_pseudo: int) -> int | None:
    """The window of a layer in virtual tokens (`IHALayerSpec.virtual_window`): W * P on sliding layers (P = 1 on
    standard ones), None on full layers."""
    return sliding_window * num_pseudo if attention_type.endswith("sliding_attention") else None


class HeadMixing(nn.Module):
    """An IHA layer's mixing: `alpha_q` [H, H, P], `alpha_k` and `alpha_v` [H_kv, H_kv, P] (out[n, h, p] =
    sum_m alpha[m, h, p] * x[n, m]), and the collapse, [H, P] (per head) or [H, H, P] (global). Float32."""

    def __init__(self, num_heads: int, num_kv_heads: int, num_pseudo: int, collapse_mode: str):
        super().__init__()
        self.num_pseudo = num_pseudo
        self.alpha_q = mx.zeros((num_heads, num_heads, num_pseudo))
        self.alpha_k = mx.zeros((num_kv_heads, num_kv_heads, num_pseudo))
        self.alpha_v = mx.zeros((num_kv_heads, num_kv_heads, num_pseudo))
        collapse_shape = (num_heads, num_pseudo) if collapse_mode == "per_head" else (num_heads, num_heads, num_pseudo)
        self.collapse = mx.zeros(collapse_shape)

    @staticmethod
    def mix(states: mx.array, alpha: mx.array) -> mx.array:
        """[B, N, M, d] head states -> [B, H, N * P, d] interleaved pseudo-heads (virtual index n * P + p): one
        [P * H, M] @ [M, d] product per token, in float32."""
        batch_size, num_tokens, num_sources, head_dim = states.shape
        _, num_targets, num_pseudo = alpha.shape
        mixed = (mixing_matrix(alpha) @ states.astype(mx.float32)).astype(states.dtype)  # [B, N, P * H, d]
        mixed = mixed.reshape(batch_size, num_tokens * num_pseudo, num_targets, head_dim)
        return mixed.transpose(0, 2, 1, 3)

    def collapse_heads(self, output: mx.array) -> mx.array:
        """[B, H, N * P, d] pseudo-outputs -> [B, N, H * d] head outputs."""
        batch_size, num_heads, virtual_len, head_dim = output.shape
        num_tokens = virtual_len // self.num_pseudo
        pseudo = output.transpose(0, 2, 1, 3).reshape(batch_size, num_tokens, self.num_pseudo, num_heads, head_dim)
        collapse = self.collapse.astype(mx.float32)
        pseudo = pseudo.astype(mx.float32)
        if collapse.ndim == 2:  # out[n, h] = sum_p R[h, p] * o[n, p, h]
            collapsed = (pseudo * collapse.T[None, None, :, :, None]).sum(axis=2)
        else:  # out[n, h] = sum_(p, m) R[h, m, p] * o[n, p, m]
            collapsed = collapse_matrix(collapse) @ pseudo.reshape(
                batch_size, num_tokens, self.num_pseudo * num_heads, head_dim
            )
        return collapsed.astype(output.dtype).reshape(batch_size, num_tokens, num_heads * head_dim)


class Attention(nn.Module):
    """One layer's attention: IHA on `iha_*` layers, Llama's multi-head attention (P = 1, no mixing) otherwise."""

    def __init__(self, args: ModelArgs, layer_idx: int, rope):
        super().__init__()
        attention_type = args.attention_types[layer_idx]
        self.is_iha = attention_type.startswith("iha_")
        self.num_pseudo = args.num_pseudo_heads if self.is_iha else 1
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.virtual_window = virtual_window(attention_type, args.sliding_window, self.num_pseudo)
        self.mask_mode = args.iha_mask_mode if self.is_iha else "flat_causal"
        self.virtual_positions = self.is_iha and args.iha_position_mode == "virtual"
        # What the cache of an IHA layer holds (the folder's `iha_cache_mode`): "token", the un-mixed keys and values
        # (the base model's memory; every step mixes the whole cache again), or "pseudo", the mixed, rotated
        # pseudo-keys and values (P times the memory, nothing mixed again).
        self.caches_tokens = self.is_iha and args.iha_cache_mode == "token"
        self.rope = rope if args.no_rope_layers[layer_idx] else None
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=args.o_proj_bias)
        if args.use_qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.use_qk_norm = args.use_qk_norm
        if self.is_iha:
            self.head_mixing = HeadMixing(self.num_heads, self.num_kv_heads, self.num_pseudo, args.iha_collapse_mode)

    def rotate(self, states: mx.array, offset, scale: int) -> mx.array:
        if self.rope is None:
            return states
        return self.rope(states, offset=offset * scale if scale != 1 else offset)

    def pseudo_tokens_through_token_cache(self, queries, keys, values, cache, offset):
        """Token cache mode: cache the new tokens' un-mixed keys and values (rotated at their token positions under
        shared positions, unrotated under virtual ones), then mix every cached token again and, under virtual
        positions, rotate the whole virtual sequence from the position of the cache's first entry."""
        mixing, num_pseudo = self.head_mixing, self.num_pseudo
        queries = queries.transpose(0, 2, 1, 3)
        keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        if not self.virtual_positions:
            queries, keys = self.rotate(queries, offset, 1), self.rotate(keys, offset, 1)
        keys, values = cache.update_and_fetch(keys, values)
        first_position = cache.offset - keys.shape[2]  # 0, or minus each row's left padding in a batch
        queries = mixing.mix(queries.transpose(0, 2, 1, 3), mixing.alpha_q)
        keys = mixing.mix(keys.transpose(0, 2, 1, 3), mixing.alpha_k)
        values = mixing.mix(values.transpose(0, 2, 1, 3), mixing.alpha_v)
        if self.virtual_positions:
            queries = self.rotate(queries, offset, num_pseudo)
            keys = self.rotate(keys, first_position, num_pseudo)
        return queries, keys, values

    def __call__(self, x: mx.array, cache: Any | None = None) -> mx.array:
        batch_size, num_tokens, _ = x.shape
        queries = self.q_proj(x).reshape(batch_size, num_tokens, self.num_heads, self.head_dim)
        keys = self.k_proj(x).reshape(batch_size, num_tokens, self.num_kv_heads, self.head_dim)
        values = self.v_proj(x).reshape(batch_size, num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:  # before the mixing: a per-head norm does not commute with it
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        offset = cache.offset if cache is not None else 0
        num_pseudo = self.num_pseudo

        if self.caches_tokens and cache is not None:
            queries, keys, values = self.pseudo_tokens_through_token_cache(queries, keys, values, cache, offset)
        elif self.is_iha and self.virtual_positions:
            # Pseudo-token (n, p) at RoPE position n * P + p: the interleaved sequence's own index, from offset * P.
            queries = self.rotate(self.head_mixing.mix(queries, self.head_mixing.alpha_q), offset, num_pseudo)
            keys = self.rotate(self.head_mixing.mix(keys, self.head_mixing.alpha_k), offset, num_pseudo)
            values = self.head_mixing.mix(values, self.head_mixing.alpha_v)
        else:
            # Token positions (standard layers, shared positions): RoPE rotates every head alike, so it commutes
            # with the mixing and runs on the H heads.
            queries = self.rotate(queries.transpose(0, 2, 1, 3), offset, 1)
            keys = self.rotate(keys.transpose(0, 2, 1, 3), offset, 1)
            values = values.transpose(0, 2, 1, 3)
            if self.is_iha:
                mixing = self.head_mixing
                queries = mixing.mix(queries.transpose(0, 2, 1, 3), mixing.alpha_q)
                keys = mixing.mix(keys.transpose(0, 2, 1, 3), mixing.alpha_k)
                values = mixing.mix(values.transpose(0, 2, 1, 3), mixing.alpha_v)

        left_padding = getattr(cache, "left_padding", None)
        if cache is not None and not self.caches_tokens:
            # In token units: each token's P pseudo-keys side by side ([B, H_kv, N, P * d]).
            token_shape = (batch_size, self.num_kv_heads, num_tokens, num_pseudo * self.head_dim)
            keys, values = cache.update_and_fetch(keys.reshape(token_shape), values.reshape(token_shape))
            virtual_shape = (batch_size, self.num_kv_heads, -1, self.head_dim)
            keys, values = keys.reshape(virtual_shape), values.reshape(virtual_shape)
        num_cached = keys.shape[2] // num_pseudo
        mask = virtual_mask(num_tokens, num_cached, num_pseudo, self.mask_mode, self.virtual_window, left_padding)
        output = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        if self.is_iha:
            output = self.head_mixing.collapse_heads(output)
        else:
            output = output.transpose(0, 2, 1, 3).reshape(batch_size, num_tokens, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rope):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rope)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any | None = None) -> mx.array:
        hidden = x + self.self_attn(self.input_layernorm(x), cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class IHAModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = make_rope(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, layer_idx, rope) for layer_idx in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        hidden = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers, cache):
            hidden = layer(hidden, layer_cache)
        return self.norm(hidden)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = IHAModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        hidden = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def sanitize(self, weights: dict) -> dict:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @staticmethod
    def cast_predicate(name: str) -> bool:
        """`mlx_lm.convert --dtype` casts every parameter but the mixing, which stays float32 (as in transformers)."""
        return ".head_mixing." not in name

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        # Full caches on sliding layers too: their window is in the mask (a rotating cache reorders its keys).
        return [KVCache() for _ in self.layers]
