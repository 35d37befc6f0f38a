"""Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers.

Importing this package registers the IHA model types with the Auto classes: `iha` (`IHAConfig`, `IHAModel`,
`IHAForCausalLM`: Llama-family blocks, also Qwen2/3, Mistral and SmolLM3) and `iha_gemma3` (`IHAGemma3Config`,
`IHAGemma3TextModel`, `IHAGemma3ForCausalLM`: Gemma 3's block). It marks them so that `save_pretrained` writes
`auto_map` and copies the code files next to the weights (a folder then loads with `trust_remote_code=True` in a
process that never imports `iha`).

The one exception is a console script (`iha`, `iha-convert`, `iha-sft`, `iha-eval`, all in `iha_cli.py`): the
registration imports torch and transformers, seconds that `--help` should not wait for, so the script defers it
and the `iha` dispatcher calls `register_auto_classes()` once the command line is parsed, before the command runs.
The model classes are imported on first use either way (`from iha import IHAConfig`).
"""

import sys

from .lazy_imports import lazy_attributes


__version__ = "0.1.0"

# The model_type of every IHA config class, each registered by `register_auto_classes`.
IHA_MODEL_TYPES = ("iha", "iha_gemma3")

# Public name -> the module that defines it, imported on first use.
_EXPORTS = {
    "IHAConfig": "configuration_iha",
    "paper_hybrid_layout": "configuration_iha",
    "IHAForCausalLM": "modeling_iha",
    "IHAHeadMixing": "modeling_iha",
    "IHAModel": "modeling_iha",
    "IHAPreTrainedModel": "modeling_iha",
    "IHAGemma3Config": "configuration_iha_gemma3",
    "IHAGemma3ForCausalLM": "modeling_iha_gemma3",
    "IHAGemma3TextModel": "modeling_iha_gemma3",
}


def register_auto_classes() -> None:
    """Register the IHA classes with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (model types "iha" and
    "iha_gemma3"), and mark them so that `save_pretrained` writes `auto_map` and the code files. Safe to call again."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_iha import IHAConfig
    from .configuration_iha_gemma3 import IHAGemma3Config
    from .modeling_iha import IHAForCausalLM, IHAModel
    from .modeling_iha_gemma3 import IHAGemma3ForCausalLM, IHAGemma3TextModel

    global _registration_pending
    _registration_pending = False
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


_lazy_getattr, __dir__ = lazy_attributes(__name__, _EXPORTS)


def __getattr__(name: str):
    # A console script called in-process (a notebook, a test) may stop before registering (`--help`, a bad flag):
    # the first use of an IHA class registers then.
    if _registration_pending and name in _EXPORTS:
        register_auto_classes()
    return _lazy_getattr(name)


# A console script of `iha_cli` marks its own module (never the environment: `accelerate launch` and every other
# child process imports this package afresh and registers here).
_registration_pending = True
if not getattr(sys.modules.get("iha_cli"), "registration_deferred", False):
    register_auto_classes()


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
    "register_auto_classes",
]
