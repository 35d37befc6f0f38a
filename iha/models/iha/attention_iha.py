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
as it is. The fast paths on SDPA live in their own files, each with its plan (the mask `masking_iha` builds in place
of a dense one), its kernel and the rule for when it runs: blocked local attention for sliding layers
(`blocked_local_iha.py`) and attention per document on packed rows (`packed_documents_iha.py`). This file holds the
small kernel of dense masks on CPU, the FlashAttention arguments in virtual units, and `choose_attention_path`, the one
place that picks the kernel of a call. Every kernel returns what transformers' functions return (the output
[B, N * P, H, d] and no weights) and is checked against the plain reference `iha.models.iha.naive_iha` in the tests.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

import torch
from torch import nn

from .blocked_local_iha import BlockedLocalMask, blocked_local_attention
from .packed_documents_iha import PackedDocumentsMask, per_document_attention
from .serving_iha import PagedRequestsMask, per_request_attention


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
    BlockedLocalMask.attention_path: blocked_local_attention,
    PackedDocumentsMask.attention_path: per_document_attention,
    PagedRequestsMask.attention_path: per_request_attention,
    "sdpa_sharing_kv_heads": masked_sdpa_attention_sharing_kv_heads,
}


def choose_attention_path(attention_mask, attn_implementation: str, is_iha: bool, device: torch.device) -> str:
    """The kernel path of one attention call, named from the kind of mask `create_iha_masks` built for it.

    - "blocked_local": a `BlockedLocalMask` (sliding IHA layer without past tokens on SDPA): SDPA over blocks of
      queries against the keys their window can reach.
    - "per_document": a `PackedDocumentsMask` (full IHA layer on packed rows on SDPA): causal SDPA per group of
      similar-length documents, no mask across documents.
    - "per_request": a `PagedRequestsMask` (IHA layer under continuous batching): every request of the packed row
      against its own keys only, sdpa or eager as the model runs (`serving_iha.py`).
    - "sdpa_sharing_kv_heads": a dense mask on an IHA layer with SDPA on CPU (padding, token causal, decoding):
      SDPA reading each KV head for its whole query group.
    - "backend": transformers' function for `attn_implementation`, with whatever mask that backend takes: None for
      SDPA's `is_causal` kernel, a BlockMask for flex (on packed rows it holds the document ids, and blocks across
      documents are skipped), FlashAttention's varlen path over virtual cumulative lengths, or eager's float mask.
      Standard (non-IHA) layers always take this path.
    """
    if isinstance(attention_mask, (BlockedLocalMask, PackedDocumentsMask, PagedRequestsMask)):
        return attention_mask.attention_path  # a fast path's plan names its own kernel
    if is_iha and attn_implementation == "sdpa" and isinstance(attention_mask, torch.Tensor) and device.type == "cpu":
        return "sdpa_sharing_kv_heads"
    return "backend"
