# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""OpenThoughts-style reasoning SFT of IHA models with TRL: full fine-tuning or LoRA, one process or several.

Python:

```python
>>> from iha.sft import IHASFTConfig, iha_lora_config, train_sft
>>> args = IHASFTConfig(output_dir="smollm2-iha-sft", max_length=4096, packing=True, mixing_learning_rate=1e-3)
>>> trainer = train_sft("HuggingFaceTB/SmolLM2-135M-Instruct", "open-thoughts/OpenThoughts-114k", args,
...                     iha_options={"num_pseudo_heads": 2})            # a Llama checkpoint is converted on the fly
>>> trainer = train_sft("my-iha-model", "data.jsonl", args, peft_config=iha_lora_config(r=16))   # LoRA
```

Command line (the flags of TRL's `SFTConfig`, plus the model and data arguments below):

```bash
iha-sft --model_name_or_path my-iha-model --dataset_name open-thoughts/OpenThoughts-114k \
    --output_dir out --max_length 4096 --packing --learning_rate 2e-5 --mixing_learning_rate 1e-3
accelerate launch --config_file examples/accelerate/fsdp.yaml -m iha.sft ...   # several processes
```
"""

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, PreTrainedModel
from trl import SFTConfig, SFTTrainer

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from .atomic_files import write_json_atomic
from .atomic_folders import run_command, staged_folder
from .chat_templates import has_generation_markers, training_chat_template
from .convert import ConversionError, IHAConversionOptions
from .data import filter_by_length, load_sft_dataset


logger = logging.getLogger(__name__)

# Every Llama-family projection. Attention and MLP adapters are what OpenThoughts-style LoRA recipes train; the
# embeddings and the LM head stay frozen (TRL's fused LM head cannot train an adapter on `lm_head` anyway).
DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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
    from transformers.utils import is_torch_bf16_gpu_available

    return use_cpu or is_torch_bf16_gpu_available()


@dataclass
class IHASFTConfig(SFTConfig):
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
        markers where it lacks them (`iha.chat_templates.training_chat_template`).
    bf16 (`bool`, *optional*):
        bf16 mixed precision. When not set it follows the hardware: on (TRL's default) wherever it can train, i.e.
        on an accelerator with bf16 (Ampere or newer NVIDIA GPU, XPU, NPU, ...) or with `use_cpu` (CPU autocast);
        off (fp32) where TRL's default would stop with "Your setup doesn't support bf16/gpu": a machine without
        such an accelerator and without `use_cpu`. `--bf16 true|false` decides.
    """

    mixing_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the IHA mixing coefficients and collapse weights (default: learning_rate)."
        },
    )
    mixing_weight_decay: float = field(
        default=0.0,
        metadata={"help": "Weight decay of the IHA mixing parameters (decay pulls them to zero, not to identity)."},
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the loss on the assistant turns only (needs {%% generation %%} markers, added here)."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Not set: on (TRL's default) on a bf16-capable GPU/XPU/NPU or with "
            "--use_cpu true; off where TRL's default would fail (no such accelerator, no --use_cpu)."
        },
    )

    def __post_init__(self):
        if self.bf16 is None and not self.fp16:
            self.bf16 = bf16_supported_here(self.use_cpu)
        super().__post_init__()


@dataclass
class ModelArguments:
    """Which model to fine-tune and how. Names match TRL's `ModelConfig` where they overlap."""

    model_name_or_path: str = field(metadata={"help": "IHA checkpoint, or a Llama-style one to convert on the fly."})
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision of the model."})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Dtype to load the weights in.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager, flash_attention_2, ..."})
    convert_to_iha: bool = field(
        default=True,
        metadata={"help": "Convert a non-IHA (Llama-style) checkpoint to IHA before training. False trains it as is."},
    )
    iha_options: str | None = field(
        default=None,
        metadata={"help": "JSON object of iha.convert.IHAConversionOptions, e.g. '{\"num_pseudo_heads\": 2}'."},
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": f"LoRA target modules (default: {' '.join(DEFAULT_LORA_TARGET_MODULES)})."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules trained in full under LoRA (head_mixing is always added)."}
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "After LoRA training, also write the merged full model to <output_dir>/merged."},
    )


