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

This file is copied next to the weights by `save_pretrained`, so it imports only torch, transformers and its
siblings `configuration_iha.py` and `compat_iha.py` (where every difference between transformers releases is
handled). Remote-code classes are different objects from the installed package's: nothing here may check
`isinstance(config, IHAConfig)`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    padding_mask_function,
)
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

from .compat_iha import (
    CACHE_ARGUMENT_NAMES,
    cache_keyword,
    cache_query_offset,
    check_untested_release,
    output_cache,
    take_cache_argument,
)
from .configuration_iha import IHAConfig


logger = logging.get_logger(__name__)

IHA_ATTENTION_TYPES = ("iha_full_attention", "iha_sliding_attention")
SLIDING_ATTENTION_TYPES = ("sliding_attention", "iha_sliding_attention")


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


class IHAHeadMixing(nn.Module):
    """The learned parameters of one IHA layer: head mixing into pseudo-heads and the collapse back to heads.

    They live in their own submodule so that PEFT can keep them trainable with `modules_to_save=["head_mixing"]`.

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
        self.alpha_q = nn.Parameter(torch.empty(num_heads, num_heads, num_pseudo_heads))
        self.alpha_k = nn.Parameter(torch.empty(num_key_value_heads, num_key_value_heads, num_pseudo_heads))
        self.alpha_v = nn.Parameter(torch.empty(num_key_value_heads, num_key_value_heads, num_pseudo_heads))
        if collapse_mode == "per_head":
            self.collapse = nn.Parameter(torch.empty(num_heads, num_pseudo_heads))
        else:
            self.collapse = nn.Parameter(torch.empty(num_heads, num_heads, num_pseudo_heads))
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


def blocked_local_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockedLocalMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA of query block i against key blocks i - context_blocks .. i, batched over all blocks.

    query [B, H, N * P, d], key / value [B, H_kv, N * P, d]; returns [B, N * P, H, d] and no weights, like
    transformers' attention functions.
    """
    batch_size, num_heads, virtual_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != virtual_len:
        raise ValueError(
            f"Blocked local attention needs as many keys as queries (no past tokens), got {key.shape[2]} keys for "
            f"{virtual_len} queries: build the mask with `create_iha_masks` for the cache that is passed."
        )
    num_blocks = attention_mask.allowed.shape[0] // batch_size
    block_len = attention_mask.allowed.shape[2]
    window_len = attention_mask.allowed.shape[3]
    padded_len = num_blocks * block_len

    # In the token-major [B, N * P, heads, d] layout a block is a run of rows: [B * blocks, block_len, ...] is a view.
    query_blocks = query.transpose(1, 2)
    if padded_len > virtual_len:  # repeat the last query into the padding rows; their outputs are dropped below
        fill_index = torch.arange(padded_len, device=query.device).clamp(max=virtual_len - 1)
        query_blocks = query_blocks.index_select(1, fill_index)
    query_blocks = query_blocks.reshape(batch_size * num_blocks, block_len, num_heads, head_dim).transpose(1, 2)

    def key_windows(states: torch.Tensor) -> torch.Tensor:
        # One gather builds every window (overlapping by `context_blocks` blocks); its backward is one scatter-add.
        windows = states.transpose(1, 2).index_select(1, attention_mask.key_index)
        return windows.view(batch_size * num_blocks, window_len, num_kv_heads, head_dim).transpose(1, 2)

    attn_output = nn.functional.scaled_dot_product_attention(
        query_blocks,
        key_windows(key),
        key_windows(value),
        attn_mask=attention_mask.allowed,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=num_heads != num_kv_heads,
    )
    attn_output = attn_output.transpose(1, 2).reshape(batch_size, padded_len, num_heads, head_dim)
    return attn_output[:, :virtual_len], None


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


def documents_of_group(rows: torch.Tensor, group: DocumentGroup) -> torch.Tensor:
    """Virtual rows [B * N * P, heads, d] -> the group's documents [num_documents, heads, virtual_len, d]."""
    if group.row_index is not None:
        rows = rows.index_select(0, group.row_index)  # its backward is one scatter-add
    return rows.view(group.num_documents, group.virtual_len, *rows.shape[1:]).transpose(1, 2)


