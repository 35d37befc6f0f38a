"""`IHASFTConfig`: TRL's `SFTConfig` plus the IHA training arguments (`iha.training.arguments`), and the names of the
mixing parameters."""

import logging
import re
from dataclasses import dataclass

from transformers.utils import is_torch_bf16_gpu_available
from trl import SFTConfig

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from .arguments import DEFAULT_LORA_TARGET_MODULES, IHATrainingArguments


logger = logging.getLogger(__name__)


# The submodule of every IHA layer that holds alpha_q / alpha_k / alpha_v / collapse. Under LoRA it is trained in
# full (a few thousand numbers per layer) through PEFT's `modules_to_save`.
MIXING_MODULE_NAME = "head_mixing"
# Matches the mixing parameters with or without wrappers in between: `...head_mixing.alpha_q` (plain or FSDP
# `use_orig_params`) and `...head_mixing.modules_to_save.default.alpha_q` (PEFT's trainable copy).
MIXING_PARAMETER_PATTERN = re.compile(rf"(?:^|\.){MIXING_MODULE_NAME}\.(?:.+\.)?(?:alpha_q|alpha_k|alpha_v|collapse)$")
# Written next to a LoRA adapter: how to rebuild the base model it was trained on (see `load_sft_output`).
BASE_RECORD_NAME = "iha_sft_base.json"


def is_mixing_parameter(name: str) -> bool:
    """Whether a parameter name is an IHA mixing coefficient or collapse weight."""
    return MIXING_PARAMETER_PATTERN.search(name) is not None


# ---------------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------------


def bf16_supported_here(use_cpu: bool = False) -> bool:
    """Whether `TrainingArguments(bf16=True)` can train here: on CPU when asked for (`use_cpu`, bf16 autocast), or
    on an accelerator with bf16 (Ampere or newer NVIDIA GPU, XPU, NPU, ...)."""

    return use_cpu or is_torch_bf16_gpu_available()


@dataclass
class IHASFTConfig(IHATrainingArguments, SFTConfig):
    r"""TRL's `SFTConfig` plus the optimizer settings of the IHA mixing parameters.

    mixing_learning_rate (`float`, *optional*):
        Peak learning rate of `head_mixing.{alpha_q, alpha_k, alpha_v, collapse}`. They follow the same schedule as
        the other weights. Defaults to `learning_rate`. The mixing coefficients start at identity in a converted
        checkpoint and are few, so a larger rate than the pretrained weights' (10-100x) lets them move in a short SFT.
    mixing_weight_decay (`float`, defaults to `0.0`):
        Weight decay of the mixing parameters. Decay pulls them towards zero, not towards the identity they start
        from, so it is off by default.
    assistant_only_loss (`bool`, defaults to `True` here):
        Train on the assistant turns only (TRL's default is `False`). The chat template gets `{% generation %}`
        markers where it lacks them (`iha.training.chat_template.training_chat_template`).
    bf16 (`bool`, *optional*):
        bf16 mixed precision. When not set it follows the hardware: on (TRL's default) wherever it can train, i.e.
        on an accelerator with bf16 (Ampere or newer NVIDIA GPU, XPU, NPU, ...) or with `use_cpu` (CPU autocast);
        off (fp32) where TRL's default would stop with "Your setup doesn't support bf16/gpu": a machine without
        such an accelerator and without `use_cpu`. `--bf16 true|false` decides.
    """

    def __post_init__(self):
        if self.bf16 is None and not self.fp16:
            self.bf16 = bf16_supported_here(self.use_cpu)
        # TRL sets gradient checkpointing under transformers' old name (`gradient_checkpointing`, default True), which
        # transformers >= 5.20 warns about in every run: hand the value to the current name where it exists.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing, self.gradient_checkpointing = self.gradient_checkpointing, None
        super().__post_init__()


__all__ = [
    "BASE_RECORD_NAME",
    "DEFAULT_LORA_TARGET_MODULES",
    "MIXING_MODULE_NAME",
    "MIXING_PARAMETER_PATTERN",
    "IHASFTConfig",
    "bf16_supported_here",
    "is_mixing_parameter",
]
