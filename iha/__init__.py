"""Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers.

Importing this package registers `IHAConfig`, `IHAModel` and `IHAForCausalLM` with the Auto classes, and marks
them so that `save_pretrained` writes `auto_map` and copies the three code files next to the weights (a folder
then loads with `trust_remote_code=True` in a process that never imports `iha`).

The one exception is a console script (`iha`, `iha-convert`, `iha-sft`, `iha-eval`, all in `iha_cli.py`): the
registration imports torch and transformers, seconds that `--help` should not wait for, so the script defers it
and the `iha` dispatcher calls `register_auto_classes()` once the command line is parsed, before the command runs.
The model classes are imported on first use either way (`from iha import IHAConfig`).
"""

import sys

from .lazy_imports import lazy_attributes


__version__ = "0.1.0"

# Public name -> the module that defines it, imported on first use.
_EXPORTS = {
    "IHAConfig": "configuration_iha",
    "paper_hybrid_layout": "configuration_iha",
    "IHAForCausalLM": "modeling_iha",
    "IHAHeadMixing": "modeling_iha",
    "IHAModel": "modeling_iha",
    "IHAPreTrainedModel": "modeling_iha",
}


def register_auto_classes() -> None:
    """Register the IHA classes with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (model type "iha"), and
    mark them so that `save_pretrained` writes `auto_map` and the code files. Safe to call again."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_iha import IHAConfig
    from .modeling_iha import IHAForCausalLM, IHAModel

    global _registration_pending
    _registration_pending = False
    AutoConfig.register("iha", IHAConfig, exist_ok=True)
    AutoModel.register(IHAConfig, IHAModel, exist_ok=True)
    AutoModelForCausalLM.register(IHAConfig, IHAForCausalLM, exist_ok=True)

    IHAConfig.register_for_auto_class()
    IHAModel.register_for_auto_class("AutoModel")
    IHAForCausalLM.register_for_auto_class("AutoModelForCausalLM")


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
    "IHAConfig",
    "IHAForCausalLM",
    "IHAHeadMixing",
    "IHAModel",
    "IHAPreTrainedModel",
    "paper_hybrid_layout",
    "register_auto_classes",
]
