"""IHA attention on vLLM's stock paged-attention kernels: the interleaved sequence in the pages' own bytes.

An IHA layer's `Attention` declares an ordinary full-attention KV-cache spec with `num_key_value_heads` heads of
head size P * d, so vLLM's block manager, memory budget and prefix caching see a normal layer, one slot per token.
The backends here read the same pages as P * block_size slots of width d: pseudo-token (n, p) of the token in slot
s sits at virtual slot s * P + p, which is the token-major interleave itself. One stock paged-attention call per
layer, with query starts and sequence lengths times P and `causal=True`, then computes IHA's flat causal mask
exactly (the kernels align causal masks to the bottom right, so a chunk's virtual queries see the request's whole
virtual past): chunked prefill and decoding alike. On the CPU kernel a decoding request's P pseudo-queries go as
P requests of one query each (`one_request_per_decoding_pseudo_query`): the same mask, on the kernel's faster
one-query path.

The virtual metadata (lengths, slot mapping and kernel schedule in virtual units) is built once per step by the
backends' metadata builders, never inside the layer's forward: the forward only reshapes its inputs, which keeps it
capturable in CUDA graphs on the GPU backend.

Backends: vLLM's CPU attention (`IHA_CPU_ATTN`, built on `CPU_ATTN`) and FlashAttention (`IHA_FLASH_ATTN`, built on
`FLASH_ATTN`). These read internals of vLLM 0.32.0 (`cpu_attn.CPUAttentionMetadata` and `_get_attn_isa`, the
`cpu_attn_*` custom ops, `flash_attn.FlashAttentionMetadataBuilder`): `support.TESTED_VLLM_RELEASES`.
"""

from typing import NamedTuple

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata, _get_attn_isa
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import AttentionSpec


IHA_CPU_BACKEND_NAME = "IHA_CPU_ATTN"
IHA_FLASH_BACKEND_NAME = "IHA_FLASH_ATTN"


def num_pseudo_heads_of(vllm_config: VllmConfig) -> int:
    return vllm_config.model_config.hf_config.num_pseudo_heads


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


def cpu_kernel_schedule(
    requests: KernelRequests,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    isa: str,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The CPU kernel's work schedule for these requests under the causal mask, made once per step (vLLM's
    `VLLM_CPU_ATTN_SPLIT_KV` decides, as for its own layers, whether a long one-query request's keys are split over
    threads)."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests.seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_lens=requests.seq_lens,
        dtype=dtype,
        query_start_loc=requests.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=kv_cache_dtype,
    )


def cpu_causal_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    requests: KernelRequests,
    scheduler_metadata: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The CPU kernel over the virtual slots: queries [virtual tokens, heads, d] against pages [blocks, kv heads,
    P * block_size, d], the causal mask aligned to the bottom right of every request; writes `output`."""
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=requests.query_start_loc,
        seq_lens=requests.seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=requests.block_table,
        softcap=0.0,
        scheduler_metadata=scheduler_metadata,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    return output


class IHACPUAttentionMetadataBuilder(AttentionMetadataBuilder[CPUAttentionMetadata]):
    """The CPU backend's metadata in virtual units: P queries and P keys per token, P * block_size slots per block."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.virtual_batch = VirtualBatch(vllm_config, device)
        num_pseudo = self.virtual_batch.num_pseudo_heads
        self.head_dim = kv_cache_spec.head_size // num_pseudo
        self.virtual_block_size = kv_cache_spec.block_size * num_pseudo
        self.num_heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        # The kernel variant ("vec", "amx", ...) also decides how a block's rows are laid out: writing and reading
        # must agree on it, for the virtual block size and head size d.
        self.isa = _get_attn_isa(self.dtype, self.virtual_block_size, self.head_dim, self.kv_cache_dtype)
        for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values():
            layer.isa = self.isa

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        virtual = self.virtual_batch.of(common_attn_metadata)
        requests = one_request_per_decoding_pseudo_query(
            virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, self.virtual_batch.num_pseudo_heads
        )
        scheduler_metadata = cpu_kernel_schedule(
            requests, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.isa, self.kv_cache_dtype
        )
        return CPUAttentionMetadata(
            num_actual_tokens=virtual.num_actual_tokens,
            max_query_len=requests.max_query_len,
            query_start_loc=requests.query_start_loc,
            max_seq_len=virtual.max_seq_len,
            seq_lens=requests.seq_lens,
            block_table=requests.block_table,
            slot_mapping=virtual.slot_mapping[: virtual.num_actual_tokens],
            scheduler_metadata=scheduler_metadata,
            causal=True,
        )


def virtual_cache_views(kv_cache: torch.Tensor, num_pseudo_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU pages [blocks, kv heads, block_size, 2 * P * d] as key and value caches of P * block_size slots of
    width d each ([blocks, kv heads, P * block_size, d]): the CPU backend keeps a block's keys, then its values."""
    num_blocks, num_kv_heads, block_size, both_widths = kv_cache.shape
    head_dim = both_widths // (2 * num_pseudo_heads)
    virtual = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size * num_pseudo_heads, head_dim)
    key_cache, value_cache = virtual.chunk(2, dim=2)
    return key_cache, value_cache


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


