"""Attention per document: the fast path of full IHA layers on packed rows on SDPA, its plan, its kernel and when it
runs.

TRL's `--packing` puts several documents in one row with restarting position ids and no mask. A dense (N * P)^2 mask
with the documents' block diagonal inside it makes SDPA compute every (query, key) pair of the row and throw away those
across documents; cutting the virtual sequence at the document boundaries computes only the pairs inside each document
(for 4 documents of 512 tokens at P = 2, 4 * 1024^2 pairs: what the base model's dense 2048^2 costs). Documents of
similar length run together as one batch of SDPA, each padded at its end to the longest of its group: causal attention
never lets a real query see the padding after it, so the causal kernel runs without a mask (flat causal) or with one
small mask per group (token causal).

`iha.attention.sdpa.iha_sdpa_mask` asks `per_document_attention_applies` and builds the plan
(`create_packed_documents_mask`, a `PackedDocumentsMask`) in place of the layer's dense mask; the attention function
`iha.attention.sdpa.iha_sdpa_attention` runs it with `per_document_attention`.

"""

from dataclasses import dataclass

import torch
from torch import nn


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
    """The plan of a full IHA layer's attention on packed rows: the documents `per_document_attention` runs.

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


def per_document_attention_applies(is_sliding: bool) -> bool:
    """Whether an IHA layer on packed rows attends per document: full layers, outside torch.compile.

    Sliding layers take their document ids into the blocked mask instead. Under torch.compile the per-document path is
    not taken: it reads the document lengths on the host (a graph break per layer), and transformers cannot tell packed
    rows from unpacked ones while tracing (`find_packed_sequence_indices` always returns ids then), so compiled
    forwards use the dense mask with the document ids, as transformers' own models do.
    """
    return not is_sliding and not torch.compiler.is_compiling()


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
