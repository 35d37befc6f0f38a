"""Interleaved Head Attention in transformers: the remote-code folder.

Every module here but this one and `naive_iha` is copied next to the weights of a converted or fine-tuned model
(`iha.conversion.writers.code_files`), so that the folder loads with `trust_remote_code=True` where the package was
never installed: those files import only torch, transformers and each other (single-dot imports), a rule
`tests/models/iha/test_remote_code.py` enforces. `naive_iha` is the plain reference every path is tested against.
"""

from .configuration_iha import IHAConfig
from .configuration_iha_gemma3 import IHAGemma3Config
from .layer_iha import IHALayerSpec, paper_hybrid_layout
from .modeling_iha import IHAForCausalLM, IHAHeadMixing, IHAModel, IHAPreTrainedModel
from .modeling_iha_gemma3 import IHAGemma3ForCausalLM, IHAGemma3TextModel


__all__ = [
    "IHAConfig",
    "IHAForCausalLM",
    "IHAGemma3Config",
    "IHAGemma3ForCausalLM",
    "IHAGemma3TextModel",
    "IHAHeadMixing",
    "IHALayerSpec",
    "IHAModel",
    "IHAPreTrainedModel",
    "paper_hybrid_layout",
]