def refuse_unsupported_layer_settings(
    attn_type: str,
    alibi_slopes: list[float] | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    kv_sharing_target_layer_name: str | None,
) -> None:
    """What neither IHA backend (CPU, FlashAttention) runs: the virtual sequence is one causal decoder pass."""
    if attn_type != AttentionType.DECODER or alibi_slopes is not None or sliding_window is not None:
        raise ValueError("IHA layers run causal decoder attention without ALiBi or a kernel window.")
    if logits_soft_cap or kv_sharing_target_layer_name is not None:
        raise ValueError("IHA layers run without logit soft-capping or KV sharing across layers.")


class IHACPUAttentionImpl(AttentionImpl[CPUAttentionMetadata]):
    """One IHA layer's attention on the CPU kernel: write the new pseudo-keys and values at their virtual slots,
    then one causal paged-attention call over the virtual sequence.

    The layer hands over q [tokens, H, P * d] and k, v [tokens, H_kv, P * d] whose rows hold each token's pseudo-tokens
    pseudo-major ([P, heads, d]), so that [tokens * P, heads, d] is a view: the interleaved sequence.
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
        num_pseudo_heads: int = 1,
    ) -> None:
        refuse_unsupported_layer_settings(
            attn_type, alibi_slopes, sliding_window, logits_soft_cap, kv_sharing_target_layer_name
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_pseudo_heads = num_pseudo_heads
        self.head_size = head_size
        self.head_dim = head_size // num_pseudo_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sinks = None

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
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("IHA layers do not fuse output quantization into attention.")
        if attn_metadata is None:  # the profiling run
            return output
        num_virtual = attn_metadata.num_actual_tokens
        head_dim = self.head_dim
        # vLLM's custom ops read raw pointers: every tensor they get is contiguous.
        virtual_query = query.reshape(-1, self.num_heads, head_dim)[:num_virtual].contiguous()
        virtual_key = key.reshape(-1, self.num_kv_heads, head_dim)[:num_virtual].contiguous()
        virtual_value = value.reshape(-1, self.num_kv_heads, head_dim)[:num_virtual].contiguous()
        # A prefix of the layer's contiguous output buffer: the kernel writes the pseudo-outputs there directly.
        virtual_output = output.view(-1, self.num_heads, head_dim)[:num_virtual]
        key_cache, value_cache = virtual_cache_views(kv_cache, self.num_pseudo_heads)
        ops.cpu_attn_reshape_and_cache(
            virtual_key,
            virtual_value,
            key_cache,
            value_cache,
            attn_metadata.slot_mapping,
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        requests = KernelRequests(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table)
        cpu_causal_paged_attention(
            virtual_query,
            key_cache,
            value_cache,
            virtual_output,
            requests,
            attn_metadata.scheduler_metadata,
            self.scale,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
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


def iha_attention_backend() -> type:
    """The IHA backend of this platform: CPU attention on CPUs, FlashAttention on CUDA GPUs. Anything else refuses in
    one line, as does another backend asked for explicitly (`attention_config.backend`)."""
    from vllm.config import get_current_vllm_config
    from vllm.platforms import current_platform

    requested = get_current_vllm_config().attention_config.backend
    requested_name = getattr(requested, "name", requested)
    if current_platform.is_cpu():
        expected, backend_module, backend_class = "CPU_ATTN", __name__, "IHACPUAttentionBackend"
    elif current_platform.is_cuda():
        expected, backend_module, backend_class = (
            "FLASH_ATTN",
            f"{__package__}.attention_flash",
            "IHAFlashAttentionBackend",
        )
    else:
        raise ValueError(
            f"IHA layers run on vLLM's CPU_ATTN (CPU) and FLASH_ATTN (CUDA GPU) attention backends; this platform is "
            f"{current_platform.device_type!r}."
        )
    if requested_name not in (None, expected):
        raise ValueError(
            f"IHA layers run on vLLM's CPU_ATTN (CPU) and FLASH_ATTN (CUDA GPU) attention backends, not "
            f"{requested_name}: leave the attention backend unset or set it to {expected}."
        )
    import importlib

    return getattr(importlib.import_module(backend_module), backend_class)


def register_backends() -> None:
    """Give the IHA backends their names in vLLM's backend registry (the `Attention` layer looks its backend up by
    name). Safe to call again: vLLM loads plugins once per process, but tests may call it more often."""
    backends = {
        IHA_CPU_BACKEND_NAME: f"{__name__}.IHACPUAttentionBackend",
        IHA_FLASH_BACKEND_NAME: f"{__package__}.attention_flash.IHAFlashAttentionBackend",
    }
    for name, class_path in backends.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, class_path)
