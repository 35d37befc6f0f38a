"""IHA attention on vLLM's FlashAttention backend (CUDA GPUs): the same virtual view of the pages as on the CPU.

The layer's KV-cache spec is the CPU one (H_kv heads of head size P * d). vLLM 0.32.0 hands each layer its pages as
a logical [blocks, H_kv, block_size, 2 * P * d] tensor whose strides follow the KV-cache layout (token-major NHD by
default, head-major HND), every block one dense page. This backend owns the interior of its blocks: it reads each
block's bytes in their memory order as [H_kv, P * block_size, 2 * d], where virtual slot s * P + p holds the key
(first d) and value (last d) of pseudo-token (n, p) of the token in slot s. Writing and reading both go through
that one view, so which bytes of the block hold which pseudo-token never depends on the layout. It is
FlashAttention's own layout for head size d and block size P * block_size, so the stock metadata builder and kernel
run on it with the batch in virtual units (`virtual.VirtualBatch`, built in the builder's persistent buffers:
nothing is allocated in the forward, which a full CUDA graph may capture).

Imported only on CUDA platforms (`attention.iha_attention_backend`). Written against vLLM 0.32.0's
`flash_attn.FlashAttentionMetadataBuilder` and `FlashAttentionImpl`, and not run on a GPU yet: the GPU check's
vLLM step (docs/serving.md) is what records its equality with `generate()`.
"""

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionLayer, AttentionType, CommonAttentionMetadata, MultipleOf
from vllm.v1.attention.backends.fa_utils import reshape_and_cache_flash
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ....models.iha.layer_iha import IHALayerSpec
from . import IHA_FLASH_BACKEND_NAME
from .virtual import (
    VirtualBatch,
    kernel_window,
    layer_spec_of,
    refuse_unsupported_layer_settings,
    virtual_flash_cache,
    virtual_kv_spec,
)


class IHAFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention's metadata builder on the virtual spec (head size d, P * block_size slots per block), fed the
    batch in virtual units."""

    # vLLM reuses one group's metadata for another group of the same spec by swapping in that group's block table and
    # slot mapping (`update_block_table`): the real slot mapping, where these layers read virtual slots. Every group
    # builds its own.
    supports_update_block_table: bool = False

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device):
        spec = layer_spec_of(vllm_config, layer_names)
        super().__init__(virtual_kv_spec(kv_cache_spec, spec), layer_names, vllm_config, device)
        self.iha_layer = spec  # the layers' own `IHALayerSpec`
        self.virtual_batch = VirtualBatch(vllm_config, spec, device)
        # `build` bounds the kernel's splits (so that a full CUDA graph keeps the buffers it captured) for batches of
        # at most this many tokens, the largest batch a graph is captured for; it counts the virtual tokens here.
        if self.max_cudagraph_size is not None:
            self.max_cudagraph_size *= spec.num_pseudo_heads

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashAttentionMetadata:
        return super().build(common_prefix_len, self.virtual_batch.of(common_attn_metadata), fast_build)

    def update_block_table(self, metadata, blk_table, slot_mapping):
        raise NotImplementedError("IHA layers build their metadata for every KV-cache group (virtual slots).")


class IHAFlashAttentionImpl(FlashAttentionImpl):
    """One IHA layer on FlashAttention: write the new pseudo-keys and values at their virtual slots, then the stock
    varlen paged call (causal, bottom-right aligned) over the virtual sequence."""

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
        # vLLM checks the GPU against a backend only where it chooses the backend itself; the IHA layers name theirs.
        capability = current_platform.get_device_capability()
        if capability is None or not FlashAttentionBackend.supports_compute_capability(capability):
            found = "an unknown one" if capability is None else f"{capability.major}.{capability.minor}"
            raise ValueError(
                "IHA layers on CUDA run on vLLM's FlashAttention, which needs a GPU of compute capability 8.0 or newer "
                f"(this one has {found}): serve it with transformers instead (`iha serve FOLDER --continuous_batching`)."
            )
        head_dim = head_size // num_pseudo_heads
        if not FlashAttentionBackend.supports_head_size(head_dim):
            raise ValueError(
                f"head_dim {head_dim} is not a head size vLLM's FlashAttention takes on this GPU (multiples of 8 up to "
                "256; 512 with FlashAttention 4): IHA layers attend with head size head_dim; serve it with "
                "transformers instead (`iha serve FOLDER --continuous_batching`)."
            )
        self.num_pseudo_heads = num_pseudo_heads
        super().__init__(num_heads, head_dim, scale, num_kv_heads, None, window, kv_cache_dtype, None, attn_type)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("IHA layers do not fuse output quantization into attention.")
        if attn_metadata is None:  # the profiling run
            return output.fill_(0)
        head_dim = self.head_size
        # Views only: each token's row holds its pseudo-tokens pseudo-major, so [tokens * P, heads, d] is the
        # interleaved sequence.
        virtual_query = query.view(-1, self.num_heads, head_dim)
        virtual_key = key.view(-1, self.num_kv_heads, head_dim)
        virtual_value = value.view(-1, self.num_kv_heads, head_dim)
        virtual_output = output.view(-1, self.num_heads, head_dim)
        virtual_cache = virtual_flash_cache(kv_cache, self.num_pseudo_heads)
        key_cache, value_cache = virtual_cache.transpose(1, 2).split(head_dim, dim=-1)
        reshape_and_cache_flash(
            virtual_key,
            virtual_value,
            key_cache,
            value_cache,
            attn_metadata.slot_mapping,
            self.kv_cache_dtype,
            layer._k_scale,
            layer._v_scale,
        )
        super().forward(layer, virtual_query, virtual_key, virtual_value, virtual_cache, attn_metadata, virtual_output)
        return output


class IHAFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with IHA's virtual view of the pages."""

    # The layer's forward writes the pseudo-keys itself, at the virtual slots its metadata holds.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return IHA_FLASH_BACKEND_NAME

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int | MultipleOf]:
        # The kernel sees P * block_size slots of head size d: any multiple of 16 for those stays one.
        return [MultipleOf(16)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True  # the layer's head size is P * d; the kernel's head size d is checked when the impl is built

    @staticmethod
    def get_impl_cls() -> type[IHAFlashAttentionImpl]:
        return IHAFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[IHAFlashAttentionMetadataBuilder]:
        return IHAFlashAttentionMetadataBuilder