def per_document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: PackedDocumentsMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA over the documents of packed rows, one batch per group of similar-length documents.

    query [B, H, N * P, d], key / value [B, H_kv, N * P, d]; returns [B, N * P, H, d] and no weights, like
    transformers' attention functions.
    """
    batch_size, num_heads, virtual_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != virtual_len:
        raise ValueError(
            f"Per-document attention needs as many keys as queries (no past tokens), got {key.shape[2]} keys for "
            f"{virtual_len} queries: packed rows are read from position_ids only without a cache."
        )

    def flat_rows(states: torch.Tensor) -> torch.Tensor:
        # The token-major [B, N * P, heads, d] layout (a view of what head mixing produced): one row per virtual token.
        return states.transpose(1, 2).reshape(batch_size * virtual_len, states.shape[1], head_dim)

    query_rows, key_rows, value_rows = flat_rows(query), flat_rows(key), flat_rows(value)
    group_outputs = []
    for group in attention_mask.groups:
        output = nn.functional.scaled_dot_product_attention(
            documents_of_group(query_rows, group),
            documents_of_group(key_rows, group),
            documents_of_group(value_rows, group),
            attn_mask=group.token_causal_mask,
            dropout_p=dropout,
            is_causal=group.token_causal_mask is None,
            scale=scaling,
            enable_gqa=num_heads != num_kv_heads,
        )
        group_outputs.append(output.transpose(1, 2).reshape(-1, num_heads, head_dim))

    if attention_mask.output_index is None:
        attn_output = group_outputs[0]
    else:
        attn_output = torch.cat(group_outputs).index_select(0, attention_mask.output_index)
    return attn_output.view(batch_size, virtual_len, num_heads, head_dim), None


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
    # from the virtual position ids (`virtual_flash_kwargs`).
    if position_ids is not None and attention_mask is None and past_key_values is None:
        packed_sequence_ids = find_packed_sequence_indices(position_ids.expand(batch_size, -1))
        if packed_sequence_ids is not None and sliding_window is None and config._attn_implementation == "sdpa":
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
        if attention_type == "full_attention":
            masks[attention_type] = create_causal_mask(
                config=config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_keyword(past_key_values),
            )
        elif attention_type == "sliding_attention":
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
                sliding_window=config.sliding_window if attention_type in SLIDING_ATTENTION_TYPES else None,
            )
    return masks


def virtual_flash_kwargs(kwargs: dict, position_ids: torch.Tensor | None, num_pseudo_heads: int) -> dict:
    """FlashAttention finds packed sequences from position ids / cumulative lengths: give them in virtual units."""
    kwargs = dict(kwargs)
    if position_ids is not None:
        virtual_offsets = torch.arange(num_pseudo_heads, device=position_ids.device)
        kwargs["position_ids"] = (position_ids[..., None] * num_pseudo_heads + virtual_offsets).flatten(-2)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key] * num_pseudo_heads
    return kwargs


def masked_sdpa_attention_sharing_kv_heads(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with an explicit mask that lets the kernel share each KV head among its query heads (CPU).

    transformers' SDPA path copies keys and values once per query head (`repeat_kv`) whenever a mask is given. On
    IHA's P-times longer key sequence that copy costs more than the attention itself when decoding (P queries per
    step against the whole cache); torch's CPU kernel reads grouped heads directly with `enable_gqa`.
    """
    attn_output = nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return attn_output.transpose(1, 2).contiguous(), None


# The attention functions IHA layers use instead of transformers' own, by the name `choose_attention_path` gives.
IHA_ATTENTION_PATHS = {
    "blocked_local": blocked_local_attention,
    "per_document": per_document_attention,
    "sdpa_sharing_kv_heads": masked_sdpa_attention_sharing_kv_heads,
}


