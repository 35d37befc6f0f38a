"""IHA Gemma 3 text decoders on vLLM (config.json with model_type "iha_gemma3", as `iha-convert` writes a Gemma 3).

vLLM's own Gemma 3 (`vllm/model_executor/models/gemma3.py`): its MLP, its (1 + w) RMSNorms, the block of four norms
around attention and MLP (`Gemma3DecoderLayer.forward`), the embedding scaled by sqrt(hidden_size) and the model's
forward and weight loading (`Gemma3Model`), the causal LM (`Gemma3ForCausalLM`), with one difference, the attention:
`IHAGemma3Attention` is the plugin's `IHAAttention` with Gemma 3's scale (`query_pre_attn_scalar ** -0.5`), its per-head
(1 + w) norm of queries and keys before the mixing, and a RoPE per layer type (`rope_parameters["sliding_attention"]`,
`["full_attention"]`). The per-head norm keeps the mixing explicit (`support.folds_mixing`).

vLLM's Gemma 3 classes build their attention in their constructors, where a second attention layer under the same name
would clash in vLLM's registry of attention layers: the layer, model and causal LM below build the same parts
themselves, with the IHA attention, and keep vLLM's forward and loading code.
"""

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP, Gemma3Model
from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory, make_layers, maybe_prefix

from .config_check import check_engine_config
from .model import ServedIHAModel
from .self_attention import IHAAttention


class IHAGemma3Attention(IHAAttention):
    """`IHAAttention` with Gemma 3's scale, q/k norm and RoPE per layer type."""

    def output_bias(self, config) -> bool:
        return config.attention_bias

    def scaling(self, config) -> float:
        return config.query_pre_attn_scalar**-0.5

    def head_norms(self, config) -> tuple[GemmaRMSNorm, GemmaRMSNorm]:
        return GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps), GemmaRMSNorm(
            self.head_dim, eps=config.rms_norm_eps
        )

    def rotary_embedding(self, config, max_position_embeddings: int, layer_idx: int):
        # `layer_types` ("sliding_attention" or "full_attention", derived from `attention_types`) keys the RoPE base.
        max_position = max_position_embeddings * (self.num_pseudo_heads if self.virtual_positions else 1)
        return get_rope(
            self.head_dim,
            max_position=max_position,
            rope_parameters=config.rope_parameters[config.layer_types[layer_idx]],
            is_neox_style=True,
        )


class IHAGemma3DecoderLayer(Gemma3DecoderLayer):
    """vLLM's Gemma 3 block (its forward: four norms around attention and MLP) around `IHAGemma3Attention`."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "") -> None:
        nn.Module.__init__(self)  # not Gemma3DecoderLayer's: it would build Gemma 3's attention under this name
        self.hidden_size = config.hidden_size
        self.self_attn = IHAGemma3Attention(
            config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            quant_config=quant_config,
            bias=config.attention_bias,
            cache_config=cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Gemma3MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_activation=config.hidden_activation,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@support_torch_compile
class IHAGemma3Model(nn.Module):
    """vLLM's `Gemma3Model` (its embedding scale, forward and weight loading) over IHA Gemma 3 blocks."""

    hf_to_vllm_mapper = Gemma3Model.hf_to_vllm_mapper
    embed_input_ids = Gemma3Model.embed_input_ids
    forward = Gemma3Model.forward
    load_weights = Gemma3Model.load_weights

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=self.quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: IHAGemma3DecoderLayer(config, vllm_config.cache_config, self.quant_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # As vLLM's Gemma 3: sqrt(hidden_size), cast to the model's dtype where it multiplies the embeddings.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )


class IHAGemma3ForCausalLM(ServedIHAModel, Gemma3ForCausalLM):
    """vLLM's `Gemma3ForCausalLM` (its forward, logits and weight loading) over `IHAGemma3Model`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_engine_config(vllm_config)
        nn.Module.__init__(self)  # not Gemma3ForCausalLM's: it would build Gemma 3's own model
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = IHAGemma3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.allow_weight_updates()
