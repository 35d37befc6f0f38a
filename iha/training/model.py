"""Loading the model and tokenizer for SFT: an IHA checkpoint, or a Llama-style one converted on the fly; LoRA settings."""

import logging
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.distributed.fsdp import is_fsdp_enabled
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.utils import logging as transformers_logging

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from .. import IHA_MODEL_TYPES
from ..conversion import ConversionError, llama_to_iha, plan_conversion
from ..conversion.plan import IGNORED_SOURCE_SUFFIXES
from ..utils.model_source import check_model_source
from .chat_template import has_generation_markers, training_chat_template
from .config import DEFAULT_LORA_TARGET_MODULES, MIXING_MODULE_NAME


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Model and tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def resolve_model_source(model_name_or_path: str | os.PathLike) -> str:
    """An existing local folder as an absolute path (what outputs record, so they reload from any working
    directory); a Hub id unchanged; anything else one error (`check_model_source`: the folder does not exist)."""
    path = Path(check_model_source(model_name_or_path)).expanduser()
    return str(path.resolve()) if path.exists() else str(model_name_or_path)


def is_iha_model(model) -> bool:
    return getattr(model.config, "model_type", None) in IHA_MODEL_TYPES


def has_iha_layers(model) -> bool:
    return any(MIXING_MODULE_NAME in name.split(".") for name, _ in model.named_modules())


def _refuse_conversion_of_partitioned_weights(model_name_or_path: str):
    # Under ZeRO-3 init or FSDP's cpu-RAM-efficient loading, the weights of a freshly loaded model are partitioned or
    # live on rank 0 only: the converter would copy empty shards.

    if is_deepspeed_zero3_enabled() or is_fsdp_enabled():
        raise RuntimeError(
            f"{model_name_or_path} is not an IHA checkpoint, and under DeepSpeed ZeRO-3 or FSDP cpu-RAM-efficient "
            "loading it cannot be converted on the fly. Convert it first (`iha-convert SRC DST`) and train DST."
        )


def load_model_for_sft(
    model_name_or_path: str,
    convert_to_iha: bool = True,
    iha_options: dict | None = None,
    **from_pretrained_kwargs,
) -> tuple[PreTrainedModel, bool]:
    """Load an IHA checkpoint, or a Llama-style one converted to IHA (identity mixing: the same function).

    Returns `(model, converted)`. `from_pretrained_kwargs` go to `from_pretrained` (dtype, attn_implementation,
    revision, trust_remote_code, quantization_config); dtype defaults to float32 like TRL's. With a
    `quantization_config` (QLoRA) a Llama-style checkpoint is loaded quantized straight into the IHA model
    (`load_quantized_conversion`); the mixing is never quantized and stays fp32.
    """
    from_pretrained_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if v is not None}
    dtype = from_pretrained_kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype != "auto":
        from_pretrained_kwargs["dtype"] = getattr(torch, dtype)
    else:
        from_pretrained_kwargs["dtype"] = dtype
    config = AutoConfig.from_pretrained(
        model_name_or_path,
        revision=from_pretrained_kwargs.get("revision"),
        trust_remote_code=from_pretrained_kwargs.get("trust_remote_code", False),
    )
    if config.model_type not in IHA_MODEL_TYPES and convert_to_iha:
        _refuse_conversion_of_partitioned_weights(model_name_or_path)
        if from_pretrained_kwargs.get("quantization_config") is not None:
            return load_quantized_conversion(model_name_or_path, config, iha_options, **from_pretrained_kwargs), True
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **from_pretrained_kwargs)
    if config.model_type in IHA_MODEL_TYPES:
        if iha_options:
            logger.warning("%s is already an IHA model: iha_options %s are ignored.", model_name_or_path, iha_options)
        return model, False
    if not convert_to_iha:
        logger.warning("Training %s (%s) as is, without IHA layers.", model_name_or_path, config.model_type)
        return model, False

    logger.info("Converting %s (%s) to IHA with %s.", model_name_or_path, config.model_type, iha_options or {})
    # The loaded source model is dropped right after: let the IHA model take over its tensors instead of copying.
    return llama_to_iha(model, iha_options, share_weights=True), True


