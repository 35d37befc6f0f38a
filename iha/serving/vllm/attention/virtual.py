"""What both IHA backends share: the interleaved sequence in the pages' own bytes, and the batch in virtual units.

An IHA layer's `Attention` declares an ordinary KV-cache spec with `num_key_value_heads` heads of head size P * d, so
vLLM's block manager, memory budget and prefix caching see a normal layer, one slot per token. The backends read the
same pages as P * block_size slots of width d (`virtual_kv_spec`): pseudo-token (n, p) of the token in slot s sits at
virtual slot s * P + p, which is the token-major interleave itself. One stock paged-attention call per layer, with
query starts and sequence lengths times P (`VirtualBatch`) and `causal=True`, then computes IHA's flat causal mask
exactly (the kernels align causal masks to the bottom right, so a chunk's virtual queries see the request's whole
virtual past): chunked prefill and decoding alike.

A kernel window over the same sequence counts virtual tokens: sliding IHA layers hand the kernel the paper's flat
window of sliding_window * P virtual tokens (`kernel_window`), over a sliding-window cache spec of the tokens that
window reaches, one more than a standard layer's when P > 1 (`IHALayerSpec.cache_window`), so that vLLM frees the
blocks that leave the window. Every number comes from the layer's `IHALayerSpec`, which the layer hands its
implementation and the metadata builder reads back (`layer_spec_of`).

The virtual metadata is built once per step by the backends' metadata builders, never inside the layer's forward: the
forward only reshapes its inputs, which keeps it capturable in CUDA graphs on the GPU backend.
"""

import dataclasses

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from ....models.iha.layer_iha import IHALayerSpec


def layer_spec_of(vllm_config: VllmConfig, layer_names: list[str]) -> IHALayerSpec:
    """The `IHALayerSpec` the first layer of a KV-cache group handed its implementation, that object itself; the group's
    other layers must hold equal ones (a group holds layers of one cache spec, and the spec's numbers are theirs)."""
    layers = vllm_config.compilation_config.static_forward_context
    spec = layers[layer_names[0]].impl.iha_layer
    others = {layers[name].impl.iha_layer for name in layer_names} - {spec}
    if others:
        raise ValueError(
            f"The IHA layers {layer_names} of one KV-cache group disagree on what they are: {spec}, {others}."
        )
    return spec


def virtual_kv_spec(kv_cache_spec: AttentionSpec, spec: IHALayerSpec) -> AttentionSpec:
    """The layer's cache spec (heads of size P * d, block_size slots; a sliding layer's window of the tokens it
    reaches) as the kernel reads it: heads of size d, P * block_size slots per block, a window of W * P virtual
    tokens."""
    num_pseudo_heads = spec.num_pseudo_heads
    virtual = dataclasses.replace(
        kv_cache_spec,
        head_size=kv_cache_spec.head_size // num_pseudo_heads,
        head_size_v=kv_cache_spec.head_size_v // num_pseudo_heads,
        block_size=kv_cache_spec.block_size * num_pseudo_heads,
    )
    if getattr(kv_cache_spec, "sliding_window", None) is not None:
        virtual = dataclasses.replace(virtual, sliding_window=spec.virtual_window)
    return virtual