@dataclass
class DataArguments:
    """Which rows to train on. Any schema of `iha.data` (OpenThoughts-114k, OpenThoughts3, messages, prompt/completion)."""

    dataset_name: str = field(metadata={"help": "Hub dataset id, or a local .json / .jsonl / .parquet file or folder."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on (Hub datasets)."})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Evaluation rows (Hub id or local file)."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name to evaluate on."})
    default_system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System prompt for rows that have none; 'openthoughts' means the OpenThoughts-114k prompt "
            "(useful for OpenThoughts3, which has no system column)."
        },
    )
    max_train_rows: int | None = field(default=None, metadata={"help": "Use only the first N rows."})
    filter_long_rows: bool = field(
        default=True,
        metadata={"help": "Drop rows longer than max_length tokens instead of truncating their reasoning."},
    )


# ---------------------------------------------------------------------------------------------------------------------
# Model and tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def resolve_model_source(model_name_or_path: str | os.PathLike) -> str:
    """An existing local folder as an absolute path (what outputs record, so they reload from any working
    directory); anything else, a Hub id, unchanged."""
    path = Path(model_name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else str(model_name_or_path)


def is_iha_model(model) -> bool:
    return getattr(model.config, "model_type", None) == "iha"


def has_iha_layers(model) -> bool:
    return any(MIXING_MODULE_NAME in name.split(".") for name, _ in model.named_modules())


def _refuse_conversion_of_partitioned_weights(model_name_or_path: str):
    # Under ZeRO-3 init or FSDP's cpu-RAM-efficient loading, the weights of a freshly loaded model are partitioned or
    # live on rank 0 only: the converter would copy empty shards.
    from transformers.distributed.fsdp import is_fsdp_enabled
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

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
    revision, trust_remote_code); dtype defaults to float32 like TRL's.
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
    if config.model_type != "iha" and convert_to_iha:
        _refuse_conversion_of_partitioned_weights(model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **from_pretrained_kwargs)
    if config.model_type == "iha":
        if iha_options:
            logger.warning("%s is already an IHA model: iha_options %s are ignored.", model_name_or_path, iha_options)
        return model, False
    if not convert_to_iha:
        logger.warning("Training %s (%s) as is, without IHA layers.", model_name_or_path, config.model_type)
        return model, False
    from .convert import llama_to_iha

    logger.info("Converting %s (%s) to IHA with %s.", model_name_or_path, config.model_type, iha_options or {})
    # The loaded source model is dropped right after: let the IHA model take over its tensors instead of copying.
    return llama_to_iha(model, iha_options, share_weights=True), True


