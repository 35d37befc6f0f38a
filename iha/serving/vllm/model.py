"""IHA (Interleaved Head Attention) Llama-family decoders on vLLM, loading the folders `iha-convert` and `iha sft`
write (config.json with model_type "iha", weights by their Hugging Face names).

Built like vLLM's Llama (`vllm/model_executor/models/llama.py`): the same parallel linear layers, RMSNorm, MLP and
RoPE; IHA layers differ only in their attention:

- **Projections.** The head mixing is linear, so it is folded into the projections when the weights load
  (`folding.py`): `qkv_proj` has P * d rows per head (the P pseudo-heads of that head) and `o_proj` P * d columns per
  head (the collapse). The layer then runs no mixing at all, and tensor parallelism shards the folded projections by
  KV group exactly like Llama's. Qwen3's per-head q/k norm comes between the projection and the mixing and is not
  linear: those layers keep the explicit mixing (`IHAHeadMixing`), as does `hf_overrides={"iha_fold_mixing": False}`.
- **Positions.** RoPE rotates the mixed queries and keys, pseudo-token (n, p) at position n ("shared") or n * P + p
  ("virtual"): a rotation commutes with mixing across heads, so this is the reference's rotation before the mixing.
- **Attention.** One stock paged-attention call over the interleaved sequence (`attention.py`), which is the flat
  causal mask; the cache holds the P mixed pseudo-streams of every KV head.

Standard layers among IHA ones ("full_attention", "sliding_attention") are Llama's attention unchanged.
"""

from collections.abc import Iterable
from itertools import islice

import torch
import vllm
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from .attention import iha_attention_backend
from .folding import fold_collapse_into_output, fold_mixing_into_projection, head_major_to_pseudo_major
from .support import (
    IHA_FULL,
    STANDARD_SLIDING,
    UnsupportedByVLLMError,
    check_servable,
    check_vllm_release,
    folds_mixing,
)
from .updatable_weights import (
    engine_has_started,
    keep_linear_weights_unpacked,
    packs_weights_at_load,
    refuse_update_of_packed_weights,
    repack_output_embedding,
    updatable_weights_requested,
)


