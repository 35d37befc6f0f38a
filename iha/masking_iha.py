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
a cheaper exact kernel exists on SDPA: sliding IHA layers without past tokens get a `BlockedLocalMask`, full IHA layers
on packed rows a `PackedDocumentsMask`. `attention_iha.choose_attention_path` names the kernel each kind of mask runs.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

from collections.abc import Callable
from dataclasses import dataclass

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

from .compat_iha import cache_keyword, cache_query_offset
from .configuration_iha import STANDARD_FULL, STANDARD_SLIDING, IHAConfig, is_sliding_layer


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
    """Keep the pseudo-tokens of the last `sliding_window` tokens.

    The window is counted in tokens, like transformers' sliding layers, so the sliding KV cache (which keeps the
    last `sliding_window - 1` tokens) holds everything the mask lets through. For the last pseudo-head this is the
    paper's window of `sliding_window * P` virtual tokens; earlier pseudo-heads of a token see slightly fewer.
    """

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx // num_pseudo_heads > q_idx // num_pseudo_heads - sliding_window

    return inner_mask


# Blocked local attention for sliding IHA layers. SDPA with a dense mask computes every (query, key) pair of the
# N * P virtual tokens and then throws most of them away: a sliding layer would cost as much as a global one. Cutting
# the sequence into blocks and running SDPA on [batch * blocks] computes only the keys a window can reach, so the cost
# grows with N * W. Used without past tokens (training, prefill); when decoding, the sliding cache already holds only
# the last W tokens.

# Below this many virtual tokens per block, the overhead of many tiny products outweighs the skipped work.
MIN_LOCAL_BLOCK_VIRTUAL_TOKENS = 64


@dataclass
class BlockedLocalMask:
    """The mask of a sliding IHA layer, cut into blocks for `blocked_local_attention`.

    The N * P virtual tokens are cut into blocks of `block_tokens` tokens (`block_len = block_tokens * P` virtual
    tokens); block i attends to itself and to the `context_blocks` blocks before it, which hold every key its window
    can reach. `key_index` [num_blocks * window_len] lists the virtual index of every key of every block's window
    (clamped into the sequence) and `allowed` [B * num_blocks, 1, block_len, window_len] is the exact mask on them,
    False for window positions outside the sequence.
    """

    allowed: torch.Tensor
    key_index: torch.Tensor
    block_tokens: int
    context_blocks: int

    def contiguous(self) -> "BlockedLocalMask":
        # `generate` calls `.contiguous()` on the masks it prepares for static caches.
        return BlockedLocalMask(
            self.allowed.contiguous(), self.key_index.contiguous(), self.block_tokens, self.context_blocks
        )


