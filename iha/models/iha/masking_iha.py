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
"""Masks of IHA layers, in virtual units: N * P pseudo-tokens per row instead of N tokens.

`create_iha_masks` builds one mask per attention type of the model (the way Gemma3 keys masks by layer type). IHA
layers get transformers' own mask for their backend, built with every length and offset multiplied by P, except where
a cheaper exact kernel exists on SDPA: sliding IHA layers without past tokens get the plan of blocked local attention
(`blocked_local_iha.py`), full IHA layers on packed rows the plan of attention per document
(`packed_documents_iha.py`). `attention_iha.choose_attention_path` names the kernel each kind of mask runs.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    padding_mask_function,
)

from .blocked_local_iha import blocked_local_attention_applies, create_blocked_local_mask, window_reach_tokens
from .compat_iha import cache_keyword, cache_query_offset
from .configuration_iha import (
    IHA_SLIDING,
    STANDARD_FULL,
    STANDARD_SLIDING,
    IHAConfig,
    is_iha_layer,
    is_sliding_layer,
)
from .packed_documents_iha import create_packed_documents_mask, per_document_attention_applies


def flat_causal_mask_function(num_pseudo_heads: int) -> Callable:
    """The paper's mask: ordinary causal attention over virtual indices n * P + p."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx <= q_idx

    return inner_mask


def token_causal_mask_function(num_pseudo_heads: int) -> Callable:
    """A pseudo-token sees every pseudo-token of its own token and of earlier tokens."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx // num_pseudo_heads <= q_idx // num_pseudo_heads

    return inner_mask


def token_window_overlay(sliding_window: int, num_pseudo_heads: int) -> Callable:
    """`iha_window_unit="token"`: keep the pseudo-tokens of the last `sliding_window` tokens.

    The window is counted in tokens, like transformers' sliding layers, so the sliding KV cache (which keeps the
    last `sliding_window - 1` tokens) holds everything the mask lets through. For the last pseudo-head this is the
    paper's window of `sliding_window * P` virtual tokens; earlier pseudo-heads of a token see slightly fewer.
    """

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx // num_pseudo_heads > q_idx // num_pseudo_heads - sliding_window

    return inner_mask


def virtual_window_overlay(sliding_window: int, num_pseudo_heads: int) -> Callable:
    """`iha_window_unit="virtual"`, the paper's window: keep the last `sliding_window * P` virtual tokens.

    A flat band over the interleaved sequence, the same width for every pseudo-query (transformers'
    `sliding_window_overlay` in virtual units): what FlashAttention's, SDPA's and vLLM's sliding-window kernels compute.
    The last pseudo-query of token n sees exactly the pseudo-tokens of tokens n - W + 1 .. n (the token window), the
    first reaches into token n - W: its sliding caches keep one token more (`keep_virtual_windows_in_cache`).
    """
    virtual_window = sliding_window * num_pseudo_heads

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - virtual_window

    return inner_mask


def window_unit(config) -> str:
    """The config's `iha_window_unit`; configs written before the field existed mean "token"."""
    return getattr(config, "iha_window_unit", "token")


def window_overlay(config, sliding_window: int) -> Callable:
    """The window of a sliding IHA layer of `config`, as a mask function over virtual indices."""
    if window_unit(config) == "virtual":
        return virtual_window_overlay(sliding_window, config.num_pseudo_heads)
    return token_window_overlay(sliding_window, config.num_pseudo_heads)


def kernel_sliding_window(config, attention_type: str) -> int | None:
    """The `sliding_window` a layer hands its attention kernel (FlashAttention reads it; the others take the window
    from the mask): the window in tokens on standard sliding layers, `sliding_window * P` virtual tokens on IHA
    layers with the virtual window, and None on IHA layers with the token window, which no kernel's window computes
    (and on full layers)."""
    if not is_sliding_layer(attention_type):
        return None
    if not is_iha_layer(attention_type):
        return config.sliding_window
    if window_unit(config) == "virtual":
        return config.sliding_window * config.num_pseudo_heads
    return None


def cache_window_tokens(config) -> int:
    """The window a sliding cache layer of an IHA sliding layer is built with: transformers' sliding layers keep
    `window - 1` past tokens, and the virtual window reaches `sliding_window` tokens back (one more) when P > 1."""
    return window_reach_tokens(config.sliding_window, config.num_pseudo_heads, window_unit(config)) + 1


