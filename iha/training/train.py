"""`train_sft`: data, model, trainer and the final save, the one function the command line and the A/B harness call."""

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedModel
from trl import SFTConfig

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..conversion import llama_to_iha
from ..data.messages import OPENTHOUGHTS_SYSTEM_PROMPT, filter_by_length, load_sft_dataset
from ..utils.atomic_files import write_json_atomic
from ..utils.atomic_folders import staged_folder
from .card import quantization_description, write_training_card
from .config import BASE_RECORD_NAME, MIXING_MODULE_NAME
from .model import has_iha_layers, is_iha_model, load_model_for_sft, prepare_tokenizer, resolve_model_source
from .trainer import IHASFTTrainer


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def _check_processes_are_connected(args: SFTConfig):
    # `accelerate launch --multi_gpu` / `torchrun` on a machine without GPUs start N processes; unless `use_cpu` makes
    # accelerate join them over gloo, each one silently trains its own copy on the whole dataset.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        raise ValueError(
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
    quantization_config=None,
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
      `iha.conversion.llama_to_iha(model, iha_options)` unless `convert_to_iha=False` (then it trains as is: the baseline).
    - `train_dataset`: anything `iha.data.messages.load_sft_dataset` reads (OpenThoughts-114k / OpenThoughts3 / messages /
      prompt-completion; Hub id, .json / .jsonl / .parquet, `Dataset`, list of dicts). Rows become `messages` with
      their system prompt; with `filter_long_rows`, rows longer than `args.max_length` tokens are dropped (and
      counted in the log) rather than truncated.
    - `args`: `IHASFTConfig` (or TRL's `SFTConfig`): packing, gradient checkpointing, assistant-only loss, ...
    - `peft_config`: e.g. `iha_lora_config()` for LoRA; the adapter is saved with the mixing weights.
    - `quantization_config`: a `BitsAndBytesConfig` (QLoRA, with `peft_config`): the base is loaded quantized (a
      Llama-style one converted as it loads), the mixing stays fp32 and is trained in full beside the adapters.
    - `resume_from_checkpoint`: a checkpoint folder, or True for the last one in `args.output_dir`.

    With `save`, the final model (or adapter) and tokenizer go to `args.output_dir`; an IHA model is saved with its
    code files and `auto_map`, so the folder loads with `trust_remote_code=True` where `iha` is not installed.
    """
    _check_processes_are_connected(args)
    model_name_or_path = resolve_model_source(model) if isinstance(model, str | os.PathLike) else None
    if quantization_config is not None and peft_config is None:
        raise ValueError(
            "A quantized base is frozen: pass `peft_config` (e.g. `iha_lora_config()`, or --use_peft) to train LoRA "
            "adapters on it; the IHA mixing is trained in full beside them."
        )
    if quantization_config is not None and model_name_or_path is None:
        raise ValueError("`quantization_config` applies when the model is loaded: pass its folder or Hub id.")
    converted = False
    if model_name_or_path is not None:
        model_init_kwargs = dict(args.model_init_kwargs or {})
        model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        if quantization_config is not None:
            model_init_kwargs["quantization_config"] = quantization_config
        model, converted = load_model_for_sft(str(model_name_or_path), convert_to_iha, iha_options, **model_init_kwargs)
        args.model_init_kwargs = None  # used above; TRL would warn that they are ignored for a model instance
    elif not is_iha_model(model) and convert_to_iha:
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
        "quantization": quantization_description(quantization_config),
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
                # The adapter reloads on the base quantized the same way (`load_sft_output`); merges use it unquantized.
                "quantization_config": quantization_config.to_dict() if quantization_config is not None else None,
            }
            write_json_atomic(record, Path(args.output_dir, BASE_RECORD_NAME))
    return trainer


def save_final_model(trainer, output_dir: str | os.PathLike) -> None:
    """Save the trained model into `output_dir` so that a run stopped while saving leaves no half-written model.

    The process that writes (the main one; with `save_on_each_node` each node's) saves into a staging folder next to
    `output_dir`, whose files are then renamed into it (the checkpoints there stay); a run killed while saving leaves
    the checkpoints and no partial model files. The other processes take part in the save (sharded states gather on
    the writer) without writing, and every process waits until the model is in place. Under FSDP the final model is
    saved whole whatever the checkpoints' state dict type: with SHARDED_STATE_DICT `Trainer.save_model` writes no
    weights at all.
    """
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    if trainer.args.should_save:
        with staged_folder(output_dir, "iha-sft", merge=True) as staging:
            trainer.save_model(str(staging))
    else:
        trainer.save_model(str(output_dir))  # gathers with the writer; `Trainer.save_model` writes nothing here
    trainer.accelerator.wait_for_everyone()