def local_attention_blocks(sliding_window: int, num_pseudo_heads: int) -> tuple[int, int]:
    """Block length in tokens and how many earlier blocks each block reads, for a window of `sliding_window` tokens.

    A block of W / k tokens reads k + 1 such blocks of keys to cover its window: (k + 1) / k times the work of an
    ideal kernel (2x for whole-window blocks). Quarter-window blocks (1.25x) were the fastest on CPU; smaller blocks
    make products too small to run efficiently.
    """
    block_tokens = max(-(-sliding_window // 4), -(-MIN_LOCAL_BLOCK_VIRTUAL_TOKENS // num_pseudo_heads))
    context_blocks = -(-(sliding_window - 1) // block_tokens)
    return block_tokens, context_blocks


def blocked_local_attention_saves_work(num_tokens: int, sliding_window: int, num_pseudo_heads: int) -> bool:
    """Blocked attention computes (context_blocks + 1) blocks of keys per block of queries, dense attention all of them."""
    block_tokens, context_blocks = local_attention_blocks(sliding_window, num_pseudo_heads)
    return num_tokens > (context_blocks + 1) * block_tokens


def create_blocked_local_mask(
    mask_function: Callable,
    batch_size: int,
    num_tokens: int,
    num_pseudo_heads: int,
    sliding_window: int,
    device: torch.device,
) -> BlockedLocalMask:
    """Evaluate the layer's index-based mask function (causal pattern, token window, padding, packed sequences) on the
    (query, key) pairs of every block, in the same virtual indices the dense mask uses."""
    block_tokens, context_blocks = local_attention_blocks(sliding_window, num_pseudo_heads)
    num_blocks = -(-num_tokens // block_tokens)
    block_len = block_tokens * num_pseudo_heads
    window_len = (context_blocks + 1) * block_len
    virtual_len = num_tokens * num_pseudo_heads

    block_starts = torch.arange(num_blocks, device=device) * block_len
    query_index = block_starts[:, None, None] + torch.arange(block_len, device=device)[None, :, None]
    key_index = (block_starts - context_blocks * block_len)[:, None, None] + torch.arange(window_len, device=device)
    # The last block runs past the sequence and the first windows start before it: clamped indices keep the lookups
    # (padding, packed ids, the keys themselves) in range, and the mask drops the keys outside the sequence.
    key_in_sequence = (key_index >= 0) & (key_index < virtual_len)
    query_index = query_index.clamp(max=virtual_len - 1)
    key_index = key_index.clamp(min=0, max=virtual_len - 1)
    allowed = mask_function(
        torch.arange(batch_size, device=device)[:, None, None, None],
        torch.arange(1, device=device),
        query_index[None],
        key_index[None],
    )
    allowed = (allowed & key_in_sequence).expand(batch_size, num_blocks, block_len, window_len)
    return BlockedLocalMask(
        allowed=allowed.reshape(batch_size * num_blocks, 1, block_len, window_len),
        key_index=key_index.flatten(),
        block_tokens=block_tokens,
        context_blocks=context_blocks,
    )


# Attention per document for packed (padding-free) rows. TRL's `--packing` puts several documents in one row with
# restarting position ids and no mask. A dense (N * P)^2 mask with the documents' block diagonal inside it makes SDPA
# compute every (query, key) pair of the row and throw away those across documents; cutting the virtual sequence at
# the document boundaries computes only the pairs inside each document (for 4 documents of 512 tokens at P = 2,
# 4 * 1024^2 pairs: what the base model's dense 2048^2 costs). Documents of similar length run together as one
# batch of SDPA, each padded at its end to the longest of its group: causal attention never lets a real query see
# the padding after it, so the causal kernel runs without a mask (flat causal) or with one small mask per group
# (token causal).

# A group of documents padded to its longest member may compute at most this much more attention work than its
# documents need; a shorter document that would exceed it starts a new group (one more SDPA call).
PACKED_GROUP_WORK_SLACK = 1.25


@dataclass
class DocumentGroup:
    """Documents of similar length that run as one SDPA batch.

    `row_index` [num_documents * virtual_len] lists, for every document, the flat virtual rows (into the B * N * P
    rows of the packed batch) of its tokens followed by padding rows (clamped into range; their outputs are dropped),
    or is None when the group is the whole batch in order (the rows are then a view). `token_causal_mask`
    [virtual_len, virtual_len] is the token-causal pattern, or None for flat causal (SDPA's `is_causal` kernel).
    """

    row_index: torch.Tensor | None
    num_documents: int
    virtual_len: int
    token_causal_mask: torch.Tensor | None


@dataclass
class PackedDocumentsMask:
    """The mask of an IHA layer on packed rows, as the documents `per_document_attention` runs one by one.

    `output_index` [B * N * P] gives, for every virtual row of the batch, its row in the concatenated outputs of the
    groups (None when the single group is the batch in order).
    """

    groups: list[DocumentGroup]
    output_index: torch.Tensor | None

    def contiguous(self) -> "PackedDocumentsMask":
        return self


def group_documents_by_length(lengths: list[int]) -> list[list[int]]:
    """Document indices in groups of similar length, longest first, each group padded to its first (longest) member.

    A document joins the current group while the group's padded attention work, members * longest^2, stays within
    `PACKED_GROUP_WORK_SLACK` times the work its documents need, the sum of their length^2.
    """
    groups, needed_work = [], 0
    for document in sorted(range(len(lengths)), key=lambda index: -lengths[index]):  # stable: ties keep their order
        work = lengths[document] ** 2
        if groups:
            longest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * longest**2 <= PACKED_GROUP_WORK_SLACK * (needed_work + work):
                groups[-1].append(document)
                needed_work += work
                continue
        groups.append([document])
        needed_work = work
    return groups


def create_packed_documents_mask(
    packed_sequence_ids: torch.Tensor, num_pseudo_heads: int, token_causal: bool
) -> PackedDocumentsMask:
    """Find the documents of packed rows from their sequence ids [B, N] and plan their groups for SDPA."""
    batch_size, num_tokens = packed_sequence_ids.shape
    device = packed_sequence_ids.device
    # Ids restart in every row: offset them per row so that no document spans two rows.
    row_offsets = torch.arange(batch_size, device=device)[:, None] * num_tokens
    _, lengths = torch.unique_consecutive((packed_sequence_ids + row_offsets).flatten(), return_counts=True)
    lengths = lengths.tolist()
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    total_virtual = batch_size * num_tokens * num_pseudo_heads

    groups, output_index, concat_offset = [], torch.empty(total_virtual, dtype=torch.long), 0
    for members in group_documents_by_length(lengths):
        padded_tokens = lengths[members[0]]
        virtual_len = padded_tokens * num_pseudo_heads
        member_starts = torch.tensor([starts[document] for document in members]) * num_pseudo_heads
        row_index = (member_starts[:, None] + torch.arange(virtual_len)).clamp(max=total_virtual - 1)
        for slot, document in enumerate(members):
            document_len = lengths[document] * num_pseudo_heads
            document_start = starts[document] * num_pseudo_heads
            slot_start = concat_offset + slot * virtual_len
            output_index[document_start : document_start + document_len] = torch.arange(
                slot_start, slot_start + document_len
            )
        concat_offset += len(members) * virtual_len
        token_causal_mask = None
        if token_causal:
            token_of = torch.arange(virtual_len, device=device) // num_pseudo_heads
            token_causal_mask = token_of[None, :] <= token_of[:, None]
        groups.append(DocumentGroup(row_index.flatten().to(device), len(members), virtual_len, token_causal_mask))

    if len(groups) == 1 and groups[0].num_documents * groups[0].virtual_len == total_virtual:
        # Equal documents in order (ties keep their order in the grouping): the rows are a reshape, no gathers.
        groups[0].row_index = None
        return PackedDocumentsMask(groups=groups, output_index=None)
    return PackedDocumentsMask(groups=groups, output_index=output_index.to(device))


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
    except on SDPA for sliding layers without past tokens, which get a `BlockedLocalMask` for the blocked path, and
    for full layers on packed rows, which get a `PackedDocumentsMask` for attention per document. For flat-causal
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
        mask_function = and_masks(mask_function, token_window_overlay(sliding_window, num_pseudo))

    # Packed (padding-free) batches: restarting position_ids without an attention mask, as TRL sends them. Full layers
    # on SDPA attend per document; flex gets the document ids in its BlockMask (whose blocks across documents are
    # skipped), sliding layers in their blocked mask, eager the dense mask. FlashAttention finds the documents itself
    # from the virtual position ids (`virtual_flash_kwargs`). Under torch.compile the per-document path is not taken:
    # it reads the document lengths on the host (a graph break per layer), and transformers cannot tell packed rows
    # from unpacked ones while tracing (`find_packed_sequence_indices` always returns ids then), so compiled forwards
    # use the dense mask with the document ids, as transformers' own models do.
    if position_ids is not None and attention_mask is None and past_key_values is None:
        packed_sequence_ids = find_packed_sequence_indices(position_ids.expand(batch_size, -1))
        attends_per_document = sliding_window is None and config._attn_implementation == "sdpa"
        if packed_sequence_ids is not None and attends_per_document and not torch.compiler.is_compiling():
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
    if (
        sliding_window is not None
        and config._attn_implementation == "sdpa"
        and no_past_tokens
        and kv_length == query_length
        and blocked_local_attention_saves_work(query_length, sliding_window, num_pseudo)
    ):
        if virtual_padding_mask is not None:
            mask_function = and_masks(mask_function, padding_mask_function(virtual_padding_mask))
        return create_blocked_local_mask(
            mask_function, batch_size, query_length, num_pseudo, sliding_window, inputs_embeds.device
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
    """One mask per attention type present in the model, keyed by the entries of `config.attention_types`."""
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
