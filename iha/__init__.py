"""Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers.

Importing this package registers the IHA model types with the Auto classes: `iha` (`IHAConfig`, `IHAModel`,
`IHAForCausalLM`: Llama-family blocks, also Qwen2/3, Mistral and SmolLM3) and `iha_gemma3` (`IHAGemma3Config`,
`IHAGemma3TextModel`, `IHAGemma3ForCausalLM`: Gemma 3's block). It marks them so that `save_pretrained` writes
`auto_map` and copies the code files next to the weights (a folder then loads with `trust_remote_code=True` in a
process that never imports `iha`).

It also registers IHA's exact fast paths with transformers' attention registries (`iha.attention`): a folder loaded
without the package is correct and only slower. The model classes are importable from here (`from iha import
IHAConfig`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .attention import register_attention_paths
from .models.iha import (
    IHAConfig,
    IHAForCausalLM,
    IHAGemma3Config,
    IHAGemma3ForCausalLM,
    IHAGemma3TextModel,
    IHAHeadMixing,
    IHAModel,
    IHAPreTrainedModel,
    paper_hybrid_layout,
)


__version__ = "0.1.0"

# The model_type of every IHA config class, each registered by `register_auto_classes`.
IHA_MODEL_TYPES = ("iha", "iha_gemma3")


def register_auto_classes() -> None:
    """Register the IHA classes with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (model types "iha" and
    "iha_gemma3"), and mark them so that `save_pretrained` writes `auto_map` and the code files. Safe to call again."""
    for config_class, model_class, causal_lm_class in (
        (IHAConfig, IHAModel, IHAForCausalLM),
        (IHAGemma3Config, IHAGemma3TextModel, IHAGemma3ForCausalLM),
    ):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
        config_class.register_for_auto_class()
        model_class.register_for_auto_class("AutoModel")
        causal_lm_class.register_for_auto_class("AutoModelForCausalLM")


register_auto_classes()
# IHA's exact fast paths (blocked sliding windows, packed documents, continuous batching), by name in transformers'
# registries: the model files find them there, and run transformers' own functions where the package is absent.
register_attention_paths()


__all__ = [
    "IHA_MODEL_TYPES",
    "IHAConfig",
    "IHAForCausalLM",
    "IHAGemma3Config",
    "IHAGemma3ForCausalLM",
    "IHAGemma3TextModel",
    "IHAHeadMixing",
    "IHAModel",
    "IHAPreTrainedModel",
    "paper_hybrid_layout",
    "register_attention_paths",
    "register_auto_classes",
]