class VirtualBatch:
    """A step's batch in virtual units, built by a metadata builder into buffers it keeps: query starts and sequence
    lengths times P, and the slot mapping of the pseudo-tokens (pseudo-token (n, p) of the token in slot s at virtual
    slot s * P + p; padding tokens, slot -1, stay -1 for all their pseudo-tokens).

    The buffers outlive the step, so that a CUDA graph captured over the layer's forward reads this step's values at
    the addresses it recorded.
    """

    def __init__(self, vllm_config: VllmConfig, spec: IHALayerSpec, device: torch.device):
        self.num_pseudo_heads = spec.num_pseudo_heads
        scheduler = vllm_config.scheduler_config
        max_tokens = max(
            scheduler.max_num_batched_tokens, vllm_config.compilation_config.max_cudagraph_capture_size or 0
        )
        max_requests = max(scheduler.max_num_seqs, max_tokens)  # padded batches may count a request per token
        self.pseudo_offsets = torch.arange(self.num_pseudo_heads, device=device)
        self.query_start_loc = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_tokens * self.num_pseudo_heads,), -1, dtype=torch.int64, device=device)

    def of(self, metadata: CommonAttentionMetadata) -> CommonAttentionMetadata:
        if metadata.causal is not True:
            raise ValueError("IHA layers run causal decoder attention only; this batch asks for another mask.")
        num_pseudo = self.num_pseudo_heads
        query_start_loc = self.query_start_loc[: metadata.query_start_loc.shape[0]]
        torch.mul(metadata.query_start_loc, num_pseudo, out=query_start_loc)
        seq_lens = self.seq_lens[: metadata.seq_lens.shape[0]]
        torch.mul(metadata.seq_lens, num_pseudo, out=seq_lens)
        slots = metadata.slot_mapping
        slot_mapping = self.slot_mapping[: slots.shape[0] * num_pseudo]
        virtual_slots = slots.unsqueeze(-1) * num_pseudo + self.pseudo_offsets
        slot_mapping.copy_(torch.where(slots.unsqueeze(-1) >= 0, virtual_slots, -1).view(-1))
        upper_bound = metadata.seq_lens_cpu_upper_bound
        return metadata.replace(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=metadata.query_start_loc_cpu * num_pseudo,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=None if upper_bound is None else upper_bound * num_pseudo,
            num_actual_tokens=metadata.num_actual_tokens * num_pseudo,
            max_query_len=metadata.max_query_len * num_pseudo,
            max_seq_len=metadata.max_seq_len * num_pseudo,
            slot_mapping=slot_mapping,
            positions=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )


def virtual_flash_cache(kv_cache: torch.Tensor, num_pseudo_heads: int) -> torch.Tensor:
    """A layer's pages (logical [blocks, H_kv, block_size, 2 * P * d], NHD or HND in memory, each block one dense
    page) as FlashAttention's [blocks, H_kv, P * block_size, 2 * d] of the virtual slots: each block's bytes in their
    memory order, so a virtual block is a physical one whatever the layout."""
    num_blocks, num_kv_heads, block_size, both_widths = kv_cache.shape
    physical = kv_cache if kv_cache.is_contiguous() else kv_cache.transpose(1, 2)
    if not physical.is_contiguous():
        raise ValueError("IHA layers read whole KV-cache blocks; this cache layout splits them.")
    head_dim = both_widths // (2 * num_pseudo_heads)
    return physical.view(num_blocks, num_kv_heads, block_size * num_pseudo_heads, 2 * head_dim)


def kernel_window(sliding_window: int | None, spec: IHALayerSpec) -> int | None:
    """The window the kernel runs over the virtual sequence: the layer's `virtual_window` (W * P virtual tokens), given
    with its cache spec's window `sliding_window` (`IHALayerSpec.cache_window`); None for a global layer."""
    if sliding_window != spec.cache_window:
        raise ValueError(
            f"A sliding IHA layer keeps a cache window of {spec.cache_window} tokens for its window of "
            f"{spec.virtual_window} virtual tokens (P = {spec.num_pseudo_heads}); vLLM built it with {sliding_window}."
        )
    return spec.virtual_window


def refuse_unsupported_layer_settings(
    attn_type: str,
    alibi_slopes: list[float] | None,
    logits_soft_cap: float | None,
    kv_sharing_target_layer_name: str | None,
) -> None:
    """What neither IHA backend (CPU, FlashAttention) runs: the virtual sequence is one causal decoder pass."""
    if attn_type != AttentionType.DECODER or alibi_slopes is not None:
        raise ValueError("IHA layers run causal decoder attention without ALiBi.")
    if logits_soft_cap or kv_sharing_target_layer_name is not None:
        raise ValueError("IHA layers run without logit soft-capping or KV sharing across layers.")
