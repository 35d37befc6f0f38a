"""IHA layers on vLLM's CPU attention (`IHA_CPU_ATTN`): vLLM's own CPU builder and implementation over the virtual
view of the pages (`virtual.py`).

The builder is `CPUAttentionMetadataBuilder` on the virtual spec (head size d, P * block_size slots per block), so
vLLM picks the kernel variant (its ISA, which also lays out a block's rows) and the work schedule as for any layer,
fed the batch in virtual units. A decoding request's P pseudo-queries go to the kernel as P requests of one query
each (`one_request_per_decoding_pseudo_query`): the same mask, on the kernel's faster one-query path. The
implementation is `CPUAttentionBackendImpl` with head size d: it writes the new pseudo-keys and values at their
virtual slots and runs vLLM's causal paged-attention call over the virtual sequence.

Written against vLLM 0.32.0's `cpu_attn` (`support.TESTED_VLLM_RELEASES`).
"""

from typing import NamedTuple

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionLayer, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ....models.iha.layer_iha import IHALayerSpec
from . import IHA_CPU_BACKEND_NAME
from .virtual import (
    VirtualBatch,
    kernel_window,
    layer_spec_of,
    refuse_unsupported_layer_settings,
    virtual_kv_spec,
)


class KernelRequests(NamedTuple):
    """The requests the CPU kernel is handed: query starts, sequence lengths and block table rows, one per request."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @property
    def max_query_len(self) -> int:
        query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return int(query_lens.max()) if len(query_lens) else 0


def one_request_per_decoding_pseudo_query(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, num_pseudo_heads: int
) -> KernelRequests:
    """The virtual batch (query starts and sequence lengths already times P) with the P pseudo-queries of every
    request with one new token (a decoding step, or a prefill chunk of one token) handed to the kernel as P requests
    of one query each.

    Pseudo-query p of such a request of virtual length L sees virtual positions 0 .. L - P + p under the flat causal
    mask: it is a request of length L - (P - 1 - p) over the same pages (the same block table row), so the split
    computes the same function. vLLM's CPU kernel runs one-query requests faster than requests of a few queries
    (benchmarks/results/vllm_attention.md measures a decoding step both ways). Requests with more new tokens (prefill
    chunks, speculative decoding's drafts) stay whole.
    """
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    one_new_token = query_lens == num_pseudo_heads
    requests_each = torch.where(one_new_token, num_pseudo_heads, 1)
    request_of = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), requests_each)
    first_of_request = torch.cumsum(requests_each, 0) - requests_each
    pseudo_index = torch.arange(len(request_of), device=query_lens.device) - first_of_request[request_of]
    split = one_new_token[request_of]
    kernel_query_lens = torch.where(split, 1, query_lens[request_of])
    kernel_seq_lens = seq_lens[request_of] - torch.where(split, num_pseudo_heads - 1 - pseudo_index, 0)
    kernel_query_start_loc = torch.zeros(len(request_of) + 1, dtype=query_start_loc.dtype, device=query_lens.device)
    torch.cumsum(kernel_query_lens, 0, out=kernel_query_start_loc[1:])
    return KernelRequests(
        query_start_loc=kernel_query_start_loc,
        seq_lens=kernel_seq_lens.to(seq_lens.dtype),
        block_table=block_table[request_of],
    )


class IHACPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder on the virtual spec, fed the batch in virtual units with each decoding
    pseudo-query a request of its own."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device):
        spec = layer_spec_of(vllm_config, layer_names)
        super().__init__(virtual_kv_spec(kv_cache_spec, spec), layer_names, vllm_config, device)
        self.iha_layer = spec  # the layers' own `IHALayerSpec`
        self.virtual_batch = VirtualBatch(vllm_config, spec, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        virtual = self.virtual_batch.of(common_attn_metadata)
        requests = one_request_per_decoding_pseudo_query(
            virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, self.virtual_batch.num_pseudo_heads
        )
        kernel_batch = virtual.replace(
            query_start_loc=requests.query_start_loc,
            seq_lens=requests.seq_lens,
            block_table_tensor=requests.block_table,
            num_reqs=len(requests.seq_lens),
            max_query_len=requests.max_query_len,
            slot_mapping=virtual.slot_mapping[: virtual.num_actual_tokens],
        )
        return super().build(common_prefix_len, kernel_batch, fast_build)


class IHACPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention with head size d over the virtual sequence.

    The layer hands over q [tokens, H, P * d] and k, v [tokens, H_kv, P * d] whose rows hold each token's pseudo-tokens
    pseudo-major ([P, heads, d]), so that [tokens * P, heads, d] is the interleaved sequence; and its pages
    [blocks, H_kv, block_size, 2 * P * d], read as [blocks, H_kv, P * block_size, 2 * d] (the CPU backend keeps a
    block's keys, then its values: the same bytes either way).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        iha_layer: IHALayerSpec | None = None,
    ) -> None:
        refuse_unsupported_layer_settings(attn_type, alibi_slopes, logits_soft_cap, kv_sharing_target_layer_name)
        window = kernel_window(sliding_window, iha_layer)
        num_pseudo_heads = iha_layer.num_pseudo_heads
        self.iha_layer = iha_layer  # read back by the metadata builder (`virtual.layer_spec_of`)
        self.num_pseudo_heads = num_pseudo_heads
        super().__init__(num_heads, head_size // num_pseudo_heads, scale, num_kv_heads, None, window, kv_cache_dtype)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # the profiling run
            return output
        num_virtual, head_dim = attn_metadata.num_actual_tokens, self.head_size
        # vLLM's custom ops read raw pointers: every tensor they get is contiguous.
        virtual_query = query.reshape(-1, self.num_heads, head_dim)[:num_virtual].contiguous()
        virtual_key = key.reshape(-1, self.num_kv_heads, head_dim)[:num_virtual].contiguous()
        virtual_value = value.reshape(-1, self.num_kv_heads, head_dim)[:num_virtual].contiguous()
        # A prefix of the layer's contiguous output buffer: the kernel writes the pseudo-outputs there directly.
        virtual_output = output.view(-1, self.num_heads, head_dim)[:num_virtual]
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        virtual_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * self.num_pseudo_heads, 2 * head_dim)
        self.do_kv_cache_update(layer, virtual_key, virtual_value, virtual_cache, attn_metadata.slot_mapping)
        super().forward(
            layer,
            virtual_query,
            virtual_key,
            virtual_value,
            virtual_cache,
            attn_metadata,
            virtual_output,
            output_scale,
            output_block_scale,
        )
        return output


class IHACPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with IHA's virtual view of the pages (block sizes and dtypes as `CPU_ATTN`)."""

    # The layer's forward writes the pseudo-keys itself, at the virtual slots its metadata holds.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return IHA_CPU_BACKEND_NAME

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # the layer's head size is P * d; `support.check_servable` checks d

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[IHACPUAttentionImpl]:
        return IHACPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[IHACPUAttentionMetadataBuilder]:
        return IHACPUAttentionMetadataBuilder