def keep_virtual_windows_in_cache(config, cache: Cache | None) -> None:
    """Give the sliding cache layers of a model with virtual-window IHA layers the window the mask reaches (one token
    more).

    transformers' caches build every sliding layer from `config.sliding_window` and keep `sliding_window - 1` past
    tokens; the first pseudo-query of a token reaches `sliding_window` tokens back. The cache's window is widened
    before the layer stores anything (dynamic layers keep one more token; static ones get one more slot), once:
    this runs wherever the masks are built, since they read their sizes from the cache. Standard sliding layers are
    widened alike (their mask still keeps `sliding_window` tokens): transformers' mask helpers read the sizes of every
    sliding layer from the first one. A cache that already holds tokens under the narrower window cannot give back
    the token it dropped, and is refused.
    """
    if cache is None or window_unit(config) != "virtual" or not hasattr(cache, "layers"):
        return
    if IHA_SLIDING not in config.attention_types:
        return
    needed = cache_window_tokens(config)
    if needed == config.sliding_window:
        return
    for layer_idx, attention_type in enumerate(config.attention_types):
        if not is_sliding_layer(attention_type) or layer_idx >= len(cache.layers):
            continue
        layer = cache.layers[layer_idx]
        if not getattr(layer, "is_sliding", False):
            continue
        if getattr(layer, "is_compileable", False):  # a static sliding layer: `max_cache_len` slots, rolled
            if layer.max_cache_len != config.sliding_window:
                continue  # already widened, or shorter than the window (then it holds every token)
            holds_tokens = layer.get_seq_length() > 0
            if not holds_tokens:
                layer.max_cache_len = needed
                if layer.is_initialized:  # allocated ahead of the first forward (`early_initialization`)
                    layer.lazy_initialization(layer.keys[:, :, :1], layer.values[:, :, :1])
        else:  # a dynamic sliding layer keeps `sliding_window - 1` past tokens
            if layer.sliding_window != config.sliding_window:
                continue
            holds_tokens = layer.get_seq_length() > 0
            if not holds_tokens:
                layer.sliding_window = needed
                layer._sliding_window_tensor = torch.full_like(layer._sliding_window_tensor, needed)
        if holds_tokens:
            raise ValueError(
                f"Layer {layer_idx} is a sliding layer of a model with the virtual window (iha_window_unit='virtual'), "
                f"whose sliding caches keep {needed - 1} past tokens, but this cache was filled keeping "
                f"{config.sliding_window - 1}. Pass a new cache (or none) to the model: it widens the window of "
                "the cache before the first token is stored."
            )


