# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""Masks of IHA layers in virtual units (N * P pseudo-tokens per row), and the sliding caches they read sizes from.

`create_iha_masks` builds one mask per attention type (as Gemma 3 keys masks by layer type): transformers' own for
standard layers; for IHA layers their backend's mask function called with every length and offset times P and the
padding and packed-sequence ids repeated P times, in the backend's usual format. An installed `iha` registers exact
fast paths under `iha|<backend>` (`iha.attention`), called the same way with the layer's `IHALayerSpec` and the packed
ids added. Travels with the weights: imports only torch, transformers and its siblings.
"""

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, StaticSlidingWindowLayer
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

from .layer_iha import STANDARD_FULL, IHALayerSpec, is_iha_layer


# The prefix under which an installed `iha` registers its fast paths in transformers' attention and mask registries.
INSTALLED_PATH_PREFIX = "iha|"
# The cache's name in mask helpers and model outputs: `cache` from 5.24, `past_key_values` before (under the wrong name
# it lands in `**kwargs`, ignored: garbage without an error), so every call names it with `cache_keyword`.
CACHE_ARGUMENT = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_keyword(cache) -> dict:
    return {CACHE_ARGUMENT: cache}


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


def virtual_window_overlay(virtual_window: int) -> Callable:
    """The paper's window: the last `virtual_window` (W * P) virtual tokens, the same width for every pseudo-query
    (transformers' `sliding_window_overlay` in virtual units), what every stock sliding-window kernel computes."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - virtual_window

    return inner_mask


def cache_query_offset(cache: Cache, layer_idx: int):
    """How many tokens precede the current queries in `cache` (an int, or a tensor for static caches)."""
    if hasattr(cache, "get_query_offset"):
        return cache.get_query_offset(layer_idx)
    return cache.get_seq_length()  # before 5.14 transformers' own mask helpers count the cached tokens


def fit_sliding_caches(config, cache: Cache | None) -> None:
    """Rebuild the sliding layers of `cache`, still empty, with the public constructor of their class and the window
    the paper's window reaches (`IHALayerSpec.cache_window`: transformers keeps `sliding_window - 1` past tokens, one
    too few when P > 1). Standard sliding layers are widened alike (their masks keep their own window): transformers'
    mask helpers read every sliding layer's sizes from the first. A layer that already dropped a token is refused."""
    if cache is None or not hasattr(cache, "layers"):
        return
    widest = max((config.layer_spec(i).cache_window or 0 for i in range(config.num_hidden_layers)), default=0)
    if widest <= (config.sliding_window or 0):
        return
    for layer_idx, layer in enumerate(cache.layers[: config.num_hidden_layers]):
        if not getattr(layer, "is_sliding", False) or not config.layer_spec(layer_idx).is_sliding:
            continue  # a layer that keeps every token (a `DynamicCache()` built without the config)
        if isinstance(layer, DynamicSlidingWindowLayer):
            too_narrow = layer.sliding_window < widest
        elif isinstance(layer, StaticSlidingWindowLayer):  # min(sliding_window, the cache's length) slots, rolled
            too_narrow = layer.max_cache_len == config.sliding_window
        else:
            too_narrow = True  # a kind of sliding layer IHA cannot read the window of
        if not too_narrow:
            continue
        if layer.get_seq_length() > 0 or type(layer) not in (DynamicSlidingWindowLayer, StaticSlidingWindowLayer):
            raise ValueError(
                f"Layer {layer_idx} is a sliding layer whose window reaches {widest - 1} past tokens, but its cache "
                f"({type(layer).__name__}) keeps {config.sliding_window - 1}. Pass a new DynamicCache or StaticCache "
                "(or none, as generate() does): IHA widens its sliding layers before the first token is stored."
            )
        if isinstance(layer, DynamicSlidingWindowLayer):
            wider = DynamicSlidingWindowLayer(sliding_window=widest)
        else:
            full_lengths = [other.max_cache_len for other in cache.layers if not getattr(other, "is_sliding", False)]
            wider = StaticSlidingWindowLayer(max_cache_len=max(full_lengths, default=widest + 1), sliding_window=widest)
            if layer.is_initialized:  # allocated ahead of the first forward (a compiled generate): allocate it too
                wider.lazy_initialization(layer.keys[:, :, :1], layer.values[:, :, :1])
        cache.layers[layer_idx] = wider


def create_interleaved_mask(
    config,
    spec: IHALayerSpec,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor | None,
    layer_idx: int,
):
    """The mask of one IHA layer in virtual units (queries and keys are N * P pseudo-tokens long)."""
    num_pseudo = spec.num_pseudo_heads
    attn_implementation = config._attn_implementation
    if attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return attention_mask
    mask_interface = ALL_MASK_ATTENTION_FUNCTIONS.get(
        INSTALLED_PATH_PREFIX + attn_implementation, ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation]
    )

    batch_size, query_length = inputs_embeds.shape[:2]
    if cache is not None:
        query_offset = cache_query_offset(cache, layer_idx)
        if isinstance(query_offset, torch.Tensor):
            query_offset = query_offset.to(inputs_embeds.device)
        kv_length, kv_offset = cache.get_mask_sizes(query_length, layer_idx)
    else:
        query_offset, kv_offset = 0, 0
        kv_length = query_length if attention_mask is None else attention_mask.shape[-1]

    if spec.mask_mode == "token_causal":
        mask_function = token_causal_mask_function(num_pseudo)
    else:
        mask_function = flat_causal_mask_function(num_pseudo)
    # SDPA's `is_causal` shortcut is only valid for the plain flat-causal pattern; `sdpa_mask` still checks lengths
    # and offsets (in virtual units) before it takes it, so decoding P queries against a longer cache gets a mask.
    allow_is_causal_skip = spec.mask_mode == "flat_causal"
    if spec.is_sliding:
        mask_function = and_masks(mask_function, virtual_window_overlay(spec.virtual_window))

    # Packed (padding-free) rows: restarting position ids without an attention mask, as TRL sends them. Documents must
    # not see each other: the ids, repeated per pseudo-token, go into the mask function (flex skips the blocks across
    # documents). FlashAttention finds the documents itself from the virtual position ids (`virtual_flash_kwargs`).
    packed_sequence_ids = None
    if position_ids is not None and attention_mask is None and cache is None:
        packed_sequence_ids = find_packed_sequence_indices(position_ids.expand(batch_size, -1))
        if packed_sequence_ids is not None:
            virtual_sequence_ids = packed_sequence_ids.repeat_interleave(num_pseudo, dim=-1)
            mask_function = and_masks(mask_function, packed_sequence_mask_function(virtual_sequence_ids))
            allow_is_causal_skip = False

    virtual_padding_mask = None
    if attention_mask is not None:
        virtual_padding_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
        virtual_padding_mask = virtual_padding_mask.repeat_interleave(num_pseudo, dim=-1)

    return mask_interface(
        batch_size=batch_size,
        q_length=query_length * num_pseudo,
        kv_length=kv_length * num_pseudo,
        q_offset=query_offset * num_pseudo,
        kv_offset=kv_offset * num_pseudo,
        mask_function=mask_function,
        attention_mask=virtual_padding_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        local_size=spec.virtual_window,
        dtype=inputs_embeds.dtype,
        config=config,
        use_vmap=False,
        device=inputs_embeds.device,
        iha_layer=spec,
        packed_sequence_ids=packed_sequence_ids,
    )


def create_iha_masks(
    config,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor | None = None,
) -> dict:
    """One mask per attention type present in the model, keyed by the entries of `config.attention_types`. The
    sliding caches are fitted to the window first (`fit_sliding_caches`): the masks read their sizes from the cache."""
    fit_sliding_caches(config, cache)
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
        if is_iha_layer(attention_type):
            spec = config.layer_spec(layer_idx)
            masks[attention_type] = create_interleaved_mask(
                config, spec, inputs_embeds, attention_mask, cache, position_ids, layer_idx
            )
            continue
        standard_mask = create_causal_mask if attention_type == STANDARD_FULL else create_sliding_window_causal_mask
        masks[attention_type] = standard_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_keyword(cache),
        )
    return masks