@contextmanager
def transformers_errors_only():
    """transformers' log at error level: its load report lists the mixing as newly initialised, which is intended."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def load_quantized_conversion(
    model_name_or_path: str, source_config, iha_options: dict | None, **from_pretrained_kwargs
):
    """A Llama-style checkpoint loaded quantized into the IHA model it converts to (QLoRA on the fly).

    A quantized model's packed weights cannot be copied into new layers (`llama_to_iha`), so the checkpoint is loaded
    with the converted config instead: every source tensor lands where the converter would put it, bitsandbytes
    quantizes the linear layers as they load, and the mixing (absent from the checkpoint) starts at identity in fp32.
    """

    plan = plan_conversion(source_config, iha_options)
    for change in plan.function_changes:
        logger.warning(f"This conversion changes what the model computes: {change}.")
    logger.info("Loading %s quantized into IHA with %s.", model_name_or_path, iha_options or {})
    with transformers_errors_only():
        model, loading = AutoModelForCausalLM.from_pretrained(
            model_name_or_path, config=plan.config, output_loading_info=True, **from_pretrained_kwargs
        )
    missing = sorted(name for name in loading["missing_keys"] if f".{MIXING_MODULE_NAME}." not in name)
    unexpected = sorted(name for name in loading["unexpected_keys"] if not name.endswith(IGNORED_SOURCE_SUFFIXES))
    if missing or unexpected or loading["mismatched_keys"]:
        raise ConversionError(
            f"{model_name_or_path}'s weights do not fit the IHA model: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}, mismatched {sorted(loading['mismatched_keys'])[:8]}."
        )
    return model


def prepare_tokenizer(tokenizer, assistant_only_loss: bool):
    """What training needs of a tokenizer (`IHASFTTrainer` calls it): `{% generation %}` markers when the loss is on
    assistant turns only, and a pad token.

    The marked template renders the same text (see `iha.training.chat_template`), so it is saved with the model and the
    output folder trains again with `trl sft --assistant_only_loss` as is.
    """
    if assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        tokenizer.chat_template = training_chat_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def iha_peft_config(model_args):
    """The LoRA config of TRL's `--use_peft` and `--lora_*` flags (TRL's `get_peft_config`; None without
    `--use_peft`), for IHA: every projection adapted unless `--lora_target_modules` says otherwise, and the mixing
    trained in full beside the adapters (`modules_to_save`), as `iha_lora_config` gives."""
    from trl import get_peft_config

    config = get_peft_config(model_args)
    if config is None:
        return None
    target_modules = model_args.lora_target_modules
    if target_modules is None:
        config.target_modules = set(DEFAULT_LORA_TARGET_MODULES)
    elif isinstance(target_modules, str) and target_modules.isidentifier():
        # TRL turns a one-item list into a string (for "all-linear"), which PEFT would read as a regex of full names.
        config.target_modules = {target_modules}
    if MIXING_MODULE_NAME not in (config.modules_to_save or []):
        config.modules_to_save = [*(config.modules_to_save or []), MIXING_MODULE_NAME]
    return config


def iha_lora_config(
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    target_modules: str | Sequence[str] | None = None,
    modules_to_save: Sequence[str] | None = None,
    train_mixing: bool = True,
    **lora_kwargs,
):
    """A LoRA config for IHA models: adapters on every projection, the mixing parameters trained in full.

    PEFT has no default targets for a new model type, hence the explicit list (`target_modules` also takes what
    PEFT does: "all-linear" or a regex of full module names). `train_mixing` adds `head_mixing` to
    `modules_to_save`, so the coefficients are trained, saved with the adapter and merged with it. `lora_kwargs` go
    to `peft.LoraConfig` as they are (`use_rslora`, `use_dora`, `task_type`, ...).
    """
    from peft import LoraConfig

    modules_to_save = list(modules_to_save or [])
    if train_mixing and MIXING_MODULE_NAME not in modules_to_save:
        modules_to_save.append(MIXING_MODULE_NAME)
    if target_modules is None:
        target_modules = DEFAULT_LORA_TARGET_MODULES
    return LoraConfig(
        **{"task_type": "CAUSAL_LM", "bias": "none", **lora_kwargs},
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        modules_to_save=modules_to_save or None,
    )