def prepare_tokenizer(tokenizer, assistant_only_loss: bool, chat_template_path: str | None = None):
    """Set a .jinja chat template if given, and `{% generation %}` markers when the loss is on assistant turns only.

    The marked template renders the same text (see `iha.chat_templates`), so it is saved with the model and the
    output folder trains again with `trl sft --assistant_only_loss` as is.
    """
    if chat_template_path is not None:
        tokenizer.chat_template = Path(chat_template_path).read_text(encoding="utf-8")
    if assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        tokenizer.chat_template = training_chat_template(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def iha_lora_config(
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    target_modules: Sequence[str] | None = None,
    modules_to_save: Sequence[str] | None = None,
    train_mixing: bool = True,
):
    """A LoRA config for IHA models: adapters on every projection, the mixing parameters trained in full.

    PEFT has no default targets for a new model type, hence the explicit list. `train_mixing` adds `head_mixing` to
    `modules_to_save`, so the coefficients are trained, saved with the adapter and merged with it.
    """
    from peft import LoraConfig

    modules_to_save = list(modules_to_save or [])
    if train_mixing and MIXING_MODULE_NAME not in modules_to_save:
        modules_to_save.append(MIXING_MODULE_NAME)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        bias="none",
        target_modules=list(target_modules or DEFAULT_LORA_TARGET_MODULES),
        modules_to_save=modules_to_save or None,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Trainer: the mixing parameters get their own optimizer group
# ---------------------------------------------------------------------------------------------------------------------


def iha_parameter_groups(
    model: torch.nn.Module,
    decay_parameter_names: set[str],
    weight_decay: float,
    mixing_learning_rate: float | None,
    mixing_weight_decay: float,
) -> list[dict[str, Any]]:
    """Optimizer groups: weights with decay, weights without decay (norms, biases), and the IHA mixing parameters
    with their own learning rate and weight decay. Frozen parameters are left out; empty groups are dropped."""
    decay, no_decay, mixing = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if is_mixing_parameter(name):
            mixing.append(parameter)
        elif name in decay_parameter_names:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    mixing_group = {"params": mixing, "weight_decay": mixing_weight_decay, "iha_group": "mixing"}
    if mixing_learning_rate is not None:
        mixing_group["lr"] = mixing_learning_rate
    groups = [
        {"params": decay, "weight_decay": weight_decay, "iha_group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "iha_group": "no_decay"},
        mixing_group,
    ]
    return [group for group in groups if group["params"]]


def enable_fsdp_on_cpu(accelerator, args) -> bool:
    """Make FSDP asked for on processes joined on CPU shard, as it does on GPUs. Returns whether it switched.

    accelerate builds the FSDP plugin (from `accelerate launch --use_fsdp` or a config's `distributed_type: FSDP`,
    or from the Trainer's `fsdp` / `fsdp_config`), but its state turns to FSDP only from a GPU-family distributed type:
    processes joined on CPU over gloo (`use_cpu`: `MULTI_CPU`) drop the plugin without a word and train plain data
    parallel, every process holding every weight, while the run looks like FSDP. torch's `fully_shard` runs on CPU
    over gloo, so the state is switched to FSDP with that plugin, as accelerate does for GPUs.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    # Set by `accelerate launch` for FSDP, and by the Accelerator when the Trainer hands it a plugin.
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not asked or state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None):
        return False
    plugin_args = args.fsdp_plugin_args or {}  # the Trainer's fsdp_config; without it the plugin reads FSDP_* variables
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # what every later AcceleratorState copies
    logger.info("FSDP on CPU: sharding over gloo with fully_shard (accelerate would train plain data parallel).")
    return True


@contextmanager
def own_class_while_saving(model: torch.nn.Module):
    """While saving, give a model under FSDP2 back its own class (e.g. `IHAForCausalLM`).

    `fully_shard` swaps the class of every module it shards for a generated subclass (`FSDPIHAForCausalLM`,
    defined in torch's `_fsdp_init`). `save_pretrained` of a model with custom code names the class of the object in
    `auto_map` and copies the file of its module as the model's code: it would write
    `_fsdp_init.FSDPIHAForCausalLM` and torch's FSDP sources instead of `modeling_iha.IHAForCausalLM` and the IHA
    code. Only writing happens inside (the sharded weights are gathered before); the FSDP class comes back after.
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp_class = type(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    model.__class__ = next(base for base in fsdp_class.__bases__ if not issubclass(base, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = fsdp_class


class IHASFTTrainer(SFTTrainer):
    """`SFTTrainer` whose optimizer gives the IHA mixing parameters their own learning rate and weight decay.

    Reads `mixing_learning_rate` / `mixing_weight_decay` from `IHASFTConfig`; with a plain `SFTConfig` the mixing
    parameters take `learning_rate` and no weight decay. With `assistant_only_loss`, a tokenizer whose chat template
    lacks `{% generation %}` markers gets the same template with markers (`iha.chat_templates`).
    """

    def __init__(self, model, args: SFTConfig | None = None, **kwargs):
        processing_class = kwargs.get("processing_class")
        if args is not None and args.assistant_only_loss and processing_class is not None:
            kwargs["processing_class"] = prepare_tokenizer(processing_class, assistant_only_loss=True)
        super().__init__(model, args, **kwargs)
        # What the model card says about the run (`write_training_card`); `train_sft` fills it in.
        self.card_details = {
            "base": getattr(getattr(self.model, "config", None), "_name_or_path", None) or None,
            "converted": False,
            "train_source": self.train_dataset,
            "num_rows": None,
            "peft_config": kwargs.get("peft_config"),
        }

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if enable_fsdp_on_cpu(self.accelerator, self.args):
            # Again, now that accelerate's state says FSDP: the Trainer's own FSDP setup and checks.
            super().create_accelerator_and_postprocess()

    def _save(self, output_dir=None, state_dict=None):
        with own_class_while_saving(self.accelerator.unwrap_model(self.model)):
            super()._save(output_dir, state_dict=state_dict)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # TRL writes its generic card into output_dir at every checkpoint save: write the IHA card instead.
        if self.is_world_process_zero():
            write_training_card(self.args.output_dir, self, **self.card_details)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        mixing_learning_rate = getattr(self.args, "mixing_learning_rate", None)
        mixing_weight_decay = getattr(self.args, "mixing_weight_decay", 0.0)
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs = dict(optimizer_kwargs)
        if not isinstance(optimizer_cls, type) or {"params", "model", "optimizer_dict"} & optimizer_kwargs.keys():
            # GaLore, LOMO, Muon factories, layer-wise optimizers... build their own groups.
            if mixing_learning_rate is not None:
                raise ValueError(
                    f"`mixing_learning_rate` needs a standard optimizer (e.g. `--optim adamw_torch`), but "
                    f"`optim={self.args.optim}` builds its own parameter groups. Unset `mixing_learning_rate` to use it."
                )
            return super().create_optimizer(model)
        groups = iha_parameter_groups(
            opt_model,
            set(self.get_decay_parameter_names(opt_model)),
            weight_decay=self.args.weight_decay,
            mixing_learning_rate=mixing_learning_rate,
            mixing_weight_decay=mixing_weight_decay,
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def _check_processes_are_connected(args: SFTConfig):
    # `accelerate launch --multi_gpu` / `torchrun` on a machine without GPUs start N processes; unless `use_cpu` makes
    # accelerate join them over gloo, each one silently trains its own copy on the whole dataset.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        raise RuntimeError(
            f"{launched} processes were launched but training would run in {args.world_size}: without a GPU, pass "
            "`--use_cpu true` (SFTConfig(use_cpu=True)) so that the processes train together over gloo."
        )


def _resolve_resume(resume_from_checkpoint):
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "last"):
        return True
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("false", "none", ""):
        return None
    return resume_from_checkpoint


def train_sft(
    model: str | PreTrainedModel,
    train_dataset: str | os.PathLike | Dataset | Sequence[dict],
    args: SFTConfig,
    *,
    processing_class=None,
    eval_dataset: str | os.PathLike | Dataset | Sequence[dict] | None = None,
    peft_config=None,
    convert_to_iha: bool = True,
    iha_options: dict | None = None,
    dataset_config_name: str | None = None,
    dataset_train_split: str = "train",
    dataset_test_split: str = "test",
    default_system_prompt: str | None = None,
    max_train_rows: int | None = None,
    filter_long_rows: bool = True,
    resume_from_checkpoint: str | bool | None = None,
    callbacks: list | None = None,
    save: bool = True,
) -> IHASFTTrainer:
    """Fine-tune an IHA model on chat / reasoning rows with TRL and save the result Hub-ready. Returns the trainer.

    - `model`: an IHA checkpoint (folder or Hub id) or model; a Llama-style checkpoint or model is converted with
      `iha.convert.llama_to_iha(model, iha_options)` unless `convert_to_iha=False` (then it trains as is: the baseline).
    - `train_dataset`: anything `iha.data.load_sft_dataset` reads (OpenThoughts-114k / OpenThoughts3 / messages /
      prompt-completion; Hub id, .json / .jsonl / .parquet, `Dataset`, list of dicts). Rows become `messages` with
      their system prompt; with `filter_long_rows`, rows longer than `args.max_length` tokens are dropped (and
      counted in the log) rather than truncated.
    - `args`: `IHASFTConfig` (or TRL's `SFTConfig`): packing, gradient checkpointing, assistant-only loss, ...
    - `peft_config`: e.g. `iha_lora_config()` for LoRA; the adapter is saved with the mixing weights.
    - `resume_from_checkpoint`: a checkpoint folder, or True for the last one in `args.output_dir`.

    With `save`, the final model (or adapter) and tokenizer go to `args.output_dir`; an IHA model is saved with its
    code files and `auto_map`, so the folder loads with `trust_remote_code=True` where `iha` is not installed.
    """
    _check_processes_are_connected(args)
    model_name_or_path = resolve_model_source(model) if isinstance(model, str | os.PathLike) else None
    converted = False
    if model_name_or_path is not None:
        model_init_kwargs = dict(args.model_init_kwargs or {})
        model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model, converted = load_model_for_sft(str(model_name_or_path), convert_to_iha, iha_options, **model_init_kwargs)
        args.model_init_kwargs = None  # used above; TRL would warn that they are ignored for a model instance
    elif not is_iha_model(model) and convert_to_iha:
        from .convert import llama_to_iha

        logger.info("Converting the %s model to IHA with %s.", model.config.model_type, iha_options or {})
        model, converted = llama_to_iha(model, iha_options), True
    if processing_class is None:
        source = model_name_or_path or getattr(model, "name_or_path", None)
        if not source:
            raise ValueError(
                "Pass `processing_class` (the tokenizer): the model was given as an object without a path."
            )
        processing_class = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    chat_template_path = args.chat_template_path
    if chat_template_path is not None and str(chat_template_path).endswith((".jinja", ".j2")):
        args.chat_template_path = None  # applied here, so that the length filter sees the same template
    else:
        chat_template_path = None
    processing_class = prepare_tokenizer(processing_class, args.assistant_only_loss, chat_template_path)

    if default_system_prompt == "openthoughts":
        from .data import OPENTHOUGHTS_SYSTEM_PROMPT

        default_system_prompt = OPENTHOUGHTS_SYSTEM_PROMPT

    def prepare_rows(rows, split, max_rows=None):
        dataset = load_sft_dataset(
            rows,
            split=split,
            config_name=dataset_config_name,
            default_system_prompt=default_system_prompt,
            max_rows=max_rows,
            num_proc=args.dataset_num_proc,
        )
        if filter_long_rows and args.max_length is not None:
            dataset, _ = filter_by_length(dataset, processing_class, args.max_length, num_proc=args.dataset_num_proc)
        return dataset

    # The main process downloads and converts first; the others then read the `datasets` cache.
    with args.main_process_first(desc="preparing SFT rows"):
        train_rows = prepare_rows(train_dataset, dataset_train_split, max_train_rows)
        eval_rows = prepare_rows(eval_dataset, dataset_test_split) if eval_dataset is not None else None

    if peft_config is not None and has_iha_layers(model):
        if MIXING_MODULE_NAME not in (peft_config.modules_to_save or []):
            logger.warning(
                "The LoRA config does not list %r in `modules_to_save`: the IHA mixing coefficients stay frozen at "
                "their current values. Use `iha_lora_config()` to train them.",
                MIXING_MODULE_NAME,
            )

    trainer = IHASFTTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=processing_class,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    trainer.card_details = {
        "base": model_name_or_path or getattr(model, "name_or_path", None),
        "converted": converted,
        "train_source": train_dataset,
        "num_rows": len(train_rows),
        "peft_config": peft_config,
    }
    trainer.train(resume_from_checkpoint=_resolve_resume(resume_from_checkpoint))
    if save:
        save_final_model(trainer, args.output_dir)
        if trainer.accelerator.is_main_process:
            write_training_card(args.output_dir, trainer, **trainer.card_details)
        if peft_config is not None and trainer.accelerator.is_main_process:
            record = {
                "base_model_name_or_path": str(model_name_or_path) if model_name_or_path is not None else None,
                "converted_to_iha": converted,
                "iha_options": iha_options or {},
            }
            write_json_atomic(record, Path(args.output_dir, BASE_RECORD_NAME))
    return trainer


def save_final_model(trainer, output_dir: str | os.PathLike) -> None:
    """Save the trained model into `output_dir` so that a run stopped while saving leaves no half-written model.

    One process saves into a staging folder next to `output_dir`, whose files are then renamed into it (the
    checkpoints there stay); a run killed while saving leaves the checkpoints and no partial model files. Several
    processes save together (sharded states gather on the main one) straight into `output_dir`. Under FSDP the final
    model is saved whole whatever the checkpoints' state dict type: with SHARDED_STATE_DICT `Trainer.save_model`
    writes no weights at all.
    """
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    if trainer.accelerator.num_processes > 1:
        trainer.save_model(output_dir)
        return
    with staged_folder(output_dir, "iha-sft", merge=True) as staging:
        trainer.save_model(str(staging))


def training_card_section(trainer, base, converted: bool, train_source, num_rows: int | None, peft_config) -> str:
    """The model card's "Training" section: base model, data, method, settings and the loss reached."""
    args = trainer.args
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    source = train_source if isinstance(train_source, str | os.PathLike) else f"{type(train_source).__name__} in memory"
    method = "full fine-tuning"
    if peft_config is not None:
        method = f"LoRA (r={peft_config.r}, alpha={peft_config.lora_alpha}; `head_mixing` trained in full)"
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)  # an enum in TrainingArguments
    rows = [
        ("base model", f"`{base}`" + (" (converted to IHA on the fly)" if converted else "")),
        ("data", f"`{source}`" + (f", {num_rows} rows after length filtering" if num_rows is not None else "")),
        ("method", f"{method} with TRL's `SFTTrainer`"),
        ("steps / epochs", f"{trainer.state.global_step} steps, {trainer.state.epoch or 0:.2f} epochs"),
        (
            "learning rate",
            f"{args.learning_rate} ({scheduler}); mixing parameters "
            f"{getattr(args, 'mixing_learning_rate', None) or args.learning_rate}",
        ),
        (
            "batch",
            f"{args.per_device_train_batch_size} per device x {args.gradient_accumulation_steps} accumulation "
            f"x {args.world_size} processes",
        ),
        ("max length / packing", f"{args.max_length} / {args.packing}"),
        ("precision", "bf16 mixed" if args.bf16 else "fp16 mixed" if args.fp16 else "fp32"),
        ("assistant-only loss", str(args.assistant_only_loss)),
    ]
    if losses:
        rows.append(("training loss", f"{losses[0]:.4f} (first logged) -> {losses[-1]:.4f} (last logged)"))
    return "| setting | value |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def write_training_card(output_dir, trainer, base, converted, train_source, num_rows, peft_config) -> None:
    """Write the model card of a training output: what it was trained from and on, and how to load it.

    It replaces the generic card TRL (and PEFT) write, which name no local base ("fine-tuned version of None") and
    load without `trust_remote_code`. The metadata's `base_model` is a Hub id or absent (the Hub accepts nothing
    else); a converted base folder's "IHA settings" section is carried over.
    """
    from .convert import looks_like_hub_id
    from .model_card import (
        DEFAULT_TAGS,
        ModelCardContent,
        finetuned_intro,
        how_to_load_adapter_section,
        how_to_load_section,
        hub_base_model,
        read_model_card,
        write_model_card,
    )

    base_card = read_model_card(base) if base is not None and Path(base).is_dir() else None
    hub_base = hub_base_model(base)
    metadata = {
        "library_name": "peft" if peft_config is not None else "transformers",
        "pipeline_tag": "text-generation",
        "tags": [*DEFAULT_TAGS, "sft", "trl", *(["lora"] if peft_config is not None else [])],
    }
    if hub_base is not None:
        metadata["base_model"] = hub_base
    if base_card is not None and base_card.metadata.get("license"):
        metadata["license"] = base_card.metadata["license"]
    if isinstance(train_source, str) and not Path(train_source).exists() and looks_like_hub_id(train_source):
        metadata["datasets"] = [train_source]
    intro = finetuned_intro(base, adapter=peft_config is not None, converted=converted)
    sections = {"Training": training_card_section(trainer, base, converted, train_source, num_rows, peft_config)}
    if base_card is not None and "IHA settings" in base_card.sections:
        sections["IHA settings"] = base_card.sections["IHA settings"]
    if peft_config is not None:
        sections["How to load"] = how_to_load_adapter_section(str(output_dir))
    else:
        sections["How to load"] = how_to_load_section(str(output_dir))
    title = f"{Path(output_dir).resolve().name} (IHA, fine-tuned)"
    write_model_card(output_dir, ModelCardContent(title=title, metadata=metadata, intro=intro, sections=sections))


# ---------------------------------------------------------------------------------------------------------------------
# Loading what training wrote; merging LoRA adapters
# ---------------------------------------------------------------------------------------------------------------------


def load_sft_output(
    path: str | os.PathLike,
    merge: bool = False,
    base_model: PreTrainedModel | str | None = None,
    **from_pretrained_kwargs,
):
    """Load what `train_sft` saved: a full model folder, or a LoRA adapter on its (rebuilt) IHA base.

    For an adapter, the base comes from `base_model` if given, else from the adapter's record (`iha_sft_base.json`):
    the same checkpoint, converted again with the same options when it was converted on the fly (conversion is
    deterministic: identity mixing). `merge=True` folds the adapters and the trained mixing weights into a plain
    `IHAForCausalLM`.
    """
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    from peft import PeftModel

    if base_model is None or isinstance(base_model, str | os.PathLike):
        record_path = path / BASE_RECORD_NAME
        record = json.loads(record_path.read_text(encoding="utf-8")) if record_path.is_file() else {}
        source = base_model or record.get("base_model_name_or_path")
        if source is None:
            adapter_config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
            source = adapter_config.get("base_model_name_or_path")
        if not source:
            raise ValueError(f"{path} does not say which base model the adapter belongs to: pass `base_model`.")
        base_model = load_adapter_base(
            path,
            str(source),
            convert_to_iha=record.get("converted_to_iha", True),
            iha_options=record.get("iha_options"),
            **from_pretrained_kwargs,
        )
    model = PeftModel.from_pretrained(base_model, path)
    return model.merge_and_unload() if merge else model


def load_adapter_base(adapter_dir: Path, source: str, **load_kwargs) -> PreTrainedModel:
    """The base model a LoRA adapter was trained on, or one error that names it and says how to point elsewhere."""
    from .convert import looks_like_hub_id

    how_to_fix = "pass `base_model=` (a folder or Hub id) to `load_sft_output` / `merge_lora`"
    if not Path(source).expanduser().exists() and not looks_like_hub_id(source):
        raise FileNotFoundError(
            f"The LoRA adapter in {adapter_dir} was trained on the base model {source}, which does not exist "
            f"(moved or deleted?): {how_to_fix}."
        )
    try:
        model, _ = load_model_for_sft(source, **load_kwargs)
    except OSError as error:
        raise OSError(
            f"The LoRA adapter in {adapter_dir} needs its base model {source}, which cannot be loaded "
            f"({str(error).splitlines()[0]}): {how_to_fix}, or download it first."
        ) from error
    return model


def merge_lora(adapter_dir: str | os.PathLike, output_dir: str | os.PathLike, base_model=None) -> Path:
    """Merge a LoRA adapter (and its trained mixing weights) into its base and save a Hub-ready model folder.

    Refuses to overwrite `output_dir`; writes into a temporary sibling folder and renames it into place.
    """
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists: choose a new folder for the merged model.")
    merged = load_sft_output(adapter_dir, merge=True, base_model=base_model)
    with staged_folder(output_dir, "iha-merge") as staging:
        merged.save_pretrained(staging)
        tokenizer_files = [p for p in Path(adapter_dir).iterdir() if p.name.startswith(("tokenizer", "chat_template"))]
        for tokenizer_file in tokenizer_files:
            shutil.copy2(tokenizer_file, staging / tokenizer_file.name)
        write_merged_card(staging, Path(adapter_dir), output_dir)
    return output_dir


def write_merged_card(folder: Path, adapter_dir: Path, output_dir: Path) -> None:
    """The card of a merged LoRA output: the adapter's card, loading as a full model from `output_dir`."""
    from .model_card import ModelCardContent, how_to_load_section, read_model_card, write_model_card

    card = read_model_card(adapter_dir) or ModelCardContent(title="")
    card.metadata["library_name"] = "transformers"
    card.metadata["tags"] = [tag for tag in card.metadata.get("tags", []) if tag != "lora"]
    card.title = f"{adapter_dir.resolve().name} (IHA, fine-tuned, LoRA merged)"
    card.intro = (
        f"The LoRA adapter in `{adapter_dir.name}` merged into its IHA base (adapters and trained mixing weights "
        "folded in): a plain IHA model. " + card.intro.replace("A LoRA adapter for", "Trained from", 1)
    ).strip()
    card.sections["How to load"] = how_to_load_section(str(output_dir))
    write_model_card(folder, card)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


# The flags `IHASFTConfig` adds to or changes in TRL's `SFTConfig`, shown in their own group before TRL's.
IHA_TRAINING_FLAGS = ("mixing_learning_rate", "mixing_weight_decay", "assistant_only_loss", "bf16")


def make_parser() -> HfArgumentParser:
    """`iha-sft`'s flags. `--help` lists the package's own first (model, data, IHA training), then TRL's ~200."""
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, IHASFTConfig),
        prog="iha-sft",
        usage="%(prog)s --model_name_or_path MODEL --dataset_name DATA [flags below]   or   %(prog)s CONFIG.yaml",
    )
    # HfArgumentParser puts every field into the parser's one "options" group, in dataclass order: the few IHA
    # flags would come after ~800 lines of TRL's. Regroup them (argparse prints groups in list order).
    groups = {
        "model (iha)": [f.name for f in fields(ModelArguments)],
        "data (iha)": [f.name for f in fields(DataArguments)],
        "IHA training": list(IHA_TRAINING_FLAGS),
    }
    options = parser._optionals
    options.title = "training (TRL's SFTConfig and transformers' TrainingArguments)"
    groups = [parser.add_argument_group("help")]
    groups[0]._group_actions = [action for action in options._group_actions if action.dest == "help"]
    for title, names in (("model (iha)", fields(ModelArguments)), ("data (iha)", fields(DataArguments))):
        groups.append(parser.add_argument_group(title))
        groups[-1]._group_actions = [
            action for action in options._group_actions if action.dest in {f.name for f in names}
        ]
    groups.append(parser.add_argument_group("IHA training"))
    groups[-1]._group_actions = [action for action in options._group_actions if action.dest in IHA_TRAINING_FLAGS]
    moved = {id(action) for group in groups for action in group._group_actions}
    options._group_actions = [action for action in options._group_actions if id(action) not in moved]
    parser._action_groups = [parser._positionals, *groups, options]
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[ModelArguments, DataArguments, IHASFTConfig]:
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0])
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def run_cli(argv: Sequence[str] | None = None) -> IHASFTTrainer:
    """What `iha-sft` runs, returning the trainer: the flags of `IHASFTConfig` (TRL's `SFTConfig` + mixing lr / wd),
    `ModelArguments` and `DataArguments`, or one .yaml / .json file holding them."""
    model_args, data_args, training_args = parse_args(argv)
    iha_options = asdict(IHAConversionOptions.from_json(model_args.iha_options)) if model_args.iha_options else None
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
        "revision": model_args.model_revision,
    }
    tokenizer = None
    if model_args.tokenizer_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name_or_path, trust_remote_code=training_args.trust_remote_code
        )
    peft_config = None
    if model_args.use_peft:
        peft_config = iha_lora_config(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=model_args.lora_target_modules,
            modules_to_save=model_args.lora_modules_to_save,
        )
    trainer = train_sft(
        model_args.model_name_or_path,
        data_args.dataset_name,
        training_args,
        processing_class=tokenizer,
        eval_dataset=data_args.eval_dataset_name if training_args.eval_strategy != "no" else None,
        peft_config=peft_config,
        convert_to_iha=model_args.convert_to_iha,
        iha_options=iha_options,
        dataset_config_name=data_args.dataset_config,
        dataset_train_split=data_args.dataset_train_split,
        dataset_test_split=data_args.dataset_test_split,
        default_system_prompt=data_args.default_system_prompt,
        max_train_rows=data_args.max_train_rows,
        filter_long_rows=data_args.filter_long_rows,
        resume_from_checkpoint=training_args.resume_from_checkpoint,
    )
    trainer.accelerator.print(f"Saved to {training_args.output_dir}.")
    if model_args.use_peft and model_args.merge_adapter:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            merged_dir = merge_lora(training_args.output_dir, Path(training_args.output_dir) / "merged")
            trainer.accelerator.print(f"Merged model saved to {merged_dir}.")
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finish the trackers, destroy the process group
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    """`iha-sft` / `iha sft` / `python -m iha.sft` (run `--help` for every flag).

    Bad input prints one line (exit 2); Ctrl-C / SIGTERM exit 130 / 143, keeping the checkpoints already saved in
    OUTPUT_DIR (`--resume_from_checkpoint true` continues from the last one).
    """

    def sft() -> int:
        run_cli(argv)
        return 0

    return run_command(
        "iha-sft",
        sft,
        errors=(ValueError, ConversionError),
        interrupted="the checkpoints saved so far stay in the output folder; the final model was not saved",
    )


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DEFAULT_LORA_TARGET_MODULES",
    "DataArguments",
    "IHASFTConfig",
    "IHASFTTrainer",
    "ModelArguments",
    "iha_lora_config",
    "iha_parameter_groups",
    "is_mixing_parameter",
    "load_model_for_sft",
    "load_sft_output",
    "main",
    "merge_lora",
    "run_cli",
    "train_sft",
]