def choose_attention_path(attention_mask, attn_implementation: str, is_iha: bool, device: torch.device) -> str:
    """The kernel path of one attention call, named from the kind of mask `create_iha_masks` built for it.

    - "blocked_local": a `BlockedLocalMask` (sliding IHA layer without past tokens on SDPA): SDPA over blocks of
      queries against the keys their window can reach.
    - "per_document": a `PackedDocumentsMask` (full IHA layer on packed rows on SDPA): causal SDPA per group of
      similar-length documents, no mask across documents.
    - "sdpa_sharing_kv_heads": a dense mask on an IHA layer with SDPA on CPU (padding, token causal, decoding):
      SDPA reading each KV head for its whole query group.
    - "backend": transformers' function for `attn_implementation`, with whatever mask that backend takes: None for
      SDPA's `is_causal` kernel, a BlockMask for flex (on packed rows it holds the document ids, and blocks across
      documents are skipped), FlashAttention's varlen path over virtual cumulative lengths, or eager's float mask.
      Standard (non-IHA) layers always take this path.
    """
    if isinstance(attention_mask, BlockedLocalMask):
        return "blocked_local"
    if isinstance(attention_mask, PackedDocumentsMask):
        return "per_document"
    if is_iha and attn_implementation == "sdpa" and isinstance(attention_mask, torch.Tensor) and device.type == "cpu":
        return "sdpa_sharing_kv_heads"
    return "backend"


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
        self.is_iha = self.attention_type in IHA_ATTENTION_TYPES
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.num_pseudo_heads = config.num_pseudo_heads if self.is_iha else 1
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if self.attention_type in SLIDING_ATTENTION_TYPES else None

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
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
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        pseudo_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        # Token-level RoPE (at n, or at n * P in virtual position mode) before mixing: rotation commutes with
        # mixing across heads, and the cache keeps the un-mixed keys and values in token units (Llama's layout).
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        caches_pseudo_states = self.is_iha and self.config.iha_cache_mode == "pseudo"
        if past_key_values is not None and not caches_pseudo_states:
            # Token cache mode: un-mixed keys and values in token units (Llama's layout and memory), mixed below,
            # so every decoding step re-mixes the whole cache.
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_kwargs = kwargs
        if self.is_iha:
            query_states = self.head_mixing.mix_queries(query_states)
            key_states, value_states = self.head_mixing.mix_keys_values(key_states, value_states)
            if pseudo_rotation is not None:
                pseudo_cos, pseudo_sin = pseudo_rotation
                query_states = apply_pseudo_rotation(query_states, pseudo_cos, pseudo_sin)
                key_states = apply_pseudo_rotation(key_states, pseudo_cos, pseudo_sin)
            if past_key_values is not None and caches_pseudo_states:
                key_states, value_states = update_pseudo_cache(
                    past_key_values, key_states, value_states, self.layer_idx, self.num_pseudo_heads
                )
            if self.config._attn_implementation.startswith("flash"):
                attention_kwargs = virtual_flash_kwargs(kwargs, kwargs.get("position_ids"), self.num_pseudo_heads)

        attention_path = choose_attention_path(
            attention_mask, self.config._attn_implementation, self.is_iha, query_states.device
        )
        if attention_path == "backend":
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
        else:
            attention_interface: Callable = IHA_ATTENTION_PATHS[attention_path]
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            # IHA layers carry their window in the mask; only standard sliding layers pass it to the kernel.
            sliding_window=None if self.is_iha else self.sliding_window,
            **attention_kwargs,
        )

        if self.is_iha:
            attn_output = self.head_mixing.collapse_heads(attn_output)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


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
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        pseudo_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
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
            position_embeddings=position_embeddings,
            pseudo_rotation=pseudo_rotation,
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
    _skip_keys_device_placement = list(CACHE_ARGUMENT_NAMES)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = False
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
        has_iha_layers = any(t in IHA_ATTENTION_TYPES for t in self.config.attention_types)
        if not (has_iha_layers and (self.config._attn_implementation or "").startswith("flash")):
            return
        if self.config.iha_mask_mode != "flat_causal":
            raise ValueError(
                "FlashAttention only runs the flat causal pattern; `iha_mask_mode='token_causal'` needs a mask. "
                "Use attn_implementation='sdpa' or 'flex_attention', or iha_mask_mode='flat_causal'."
            )
        if "iha_sliding_attention" in self.config.attention_types:
            raise ValueError(
                "FlashAttention's window counts virtual tokens, while sliding IHA layers keep a window of whole "
                "tokens. Use attn_implementation='sdpa' or 'flex_attention' for models with sliding IHA layers."
            )

    def rotary_inputs(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """RoPE for standard layers (at n), IHA layers (at n, or n * P in virtual mode) and the per-p rotation."""
        token_rotation = self.rotary_emb(hidden_states, position_ids=position_ids)
        if self.config.iha_position_mode == "shared":
            return {"standard": token_rotation, "iha": token_rotation, "pseudo": None}
        num_pseudo = self.config.num_pseudo_heads
        iha_rotation = self.rotary_emb(hidden_states, position_ids=position_ids * num_pseudo)
        pseudo_positions = torch.arange(num_pseudo, device=hidden_states.device)[None]
        pseudo_cos, pseudo_sin = self.rotary_emb(hidden_states, position_ids=pseudo_positions)
        # rotary_emb scales cos/sin by `attention_scaling` (yarn, longrope); the token-level rotation already did.
        scale = self.rotary_emb.attention_scaling
        pseudo_rotation = (pseudo_cos[0] / scale, pseudo_sin[0] / scale)
        return {"standard": token_rotation, "iha": iha_rotation, "pseudo": pseudo_rotation}

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

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Masks may come prepared (a dict per attention type, from `create_masks_for_generate`).
        if isinstance(attention_mask, dict):
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
        rotations = self.rotary_inputs(hidden_states, position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            is_iha_layer = decoder_layer.attention_type in IHA_ATTENTION_TYPES
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.attention_type],
                position_embeddings=rotations["iha"] if is_iha_layer else rotations["standard"],
                pseudo_rotation=rotations["pseudo"] if is_iha_layer else None,
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

    def _get_static_cache_init_shape(self):
        # `generate` may allocate a StaticCache ahead of the first forward: in pseudo cache mode an IHA layer stores
        # [B, H_kv, N, P * d], so its head dim is P times the model's.
        init_shape = super()._get_static_cache_init_shape()
        if init_shape is None or self.config.iha_cache_mode != "pseudo":
            return init_shape
        num_heads, head_dim = init_shape
        head_dims = head_dim if isinstance(head_dim, list) else [head_dim] * self.config.num_hidden_layers
        head_dims = [
            dim * self.config.num_pseudo_heads if attention_type in IHA_ATTENTION_TYPES else dim
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
