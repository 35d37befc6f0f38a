"""IHA layers on SDPA with the installed package: the mask function and the attention function registered as
`iha|sdpa` (`iha.attention.register_attention_paths`).

The folder's `masking_iha.create_interleaved_mask` calls the mask function of `iha|sdpa` where it is registered, with
transformers' mask arguments in virtual units plus the layer's `IHALayerSpec` and the token-level ids of packed
rows. `iha_sdpa_mask` returns a plan where a cheaper exact kernel exists, else transformers' own SDPA mask:

- a sliding layer without past tokens: `BlockedLocalMask` (`blocked_local.py`), SDPA over blocks of queries against
  the keys their window can reach;
- a full layer on packed rows: `PackedDocumentsMask` (`packed_documents.py`), causal SDPA per group of documents.

`iha_sdpa_attention` runs each plan with its kernel; a dense mask on CPU (padding, token causal, decoding) with SDPA
reading each KV head for its whole query group; everything else with transformers' SDPA function. Every kernel
returns what transformers' functions return (the output [B, N * P, H, d] and no weights) and is checked against the
plain reference `iha.models.iha.naive_iha` in tests/attention/.
"""

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import and_masks, padding_mask_function, sdpa_mask

from ..models.iha.layer_iha import IHALayerSpec
from .blocked_local import (
    BlockedLocalMask,
    blocked_local_attention,
    blocked_local_attention_applies,
    create_blocked_local_mask,
)
from .packed_documents import (
    PackedDocumentsMask,
    create_packed_documents_mask,
    per_document_attention,
    per_document_attention_applies,
)


def iha_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    iha_layer: IHALayerSpec | None = None,
    packed_sequence_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
):
    """The mask (or plan) of one IHA layer on SDPA; lengths and offsets in virtual units, as transformers' `sdpa_mask`
    takes them."""
    num_pseudo = iha_layer.num_pseudo_heads
    no_past_tokens = not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
    num_tokens = q_length // num_pseudo
    if blocked_local_attention_applies(iha_layer, num_tokens, kv_length // num_pseudo, no_past_tokens):
        if attention_mask is not None:
            mask_function = and_masks(mask_function, padding_mask_function(attention_mask))
        return create_blocked_local_mask(mask_function, batch_size, num_tokens, iha_layer, torch.device(device))
    if packed_sequence_ids is not None and per_document_attention_applies(iha_layer.is_sliding):
        return create_packed_documents_mask(
            packed_sequence_ids, num_pseudo, token_causal=iha_layer.mask_mode == "token_causal"
        )
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        device=device,
        **kwargs,
    )


def masked_sdpa_sharing_kv_heads(
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

    transformers' SDPA function copies keys and values once per query head (`repeat_kv`) whenever a mask is given. On
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


def iha_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention of one IHA layer on SDPA, by the kind of mask `iha_sdpa_mask` built for it."""
    if isinstance(attention_mask, BlockedLocalMask):
        return blocked_local_attention(module, query, key, value, attention_mask, dropout, scaling)
    if isinstance(attention_mask, PackedDocumentsMask):
        return per_document_attention(module, query, key, value, attention_mask, dropout, scaling)
    if isinstance(attention_mask, torch.Tensor) and query.device.type == "cpu":
        return masked_sdpa_sharing_kv_heads(module, query, key, value, attention_mask, dropout, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