class IHAHeadMixing(nn.Module):
    """The explicit head mixing of an IHA layer whose mixing does not fold (per-head q/k norm), with the folder's
    parameters: `alpha_q` [H, H, P], `alpha_k` and `alpha_v` [H_kv, H_kv, P], `collapse` [H, P] or [H, H, P].

    Kept in fp32 like the folder stores them; cast to the activations' dtype where used, as the reference does.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, num_pseudo_heads: int, collapse_mode: str):
        super().__init__()
        self.num_pseudo_heads = num_pseudo_heads
        kv_shape = (num_kv_heads, num_kv_heads, num_pseudo_heads)
        query_shape = (num_heads, num_heads, num_pseudo_heads)
        collapse_shape = (num_heads, num_pseudo_heads) if collapse_mode == "per_head" else query_shape
        self.alpha_q = nn.Parameter(torch.empty(query_shape, dtype=torch.float32), requires_grad=False)
        self.alpha_k = nn.Parameter(torch.empty(kv_shape, dtype=torch.float32), requires_grad=False)
        self.alpha_v = nn.Parameter(torch.empty(kv_shape, dtype=torch.float32), requires_grad=False)
        self.collapse = nn.Parameter(torch.empty(collapse_shape, dtype=torch.float32), requires_grad=False)

    @staticmethod
    def mix(states: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """[tokens, M * d] head states -> [tokens, P * H * d] pseudo-heads, pseudo-major: `out[n, p, h] =
        sum_m alpha[m, h, p] * states[n, m]` (one [P * H, M] @ [M, d] product per token)."""
        num_sources, num_targets, num_pseudo_heads = alpha.shape
        mixing_matrix = alpha.permute(2, 1, 0).reshape(num_pseudo_heads * num_targets, num_sources)
        mixed = torch.matmul(mixing_matrix.to(states.dtype), states.reshape(states.shape[0], num_sources, -1))
        return mixed.flatten(1)

    def collapse_heads(self, pseudo_outputs: torch.Tensor) -> torch.Tensor:
        """[tokens, P * H * d] pseudo-outputs (pseudo-major) -> [tokens, H * d]."""
        num_tokens = pseudo_outputs.shape[0]
        collapse = self.collapse.to(pseudo_outputs.dtype)
        num_heads = collapse.shape[0]
        pseudo = pseudo_outputs.view(num_tokens, self.num_pseudo_heads, num_heads, -1)
        if collapse.dim() == 2:  # per head: out[n, h] = sum_p R[h, p] * o[n, p, h]
            return (pseudo * collapse.t()[None, :, :, None]).sum(dim=1).flatten(1)
        # global: out[n, h] = sum_(p, m) R[h, m, p] * o[n, p, m]
        collapse_matrix = collapse.permute(0, 2, 1).reshape(num_heads, self.num_pseudo_heads * num_heads)
        return torch.matmul(collapse_matrix, pseudo.flatten(1, 2)).flatten(1)


class IHAAttention(nn.Module):
    """Attention of one layer: IHA on IHA layers, Llama's attention on standard ones."""

    def __init__(
        self,
        config,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        attention_type = config.attention_types[layer_idx]
        self.is_iha = attention_type == IHA_FULL
        self.fold_mixing = self.is_iha and folds_mixing(config)
        self.num_pseudo_heads = config.num_pseudo_heads if self.is_iha else 1
        self.hidden_size = config.hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = config.num_key_value_heads
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads

        # A folded IHA layer projects every head straight to its P pseudo-heads: P * d rows per head.
        projection_head_size = self.head_dim * (self.num_pseudo_heads if self.fold_mixing else 1)
        self.q_size = self.num_heads * projection_head_size
        self.kv_size = self.num_kv_heads * projection_head_size
        self.qkv_proj = QKVParallelLinear(
            hidden_size=config.hidden_size,
            head_size=projection_head_size,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=config.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * projection_head_size,
            output_size=config.hidden_size,
            bias=config.o_proj_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        # Qwen3's per-head norm of queries and keys, before RoPE and before the mixing.
        self.q_norm = self.k_norm = None
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.head_mixing = None
        if self.is_iha and not self.fold_mixing:
            self.head_mixing = IHAHeadMixing(
                self.total_num_heads, self.total_num_kv_heads, self.num_pseudo_heads, config.iha_collapse_mode
            )

        self.virtual_positions = self.is_iha and config.iha_position_mode == "virtual"
        self.rotary_emb = None
        if config.no_rope_layers[layer_idx]:  # SmolLM3's NoPE layers have no positional encoding
            max_position = config.max_position_embeddings * (self.num_pseudo_heads if self.virtual_positions else 1)
            self.rotary_emb = get_rope(
                self.head_dim, max_position=max_position, rope_parameters=config.rope_parameters, is_neox_style=True
            )
        self.register_buffer("pseudo_offsets", torch.arange(self.num_pseudo_heads), persistent=False)

        if self.is_iha:
            # Head size P * d for the KV-cache spec (the P pseudo-streams of every KV head); the backend attends
            # with head size d over the interleaved sequence.
            self.attn = Attention(
                self.num_heads,
                self.num_pseudo_heads * self.head_dim,
                self.head_dim**-0.5,
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.attn",
                attn_backend=iha_attention_backend(),
                num_pseudo_heads=self.num_pseudo_heads,
            )
        else:
            self.attn = Attention(
                self.num_heads,
                self.head_dim,
                self.head_dim**-0.5,
                num_kv_heads=self.num_kv_heads,
                cache_config=cache_config,
                quant_config=quant_config,
                per_layer_sliding_window=config.sliding_window if attention_type == STANDARD_SLIDING else None,
                prefix=f"{prefix}.attn",
            )

        # Folded layers take their checkpoint tensors here until the layer's set is complete (`take_unfolded`).
        self.unfolded_weights: dict[str, torch.Tensor] = {}

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
            q = self.head_mixing.mix(q, self.head_mixing.alpha_q)
            k = self.head_mixing.mix(k, self.head_mixing.alpha_k)
            v = self.head_mixing.mix(v, self.head_mixing.alpha_v)
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

    # --- folded layers: the checkpoint's projections and mixing, folded when they are all there -------------------

    def unfolded_names(self) -> list[str]:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        names += [f"head_mixing.{name}" for name in ("alpha_q", "alpha_k", "alpha_v", "collapse")]
        if self.qkv_proj.bias is not None:
            names += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if self.o_proj.bias is not None:
            names.append("o_proj.bias")
        return names

    def take_unfolded(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Keep one checkpoint tensor (`name` relative to this module); once the layer has them all, fold and load
        them. Returns the names (relative) of the parameters it loaded: none until the set is complete.

        A later call with a complete set (a trainer syncing new weights) folds and loads the layer again.
        """
        if name not in self.unfolded_names():
            raise UnsupportedByVLLMError(f"Unexpected checkpoint tensor {name!r} for a folded IHA attention layer.")
        self.unfolded_weights[name] = tensor
        if any(needed not in self.unfolded_weights for needed in self.unfolded_names()):
            return []
        weights, self.unfolded_weights = self.unfolded_weights, {}
        return self.load_folded(weights)

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


class IHADecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = IHAAttention(
            config, cache_config=vllm_config.cache_config, quant_config=quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0})
class IHAModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        if get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: IHADecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        if get_pp_group().is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class IHAForCausalLM(nn.Module, SupportsPP):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_vllm_release(vllm.__version__)
        check_servable(
            config,
            tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            pipeline_parallel_size=vllm_config.parallel_config.pipeline_parallel_size,
            device_type=current_platform.device_type,
            dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
            decode_context_parallel_size=vllm_config.parallel_config.decode_context_parallel_size,
            prefill_context_parallel_size=vllm_config.parallel_config.prefill_context_parallel_size,
        )
        if vllm_config.cache_config.cache_dtype != "auto":
            raise UnsupportedByVLLMError(
                f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} is not served for IHA models (untested with "
                "the virtual view of the pages): leave it 'auto'."
            )
        self.config = config
        self.model = IHAModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # A trainer's weight sync (TRL's GRPO with vLLM rollouts) on the CPU build: see updatable_weights.py.
        self.updatable_weights = packs_weights_at_load() and updatable_weights_requested()
        if self.updatable_weights:
            keep_linear_weights_unpacked(self)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors by their Hugging Face names; folded IHA layers fold theirs once a layer's set is complete."""
        stacked_params = [
            # (parameter, checkpoint name, shard)
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]
        updating = packs_weights_at_load() and engine_has_started(self.lm_head)
        if updating and not self.updatable_weights:
            refuse_update_of_packed_weights()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the embedding's weight
            if is_pp_missing_parameter(name, self):
                continue
            attention_prefix, _, attention_name = name.partition(".self_attn.")
            if attention_name:
                attention = self.get_submodule(f"{attention_prefix}.self_attn")
                if attention.fold_mixing:
                    taken = attention.take_unfolded(attention_name, loaded_weight)
                    loaded.update(f"{attention_prefix}.self_attn.{parameter}" for parameter in taken)
                    continue
            for param_name, weight_name, shard_id in stacked_params:
                if weight_name not in name:
                    continue
                param = params[name.replace(weight_name, param_name)]
                param.weight_loader(param, loaded_weight, shard_id)
                loaded.add(name.replace(weight_name, param_name))
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
                loaded.add(name)
        if updating and any(name.startswith(("lm_head.", "model.embed_tokens.")) for name in loaded):
            repack_output_embedding(self.lm_head)
        return loaded
