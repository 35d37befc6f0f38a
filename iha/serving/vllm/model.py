"""IHA (Interleaved Head Attention) Llama-family decoders on vLLM, loading the folders `iha-convert` and `iha sft`
write (config.json with model_type "iha", weights by their Hugging Face names).

vLLM's own Llama (`vllm/model_executor/models/llama.py`: `LlamaForCausalLM`, `LlamaModel`, `LlamaDecoderLayer`, its
MLP, norms, embeddings and `AutoWeightsLoader`) with one difference, the attention (`self_attention.IHAAttention`).
"""

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM

from .config_check import check_engine_config
from .self_attention import IHAAttention
from .updatable_weights import (
    engine_has_started,
    keep_linear_weights_unpacked,
    packs_weights_at_load,
    refuse_update_of_packed_weights,
    repack_output_embedding,
    updatable_weights_requested,
)


class IHADecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix, config=config, attn_layer_type=IHAAttention)


class IHAForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        # Checked before vLLM starts the engine (config_check.py); again here, for engines configured another way.
        check_engine_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=IHADecoderLayer)
        # A trainer's weight sync (TRL's GRPO with vLLM rollouts) on the CPU build: see updatable_weights.py.
        self.updatable_weights = packs_weights_at_load() and updatable_weights_requested()
        if self.updatable_weights:
            keep_linear_weights_unpacked(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors by their Hugging Face names, as Llama does; folded IHA layers fold theirs once a layer's set
        is complete. Called again after the engine started, it updates the weights in place (a trainer's sync)."""
        updating = packs_weights_at_load() and engine_has_started(self.lm_head)
        if updating and not self.updatable_weights:
            refuse_update_of_packed_weights()
        loaded = super().load_weights(weights)
        if updating and any(name.startswith(("lm_head.", "model.embed_tokens.")) for name in loaded):
            repack_output_embedding(self.lm_head)
        return loaded
