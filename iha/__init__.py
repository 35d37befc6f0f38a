"""Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers.

Importing this package registers `IHAConfig`, `IHAModel` and `IHAForCausalLM` with the Auto classes, and marks
them so that `save_pretrained` writes `auto_map` and copies the three code files next to the weights (a folder
then loads with `trust_remote_code=True` in a process that never imports `iha`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_iha import IHAConfig, paper_hybrid_layout
from .modeling_iha import IHAForCausalLM, IHAHeadMixing, IHAModel, IHAPreTrainedModel


__version__ = "0.1.0"

AutoConfig.register("iha", IHAConfig, exist_ok=True)
AutoModel.register(IHAConfig, IHAModel, exist_ok=True)
AutoModelForCausalLM.register(IHAConfig, IHAForCausalLM, exist_ok=True)

IHAConfig.register_for_auto_class()
IHAModel.register_for_auto_class("AutoModel")
IHAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "IHAConfig",
    "IHAForCausalLM",
    "IHAHeadMixing",
    "IHAModel",
    "IHAPreTrainedModel",
    "paper_hybrid_layout",
]
