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
"""IHA attention on vLLM's stock paged-attention kernels: the interleaved sequence in the pages' own bytes.

An IHA layer's `Attention` declares an ordinary full-attention KV-cache spec with `num_key_value_heads` heads of
head size P * d, so vLLM's block manager, memory budget and prefix caching see a normal layer, one slot per token.
The backends here read the same pages as P * block_size slots of width d: pseudo-token (n, p) of the token in slot
s sits at virtual slot s * P + p, which is the token-major interleave itself. One stock paged-attention call per
layer, with query starts and sequence lengths times P and `causal=True`, then computes IHA's flat causal mask
exactly (the kernels align causal masks to the bottom right, so a chunk's virtual queries see the request's whole
virtual past): chunked prefill and decoding alike.

The virtual metadata (lengths, slot mapping and kernel schedule in virtual units) is built once per step by the
backends' metadata builders, never inside the layer's forward: the forward only reshapes its inputs, which keeps it
capturable in CUDA graphs on the GPU backend.

Backends: vLLM's CPU attention (`IHA_CPU_ATTN`, built on `CPU_ATTN`) and FlashAttention (`IHA_FLASH_ATTN`, built on
`FLASH_ATTN`). These read internals of vLLM 0.32.0 (`cpu_attn.CPUAttentionMetadata` and `_get_attn_isa`, the
`cpu_attn_*` custom ops, `flash_attn.FlashAttentionMetadataBuilder`): `support.TESTED_VLLM_RELEASES`.
"""

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


def virtual_slot_mapping(slot_mapping: torch.Tensor, pseudo_offsets: torch.Tensor) -> torch.Tensor:
    """[tokens] cache slots -> [tokens * P] virtual slots: pseudo-token (n, p) of the token in slot s at s * P + p.

    Padding tokens (slot -1) stay -1 for all their pseudo-tokens: the kernels skip them.
    """
    num_pseudo_heads = pseudo_offsets.shape[0]
    virtual = slot_mapping.unsqueeze(-1) * num_pseudo_heads + pseudo_offsets
    return torch.where(slot_mapping.unsqueeze(-1) >= 0, virtual, -1).reshape(-1).contiguous()


def num_pseudo_heads_of(vllm_config: VllmConfig) -> int:
    return vllm_config.model_config.hf_config.num_pseudo_heads


class IHACPUAttentionMetadataBuilder(AttentionMetadataBuilder[CPUAttentionMetadata]):
    """The CPU backend's metadata in virtual units: P queries and P keys per token, P * block_size slots per block."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_pseudo_heads = num_pseudo_heads_of(vllm_config)
        self.head_dim = kv_cache_spec.head_size // self.num_pseudo_heads
        self.virtual_block_size = kv_cache_spec.block_size * self.num_pseudo_heads
        self.num_heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        # The kernel variant ("vec", "amx", ...) also decides how a block's rows are laid out: writing and reading
        # must agree on it, for the virtual block size and head size d.
        self.isa = _get_attn_isa(self.dtype, self.virtual_block_size, self.head_dim, self.kv_cache_dtype)
        for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values():
            layer.isa = self.isa
        self.pseudo_offsets = torch.arange(self.num_pseudo_heads, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        metadata = common_attn_metadata
        if metadata.causal is not True:
            raise ValueError("IHA layers run causal decoder attention only; this batch asks for non-causal attention.")
        num_pseudo = self.num_pseudo_heads
        num_tokens = metadata.num_actual_tokens
        query_start_loc = (metadata.query_start_loc * num_pseudo).contiguous()
        seq_lens = (metadata.seq_lens * num_pseudo).contiguous()
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=metadata.num_reqs,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return CPUAttentionMetadata(
            num_actual_tokens=num_tokens * num_pseudo,
            max_query_len=metadata.max_query_len * num_pseudo,
            query_start_loc=query_start_loc,
            max_seq_len=metadata.max_seq_len * num_pseudo,
            seq_lens=seq_lens,
            block_table=metadata.block_table_tensor,
            slot_mapping=virtual_slot_mapping(metadata.slot_mapping[:num_tokens], self.pseudo_offsets),
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
        if attn_type != AttentionType.DECODER or alibi_slopes is not None or sliding_window is not None:
            raise ValueError("IHA layers run causal decoder attention without ALiBi or a kernel window.")
        if logits_soft_cap or kv_sharing_target_layer_name is not None:
            raise ValueError("IHA layers run without logit soft-capping or KV sharing across layers.")
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
        ops.cpu_attention_with_kv_cache(
            query=virtual_query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=virtual_output,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=attn_metadata.block_table,
            softcap=0.0,
            scheduler_metadata=attn_metadata.scheduler_metadata,
            s_aux=None,
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
    """The IHA backend for this platform: the CPU backend on CPU, FlashAttention on CUDA GPUs; others refuse."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return IHACPUAttentionBackend
    raise ValueError(
        f"IHA layers run on vLLM's CPU attention backend only in this build of the plugin; this platform is "
        f"{current_platform.device_type!r}."
    )


def register_backends() -> None:
    """Give the IHA backends their names in vLLM's backend registry (the `Attention` layer looks its backend up by
    name). Safe to call again: vLLM loads plugins once per process, but tests may call it more often."""
    for name, class_name in ((IHA_CPU_BACKEND_NAME, "IHACPUAttentionBackend"),):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, f"{__name__}.{class_name}")