def create_interleaved_mask(
    config: IHAConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None,
    layer_idx: int,
    sliding_window: int | None = None,
):
    """Build the attention mask of IHA layers in virtual units (queries and keys are N * P pseudo-tokens long).

    transformers' mask helpers assume one query per token, so we call the backend's own mask function with every
    length and offset multiplied by P, the padding mask repeated P times and packed-sequence ids repeated P times.
    The result has the backend's usual format (bool for sdpa, float for eager, BlockMask for flex, 2D for flash),
    except where a fast path applies on SDPA: sliding layers without past tokens get a `BlockedLocalMask`
    (`blocked_local_iha.py`), full layers on packed rows a `PackedDocumentsMask` (`packed_documents_iha.py`). For flat-causal
    full layers without padding `sdpa_mask` returns None, and SDPA runs its `is_causal` kernel.
    `choose_attention_path` names the kernel each kind of mask goes to.
    """
    num_pseudo = config.num_pseudo_heads
    if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return attention_mask
    mask_interface = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]

    batch_size, query_length = inputs_embeds.shape[:2]
    if past_key_values is not None:
        query_offset = cache_query_offset(past_key_values, layer_idx)
        if isinstance(query_offset, torch.Tensor):
            query_offset = query_offset.to(inputs_embeds.device)
        kv_length, kv_offset = past_key_values.get_mask_sizes(query_length, layer_idx)
    else:
        query_offset, kv_offset = 0, 0
        kv_length = query_length if attention_mask is None else attention_mask.shape[-1]

    if config.iha_mask_mode == "token_causal":
        mask_function = token_causal_mask_function(num_pseudo)
    else:
        mask_function = flat_causal_mask_function(num_pseudo)
    # SDPA's `is_causal` shortcut is only valid for the plain flat-causal pattern; `sdpa_mask` still checks lengths
    # and offsets (in virtual units) before it takes it, so decoding P queries against a longer cache gets a mask.
    allow_is_causal_skip = config.iha_mask_mode == "flat_causal"
    if sliding_window is not None:
        mask_function = and_masks(mask_function, window_overlay(config, sliding_window))

    # Packed (padding-free) batches: restarting position_ids without an attention mask, as TRL sends them. Full layers
    # on SDPA attend per document (`per_document_attention_applies` says when); flex gets the document ids in its
    # BlockMask (whose blocks across documents are skipped), sliding layers in their blocked mask, eager the dense
    # mask. FlashAttention finds the documents itself from the virtual position ids (`virtual_flash_kwargs`).
    if position_ids is not None and attention_mask is None and past_key_values is None:
        packed_sequence_ids = find_packed_sequence_indices(position_ids.expand(batch_size, -1))
        attends_per_document = per_document_attention_applies(config._attn_implementation, sliding_window)
        if packed_sequence_ids is not None and attends_per_document:
            return create_packed_documents_mask(
                packed_sequence_ids, num_pseudo, token_causal=config.iha_mask_mode == "token_causal"
            )
        if packed_sequence_ids is not None:
            virtual_sequence_ids = packed_sequence_ids.repeat_interleave(num_pseudo, dim=-1)
            mask_function = and_masks(mask_function, packed_sequence_mask_function(virtual_sequence_ids))
            allow_is_causal_skip = False

    virtual_padding_mask = None
    if attention_mask is not None:
        virtual_padding_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
        virtual_padding_mask = virtual_padding_mask.repeat_interleave(num_pseudo, dim=-1)

    no_past_tokens = not isinstance(query_offset, torch.Tensor) and query_offset == 0 and kv_offset == 0
    if blocked_local_attention_applies(
        config._attn_implementation,
        sliding_window,
        query_length,
        kv_length,
        no_past_tokens,
        num_pseudo,
        window_unit(config),
    ):
        if virtual_padding_mask is not None:
            mask_function = and_masks(mask_function, padding_mask_function(virtual_padding_mask))
        return create_blocked_local_mask(
            mask_function,
            batch_size,
            query_length,
            num_pseudo,
            sliding_window,
            inputs_embeds.device,
            window_unit(config),
        )

    return mask_interface(
        batch_size=batch_size,
        q_length=query_length * num_pseudo,
        kv_length=kv_length * num_pseudo,
        q_offset=query_offset * num_pseudo,
        kv_offset=kv_offset * num_pseudo,
        mask_function=mask_function,
        attention_mask=virtual_padding_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        local_size=None if sliding_window is None else sliding_window * num_pseudo,
        dtype=inputs_embeds.dtype,
        config=config,
        use_vmap=False,
        device=inputs_embeds.device,
    )


def create_iha_masks(
    config: IHAConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> dict:
    """One mask per attention type present in the model, keyed by the entries of `config.attention_types`.

    The sliding caches of virtual-window IHA layers get their window first (`keep_virtual_windows_in_cache`): the
    masks' sizes are read from the cache.
    """
    keep_virtual_windows_in_cache(config, past_key_values)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        raise ValueError(
            f"IHA models take a 2D padding mask [batch, tokens]; got a {attention_mask.ndim}D attention_mask. IHA layers "
            "attend over N * P pseudo-tokens and build their own masks from the 2D mask. Pass a dict keyed by "
            "attention type (see `create_iha_masks`) to give prepared masks."
        )
    masks = {}
    for layer_idx, attention_type in enumerate(config.attention_types):
        if attention_type in masks:
            continue
        if attention_type == STANDARD_FULL:
            masks[attention_type] = create_causal_mask(
                config=config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_keyword(past_key_values),
            )
        elif attention_type == STANDARD_SLIDING:
            masks[attention_type] = create_sliding_window_causal_mask(
                config=config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_keyword(past_key_values),
            )
        else:
            masks[attention_type] = create_interleaved_mask(
                config,
                inputs_embeds,
                attention_mask,
                past_key_values,
                position_ids,
                layer_idx=layer_idx,
                sliding_window=config.sliding_window if is_sliding_layer(attention_type) else None,
            )
    return masks
