"""The parsed configs of an SFT run, TRL's with the IHA arguments (`iha.training.arguments`) added: `IHASFTConfig`
(TRL's `SFTConfig`), `IHAModelConfig` (TRL's `ModelConfig`) and `IHAScriptArguments` (TRL's `ScriptArguments`), the
three `train_sft` takes as TRL's `scripts/sft.py` takes its own; and the names of the mixing parameters."""

import logging
import re
from dataclasses import asdict, dataclass, fields

from transformers.utils import is_torch_bf16_gpu_available
from trl import ModelConfig, ScriptArguments, SFTConfig

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..conversion import IHAConversionOptions
from .arguments import DEFAULT_LORA_TARGET_MODULES, IHADataArguments, IHAModelArguments, IHATrainingArguments


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

    _argument_group_name = "training"  # the group of `iha-sft --help` its flags are listed in

    def __post_init__(self):
        if self.bf16 is None and not self.fp16:
            self.bf16 = bf16_supported_here(self.use_cpu)
        # TRL sets gradient checkpointing under transformers' old name (`gradient_checkpointing`, default True), which
        # transformers >= 5.20 warns about in every run: hand the value to the current name where it exists.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing, self.gradient_checkpointing = self.gradient_checkpointing, None
        super().__post_init__()


@dataclass
class IHAModelConfig(IHAModelArguments, ModelConfig):
    r"""TRL's `ModelConfig` (the model, `dtype`, `attn_implementation`, the LoRA and quantization settings) plus the
    IHA conversion settings, the tokenizer and the merge of a LoRA output (`IHAModelArguments`).

    iha_options (`dict` or `str`, *optional*):
        The settings of the conversion on the fly (`iha.conversion.IHAConversionOptions`): a dict, or its JSON text
        (`--iha_options '{"num_pseudo_heads": 2}'`), read into a dict here; an unknown setting is refused.
    load_in_4bit / load_in_8bit:
        A quantized base is frozen: they need `use_peft` (QLoRA; the mixing is trained in full beside the adapters).
    """

    _argument_group_name = "model"  # the group of `iha-sft --help` its flags are listed in

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.iha_options, str):
            self.iha_options = asdict(IHAConversionOptions.from_json(self.iha_options))
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_peft:
            raise ValueError(
                "--load_in_4bit / --load_in_8bit freeze the base in a quantized form: train LoRA adapters on it "
                "with --use_peft (the IHA mixing is trained in full beside them)."
            )


@dataclass
class IHAScriptArguments(IHADataArguments, ScriptArguments):
    """TRL's `ScriptArguments` (`dataset_name`, `dataset_config`, the train and test splits) plus how the rows are
    read (`IHADataArguments`: the evaluation rows, a default system prompt, the first N rows, the length filter)."""

    _argument_group_name = "data"  # the group of `iha-sft --help` its flags are listed in

    def __post_init__(self):
        if self.dataset_streaming:
            raise ValueError(
                "--dataset_streaming is not supported: iha-sft reads the rows first to check their schema and drop "
                "those longer than --max_length; use --max_train_rows N to train on the first N rows."
            )
        if self.ignore_bias_buffers:
            raise ValueError(
                "--ignore_bias_buffers has no effect in iha-sft (TRL reads it in its DDP preference scripts)."
            )


def as_iha_config(config, iha_class: type):
    """`config` as `iha_class` (`IHAModelConfig` or `IHAScriptArguments`): TRL's own `ModelConfig` /
    `ScriptArguments` are taken with the IHA settings at their defaults."""
    if isinstance(config, iha_class):
        return config
    trl_class = iha_class.__bases__[-1]  # the IHA arguments first, TRL's class last
    if not isinstance(config, trl_class):
        raise TypeError(
            f"Expected an {iha_class.__name__} (or TRL's {trl_class.__name__}), got {type(config).__name__}. "
            "train_sft takes the parsed configs as TRL's scripts/sft.py does: "
            "train_sft(IHAScriptArguments(dataset_name=...), IHASFTConfig(...), IHAModelConfig(model_name_or_path=...)); "
            "a model or rows in memory go in as model= / train_dataset=."
        )
    return iha_class(**{field.name: getattr(config, field.name) for field in fields(trl_class)})


__all__ = [
    "BASE_RECORD_NAME",
    "DEFAULT_LORA_TARGET_MODULES",
    "MIXING_MODULE_NAME",
    "MIXING_PARAMETER_PATTERN",
    "IHAModelConfig",
    "IHASFTConfig",
    "IHAScriptArguments",
    "as_iha_config",
    "bf16_supported_here",
    "is_mixing_parameter",
]
