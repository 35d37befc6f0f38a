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
from ..data.messages import filter_by_length, load_sft_dataset
from ..utils.atomic_files import write_json_atomic
from ..utils.atomic_folders import staged_folder
from .card import quantization_description
from .config import BASE_RECORD_NAME
from .model import is_iha_model, load_model_for_sft, resolve_model_source
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


def sft_model(
    model: str | os.PathLike | PreTrainedModel,
    args: SFTConfig,
    *,
    convert_to_iha: bool = True,
    iha_options: dict | None = None,
    quantization_config=None,
    peft_config=None,
) -> tuple[PreTrainedModel, str | None, bool]:
    """The model to train, (model, its folder or Hub id or None, whether it was converted to IHA here).

    A folder or Hub id is loaded with `args.model_init_kwargs` (TRL's: dtype, attn_implementation, revision) and,
    with `quantization_config`, quantized as it loads; a Llama-style model is converted unless `convert_to_iha=False`.
    """
    if quantization_config is not None and peft_config is None:
        raise ValueError(
            "A quantized base is frozen: pass `peft_config` (e.g. `iha_lora_config()`, or --use_peft) to train LoRA "
            "adapters on it; the IHA mixing is trained in full beside them."
        )
    if not isinstance(model, str | os.PathLike):
        if quantization_config is not None:
            raise ValueError("`quantization_config` applies when the model is loaded: pass its folder or Hub id.")
        if is_iha_model(model) or not convert_to_iha:
            return model, None, False
        logger.info("Converting the %s model to IHA with %s.", model.config.model_type, iha_options or {})
        return llama_to_iha(model, iha_options), None, True
    source = resolve_model_source(model)
    model_init_kwargs = dict(args.model_init_kwargs or {})
    model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if quantization_config is not None:
        model_init_kwargs["quantization_config"] = quantization_config
    loaded, converted = load_model_for_sft(source, convert_to_iha, iha_options, **model_init_kwargs)
    args.model_init_kwargs = None  # used here; TRL would warn that they are ignored for a model instance
    return loaded, source, converted


def sft_tokenizer(processing_class, source: str | None, args: SFTConfig):
    """The tokenizer: `processing_class`, else the model's own (from `source`), with `args.chat_template_path` (a
    .jinja file) applied here so that the length filter sees the template training uses. The trainer then adds
    what training needs (`{% generation %}` markers, a pad token: `IHASFTTrainer`)."""
    if processing_class is None:
        if not source:
            raise ValueError(
                "Pass `processing_class` (the tokenizer): the model was given as an object without a path."
            )
        processing_class = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    template_path = args.chat_template_path
    if template_path is not None and str(template_path).endswith((".jinja", ".j2")):
        processing_class.chat_template = Path(template_path).read_text(encoding="utf-8")
        args.chat_template_path = None  # applied; TRL would apply it again
    return processing_class


def sft_rows(
    rows,
    split: str,
    tokenizer,
    args: SFTConfig,
    *,
    config_name: str | None = None,
    default_system_prompt: str | None = None,
    max_rows: int | None = None,
    filter_long_rows: bool = True,
):
    """The `messages` rows of one split (`load_sft_dataset`), less those longer than `args.max_length` tokens with
    `filter_long_rows` (dropped, and counted in the log, rather than truncated)."""
    dataset = load_sft_dataset(
        rows,
        split=split,
        config_name=config_name,
        default_system_prompt=default_system_prompt,
        max_rows=max_rows,
        num_proc=args.dataset_num_proc,
    )
    if filter_long_rows and args.max_length is not None:
        dataset, _ = filter_by_length(dataset, tokenizer, args.max_length, num_proc=args.dataset_num_proc)
    return dataset


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

    Read like TRL's `scripts/sft.py`: the model (`sft_model`), the tokenizer (`sft_tokenizer`) and the rows
    (`sft_rows`), then the trainer, which owns the tokenizer's training needs and the model card.

    - `model`: an IHA checkpoint (folder or Hub id) or model; a Llama-style checkpoint or model is converted with
      `iha.conversion.llama_to_iha(model, iha_options)` unless `convert_to_iha=False` (then it trains as is: the baseline).
    - `train_dataset`: anything `iha.data.messages.load_sft_dataset` reads (OpenThoughts-114k / OpenThoughts3 / messages /
      prompt-completion; Hub id, .json / .jsonl / .parquet, `Dataset`, list of dicts). Rows become `messages` with
      their system prompt (`default_system_prompt="openthoughts"`: OpenThoughts' own); with `filter_long_rows`, rows
      longer than `args.max_length` tokens are dropped (and counted in the log) rather than truncated.
    - `args`: `IHASFTConfig` (or TRL's `SFTConfig`): packing, gradient checkpointing, assistant-only loss, ...
    - `peft_config`: e.g. `iha_lora_config()` for LoRA; the adapter is saved with the mixing weights.
    - `quantization_config`: a `BitsAndBytesConfig` (QLoRA, with `peft_config`): the base is loaded quantized (a
      Llama-style one converted as it loads), the mixing stays fp32 and is trained in full beside the adapters.
    - `resume_from_checkpoint`: a checkpoint folder, or True for the last one in `args.output_dir`.

    With `save`, the final model (or adapter) and tokenizer go to `args.output_dir`; an IHA model is saved with its
    code files and `auto_map`, so the folder loads with `trust_remote_code=True` where `iha` is not installed.
    """
    _check_processes_are_connected(args)
    model, source, converted = sft_model(
        model,
        args,
        convert_to_iha=convert_to_iha,
        iha_options=iha_options,
        quantization_config=quantization_config,
        peft_config=peft_config,
    )
    tokenizer = sft_tokenizer(processing_class, source or getattr(model, "name_or_path", None), args)
    data_options = {
        "config_name": dataset_config_name,
        "default_system_prompt": default_system_prompt,
        "filter_long_rows": filter_long_rows,
    }
    # The main process downloads and converts first; the others then read the `datasets` cache.
    with args.main_process_first(desc="preparing SFT rows"):
        train_rows = sft_rows(
            train_dataset, dataset_train_split, tokenizer, args, max_rows=max_train_rows, **data_options
        )
        eval_rows = None
        if eval_dataset is not None:
            eval_rows = sft_rows(eval_dataset, dataset_test_split, tokenizer, args, **data_options)

    trainer = IHASFTTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
        card_details={
            "base": source or getattr(model, "name_or_path", None),
            "converted": converted,
            "train_source": train_dataset,
            "num_rows": len(train_rows),
            "quantization": quantization_description(quantization_config),
        },
    )
    trainer.train(resume_from_checkpoint=_resolve_resume(resume_from_checkpoint))
    if save:
        save_final_model(trainer, args.output_dir)
        if peft_config is not None and trainer.accelerator.is_main_process:
            record = {
                "base_model_name_or_path": source,
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
    trainer.create_model_card()  # the IHA card of the final model (the trainer's; written by the main process)
    trainer.accelerator.wait_for_everyone()
