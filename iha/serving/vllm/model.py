"""IHA (Interleaved Head Attention) Llama-family decoders on vLLM, loading the folders `iha-convert` and `iha sft`
write (config.json with model_type "iha", weights by their Hugging Face names).

vLLM's own Llama (`vllm/model_executor/models/llama.py`: `LlamaForCausalLM`, `LlamaModel`, `LlamaDecoderLayer`, its
MLP, norms, embeddings and `AutoWeightsLoader`) with one difference, the attention (`self_attention.IHAAttention`).
What every served IHA model adds to vLLM's class (the config check, weight updates) is `ServedIHAModel`; Gemma 3's
block is `gemma3.py`.
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


class ServedIHAModel:
    """What the plugin adds to a vLLM causal-LM class (first in its bases): weights a trainer may update in place.
    The class's constructor checks the engine's settings first (`check_engine_config`: vLLM checked them before the
    engine started, config_check.py; again here, for engines configured another way) and calls
    `allow_weight_updates` last."""

    def allow_weight_updates(self) -> None:
        # A trainer's weight sync (TRL's GRPO with vLLM rollouts) on the CPU build: see updatable_weights.py.
        self.updatable_weights = packs_weights_at_load() and updatable_weights_requested()
        if self.updatable_weights:
            keep_linear_weights_unpacked(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors by their Hugging Face names, as vLLM's class does; folded IHA layers fold theirs once a layer's
        set is complete. Called again after the engine started, it updates the weights in place (a trainer's sync)."""
        updating = packs_weights_at_load() and engine_has_started(self.lm_head)
        if updating and not self.updatable_weights:
            refuse_update_of_packed_weights()
        loaded = super().load_weights(weights)
        if updating and any(name.startswith(("lm_head.", "model.embed_tokens.")) for name in loaded):
            repack_output_embedding(self.lm_head)
        return loaded


class IHADecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix, config=config, attn_layer_type=IHAAttention)


class IHAForCausalLM(ServedIHAModel, LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_engine_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=IHADecoderLayer)
        self.allow_weight_updates()
