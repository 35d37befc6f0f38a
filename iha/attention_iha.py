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
"""Attention kernels of IHA layers, and which one a call runs.

transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`: sdpa, flex, flash, eager) take IHA's virtual sequence
as it is; the functions here are exact, cheaper paths on SDPA for the masks `masking_iha` builds. Each returns what
transformers' functions return: the output [B, N * P, H, d] and no weights. `choose_attention_path` is the one place
that picks the kernel; every path is checked against the plain reference `iha.naive_iha` in the tests.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

import torch
from torch import nn

from .masking_iha import BlockedLocalMask, DocumentGroup, PackedDocumentsMask


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
