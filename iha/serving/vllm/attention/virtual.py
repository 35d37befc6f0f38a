"""What both IHA backends share: the interleaved sequence in the pages' own bytes, and the batch in virtual units.

An IHA layer's `Attention` declares an ordinary KV-cache spec with `num_key_value_heads` heads of head size P * d, so
vLLM's block manager, memory budget and prefix caching see a normal layer, one slot per token. The backends read the
same pages as P * block_size slots of width d (`virtual_kv_spec`): pseudo-token (n, p) of the token in slot s sits at
virtual slot s * P + p, which is the token-major interleave itself. One stock paged-attention call per layer, with
query starts and sequence lengths times P (`VirtualBatch`) and `causal=True`, then computes IHA's flat causal mask
exactly (the kernels align causal masks to the bottom right, so a chunk's virtual queries see the request's whole
virtual past): chunked prefill and decoding alike.

A kernel window over the same sequence counts virtual tokens: sliding IHA layers (iha_window_unit "virtual") hand the
kernel a flat window of sliding_window * P virtual tokens (`kernel_window`), over a sliding-window cache spec that
keeps one token more than a standard layer's (`self_attention.cache_window_in_tokens`), so that vLLM frees the blocks
that leave the window. Folders whose sliding IHA layers count whole tokens are refused before the engine starts
(`support.check_servable`).

The virtual metadata is built once per step by the backends' metadata builders, never inside the layer's forward: the
forward only reshapes its inputs, which keeps it capturable in CUDA graphs on the GPU backend.
"""

import dataclasses

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec


def num_pseudo_heads_of(vllm_config: VllmConfig) -> int:
    return vllm_config.model_config.hf_config.num_pseudo_heads


def virtual_kv_spec(kv_cache_spec: AttentionSpec, num_pseudo_heads: int) -> AttentionSpec:
    """The layer's spec (heads of size P * d, block_size slots; a sliding layer's window of W + 1 tokens) as the kernel
    reads it: heads of size d, P * block_size slots per block, a window of W * P virtual tokens."""
    virtual = dataclasses.replace(
        kv_cache_spec,
        head_size=kv_cache_spec.head_size // num_pseudo_heads,
        head_size_v=kv_cache_spec.head_size_v // num_pseudo_heads,
        block_size=kv_cache_spec.block_size * num_pseudo_heads,
    )
    cache_window = getattr(kv_cache_spec, "sliding_window", None)
    if cache_window is not None:
        virtual = dataclasses.replace(virtual, sliding_window=(cache_window - 1) * num_pseudo_heads)
    return virtual


class VirtualBatch:
    """A step's batch in virtual units, built by a metadata builder into buffers it keeps: query starts and sequence
    lengths times P, and the slot mapping of the pseudo-tokens (pseudo-token (n, p) of the token in slot s at virtual
    slot s * P + p; padding tokens, slot -1, stay -1 for all their pseudo-tokens).

    The buffers outlive the step, so that a CUDA graph captured over the layer's forward reads this step's values at
    the addresses it recorded.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.num_pseudo_heads = num_pseudo_heads_of(vllm_config)
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


def kernel_window(sliding_window: int | None, virtual_sliding_window: int | None, num_pseudo_heads: int) -> int | None:
    """The window the kernel runs over the virtual sequence: `virtual_sliding_window` (W * P virtual tokens), given by
    a sliding IHA layer with its cache spec's window `sliding_window` (W + 1 tokens); None for a global layer."""
    if virtual_sliding_window is None and sliding_window is None:
        return None
    if virtual_sliding_window is None or sliding_window != virtual_sliding_window // num_pseudo_heads + 1:
        raise ValueError(
            f"A sliding IHA layer keeps W + 1 tokens of cache for a window of W * P virtual tokens; got a cache window "
            f"of {sliding_window} tokens and a kernel window of {virtual_sliding_window} virtual tokens (P = "
            f"{num_pseudo_heads})."
        )
    return virtual_sliding_window


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
