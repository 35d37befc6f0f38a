"""The attention of an IHA decoder layer on vLLM: Llama's attention (`vllm/model_executor/models/llama.py`) with the
IHA layers' projections, positions and backend. It is the `attn_layer_type` of vLLM's `LlamaDecoderLayer`
(`model.py`), built with the arguments that class passes.

- **Projections.** The head mixing is linear, so it is folded into the projections when the weights load
  (`iha.models.folding`, `load_weights` below): `qkv_proj` has P * d rows per head (the P pseudo-heads of that head) and
  `o_proj` P * d columns per head (the collapse). The layer then runs no mixing at all, and tensor parallelism shards
  the folded projections by KV group exactly like Llama's. Qwen3's per-head q/k norm comes between the projection and
  the mixing and is not linear: those layers keep the explicit mixing (`mixing.py`), as does
  `hf_overrides={"iha_fold_mixing": False}`.
- **Positions.** RoPE rotates the mixed queries and keys, pseudo-token (n, p) at position n ("shared") or n * P + p
  ("virtual"): a rotation commutes with mixing across heads, so this is the reference's rotation before the mixing.
- **Attention.** One stock paged-attention call over the interleaved sequence (`attention/`), which is the flat
  causal mask; the cache holds the P mixed pseudo-streams of every KV head. A sliding IHA layer runs the kernel's own
  window over the same sequence, the paper's W * P virtual tokens, on a sliding-window cache spec of the tokens that
  window reaches (`IHALayerSpec.cache_window`), so its cache is bounded by the window.

What a layer is (its type, P, window, cache window) is its `IHALayerSpec` (`iha/models/iha/layer_iha.py`), built once
here and handed to the backend, whose metadata builder reads the same object.

Standard layers among IHA ones ("full_attention", "sliding_attention") are Llama's attention, with Qwen3's q/k norm
and SmolLM3's NoPE layers where the config has them. What another block changes (Gemma 3: its scaling, q/k norm and
per-layer-type RoPE, `gemma3.IHAGemma3Attention`) is in `output_bias`, `scaling`, `head_norms` and
`rotary_embedding`.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import CacheConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import AutoWeightsLoader, extract_layer_index
from vllm.v1.attention.backend import AttentionType

from ...models.folding import fold_collapse_into_output, fold_mixing_into_projection, head_major_to_pseudo_major
from .attention import iha_attention_backend
from .mixing import IHAHeadMixing
from .support import UnsupportedByVLLMError, folds_mixing


class IHAAttention(nn.Module):
    """Attention of one layer: IHA on IHA layers, Llama's attention on standard ones."""

    def __init__(
        self,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.spec = config.layer_spec(layer_idx)  # what this layer is, handed to the backend as it is
        self.is_iha = self.spec.is_iha
        self.fold_mixing = self.is_iha and folds_mixing(config)
        self.num_pseudo_heads = self.spec.num_pseudo_heads
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads

        # A folded IHA layer projects every head straight to its P pseudo-heads: P * d rows per head.
        projection_head_size = self.head_dim * (self.num_pseudo_heads if self.fold_mixing else 1)
        self.q_size = self.num_heads * projection_head_size
        self.kv_size = self.num_kv_heads * projection_head_size
        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=projection_head_size,
            total_num_heads=num_heads,
            total_num_kv_heads=num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=num_heads * projection_head_size,
            output_size=hidden_size,
            bias=self.output_bias(config),
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm, self.k_norm = self.head_norms(config)
        self.head_mixing = None
        if self.is_iha and not self.fold_mixing:
            self.head_mixing = IHAHeadMixing(num_heads, num_kv_heads, self.num_pseudo_heads, config.iha_collapse_mode)
        self.virtual_positions = self.is_iha and self.spec.position_mode == "virtual"
        self.rotary_emb = self.rotary_embedding(config, max_position_embeddings, layer_idx)
        self.register_buffer("pseudo_offsets", torch.arange(self.num_pseudo_heads), persistent=False)

        if self.is_iha:
            # Head size P * d for the KV-cache spec (the P pseudo-streams of every KV head), a sliding window of the
            # tokens the layer's window reaches; the backend attends with head size d over the interleaved sequence.
            self.attn = Attention(
                self.num_heads,
                self.num_pseudo_heads * self.head_dim,
                self.scaling(config),
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                per_layer_sliding_window=self.spec.cache_window,
                prefix=f"{prefix}.attn",
                attn_backend=iha_attention_backend(),
                iha_layer=self.spec,
            )
        else:
            self.attn = Attention(
                self.num_heads,
                self.head_dim,
                self.scaling(config),
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                per_layer_sliding_window=self.spec.sliding_window,
                prefix=f"{prefix}.attn",
            )
        # Folded layers take their checkpoint tensors here until the layer's set is complete (`load_weights`).
        self.unfolded_weights: dict[str, torch.Tensor] = {}

    # --- what another block changes (Gemma 3: gemma3.IHAGemma3Attention) ------------------------------------------

    def output_bias(self, config) -> bool:
        return config.o_proj_bias

    def scaling(self, config) -> float:
        return self.head_dim**-0.5

    def head_norms(self, config) -> tuple[RMSNorm | None, RMSNorm | None]:
        """Qwen3's per-head norm of queries and keys, before RoPE and before the mixing."""
        if not config.use_qk_norm:
            return None, None
        return RMSNorm(self.head_dim, eps=config.rms_norm_eps), RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def rotary_embedding(self, config, max_position_embeddings: int, layer_idx: int):
        if not config.no_rope_layers[layer_idx]:  # SmolLM3's NoPE layers have no positional encoding
            return None
        max_position = max_position_embeddings * (self.num_pseudo_heads if self.virtual_positions else 1)
        return get_rope(
            self.head_dim, max_position=max_position, rope_parameters=config.rope_parameters, is_neox_style=True
        )

    # --- forward -------------------------------------------------------------------------------------------------

    def pseudo_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[tokens] positions -> [tokens * P]: n for every pseudo-token (shared) or n * P + p (virtual).

        Always a new contiguous tensor: vLLM's RoPE op reads raw pointers, and a broadcast view of a one-token
        batch (stride 0) would rotate with the wrong positions without any error.
        """
        if self.virtual_positions:
            virtual = positions.unsqueeze(-1) * self.num_pseudo_heads + self.pseudo_offsets
            return virtual.reshape(-1).contiguous()
        return positions.repeat_interleave(self.num_pseudo_heads).contiguous()

    def norm_heads(self, states: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        per_head = states.reshape(-1, self.head_dim).contiguous()
        return norm(per_head).view(states.shape[0], -1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self.norm_heads(q, self.q_norm), self.norm_heads(k, self.k_norm)
        if not self.is_iha:
            if self.rotary_emb is not None:
                q, k = self.rotary_emb(positions, q, k)
            output, _ = self.o_proj(self.attn(q, k, v))
            return output

        if self.head_mixing is not None:
            q, k, v = self.head_mixing.mix_qkv(q, k, v)
        # Each token's row holds its P pseudo-heads pseudo-major, so [tokens * P, heads * d] is the interleaved
        # sequence. Contiguous copies: the RoPE and attention ops below read raw pointers.
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens * self.num_pseudo_heads, -1).contiguous()
        k = k.reshape(num_tokens * self.num_pseudo_heads, -1).contiguous()
        v = v.contiguous()
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(self.pseudo_positions(positions), q, k)
        attn_output = self.attn(q.view(num_tokens, -1), k.view(num_tokens, -1), v)
        if self.head_mixing is not None:
            attn_output = self.head_mixing.collapse_heads(attn_output)
        output, _ = self.o_proj(attn_output)
        return output

    # --- weights: folded layers fold the checkpoint's projections and mixing once they have them all -------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors by their names in this module, as vLLM's `AutoWeightsLoader` hands them over (q/k/v already
        renamed `qkv_proj` with a `shard_id`, as `LlamaModel`'s mapper does). A folded layer keeps them until its set
        is complete, then folds and loads them (returning the parameters it loaded; none before): a later complete
        set (a trainer syncing new weights, one tensor at a time) folds and loads the layer again."""
        if not self.fold_mixing:
            return AutoWeightsLoader(self).load_weights(weights)
        loaded: set[str] = set()
        for name, tensor in weights:
            shard_id = getattr(tensor, "shard_id", None)
            if name.startswith("qkv_proj.") and shard_id in ("q", "k", "v"):
                name = name.replace("qkv_proj.", f"{shard_id}_proj.", 1)
            if name not in self.unfolded_names():
                raise UnsupportedByVLLMError(f"Unexpected checkpoint tensor {name!r} for a folded IHA attention layer.")
            self.unfolded_weights[name] = tensor
            if all(needed in self.unfolded_weights for needed in self.unfolded_names()):
                folded, self.unfolded_weights = self.unfolded_weights, {}
                loaded.update(self.load_folded(folded))
        return loaded

    def unfolded_names(self) -> list[str]:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        names += [f"head_mixing.{name}" for name in ("alpha_q", "alpha_k", "alpha_v", "collapse")]
        if self.qkv_proj.bias is not None:
            names += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if self.o_proj.bias is not None:
            names.append("o_proj.bias")
        return names

    def load_folded(self, weights: dict[str, torch.Tensor]) -> list[str]:
        head_dim, num_pseudo = self.head_dim, self.num_pseudo_heads
        loader = self.qkv_proj.weight.weight_loader
        for shard_id, alpha_name in (("q", "alpha_q"), ("k", "alpha_k"), ("v", "alpha_v")):
            folded, folded_bias = fold_mixing_into_projection(
                weights[f"{shard_id}_proj.weight"],
                weights.get(f"{shard_id}_proj.bias"),
                weights[f"head_mixing.{alpha_name}"],
                head_dim,
            )
            loader(self.qkv_proj.weight, folded, shard_id)
            if folded_bias is not None:
                self.qkv_proj.bias.weight_loader(self.qkv_proj.bias, folded_bias, shard_id)
        folded_output = fold_collapse_into_output(weights["o_proj.weight"], weights["head_mixing.collapse"], head_dim)
        self.o_proj.weight.weight_loader(self.o_proj.weight, folded_output)
        loaded = ["qkv_proj.weight", "o_proj.weight"]
        if self.qkv_proj.bias is not None:
            loaded.append("qkv_proj.bias")
        if self.o_proj.bias is not None:
            self.o_proj.bias.weight_loader(self.o_proj.bias, weights["o_proj.bias"])
            loaded.append("o_proj.bias")

        # The loaders sharded whole heads (rows head-major, (h, p, d)); the attention reads the pseudo-heads of a
        # token pseudo-major, (p, h, d): reorder this rank's rows (and o_proj's columns) in place.
        with torch.no_grad():
            for parameter in (self.qkv_proj.weight, self.qkv_proj.bias):
                if parameter is None:
                    continue
                q, k, v = parameter.data.split([self.q_size, self.kv_size, self.kv_size], dim=0)
                q.copy_(head_major_to_pseudo_major(q, 0, self.num_heads, num_pseudo))
                k.copy_(head_major_to_pseudo_major(k, 0, self.num_kv_heads, num_pseudo))
                v.copy_(head_major_to_pseudo_major(v, 0, self.num_kv_heads, num_pseudo))
            output_weight = self.o_proj.weight.data
            output_weight.copy_(head_major_to_pseudo_major(output_weight, 1, self.num_heads, num_pseudo))
        return loaded
