"""`train_sft`: TRL's `scripts/sft.py` for IHA models, from the same parsed configs (TRL's, with the IHA settings
added: `iha.training.config`) to a Hub-ready folder. The command line (`iha sft`) and the A/B harness call it.

It reads top-down as TRL's script: the model (`sft_model`), the tokenizer (`sft_tokenizer`) and the rows
(`sft_datasets`), each built by one helper from the configs; the trainer (`IHASFTTrainer`, the one owner of the
tokenizer's training needs and of the model card); train; save (`save_sft_output`).
"""

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedModel
from trl import SFTConfig, get_quantization_config

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..conversion import llama_to_iha
from ..data.messages import filter_by_length, load_sft_dataset, local_data_path
from ..utils.atomic_files import write_json_atomic
from ..utils.atomic_folders import staged_folder
from ..utils.model_source import check_model_source
from .config import BASE_RECORD_NAME, IHAModelConfig, IHAScriptArguments, as_iha_config
from .model import iha_peft_config, is_iha_model, load_model_for_sft, resolve_model_source
from .outputs import merge_lora
from .trainer import IHASFTTrainer, training_tokenizer


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
    model_args: IHAModelConfig, training_args: SFTConfig, model: PreTrainedModel | None = None
) -> tuple[PreTrainedModel, str | None, bool]:
    """The model to train: (model, the folder or Hub id it was loaded from, or None, whether it was converted to IHA).

    `model_args.model_name_or_path` is loaded as TRL's script loads it (`revision`, `dtype`, `attn_implementation`
    from `model_args`, `training_args.model_init_kwargs` over them) and quantized as it loads with
    `load_in_4bit` / `load_in_8bit` (TRL's `get_quantization_config`); `model`, an object, is taken instead. A
    Llama-style model is converted to IHA with `model_args.iha_options` unless `model_args.convert_to_iha` is False.
    """
    if model is not None:
        if model_args.model_name_or_path is not None:
            raise ValueError(
                f"Both a model object and model_name_or_path={model_args.model_name_or_path!r} were given: give one."
            )
        if model_args.load_in_4bit or model_args.load_in_8bit:
            raise ValueError("load_in_4bit / load_in_8bit apply when the model is loaded: give model_name_or_path.")
        name = model.name_or_path or None  # where the object was loaded from, if it says
        if is_iha_model(model) or not model_args.convert_to_iha:
            return model, name, False
        logger.info("Converting the %s model to IHA with %s.", model.config.model_type, model_args.iha_options or {})
        return llama_to_iha(model, model_args.iha_options), name, True
    if model_args.model_name_or_path is None:
        raise ValueError("Give the model: model_name_or_path (a folder or Hub id), or a model object as `model=`.")
    source = resolve_model_source(model_args.model_name_or_path)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        model_init_kwargs["quantization_config"] = quantization_config
    loaded, converted = load_model_for_sft(
        source, model_args.convert_to_iha, model_args.iha_options, **model_init_kwargs
    )
    training_args.model_init_kwargs = None  # used here; TRL would warn that they are ignored for a model instance
    return loaded, source, converted


def sft_tokenizer(
    model_args: IHAModelConfig, training_args: SFTConfig, model_source: str | None, processing_class=None
):
    """The tokenizer: `processing_class`, else `model_args.tokenizer_name_or_path`'s, else the model's own (from
    `model_source`), prepared as the trainer will use it (`training_tokenizer`) so that the length filter counts the
    tokens training sees."""
    if processing_class is None:
        name = model_args.tokenizer_name_or_path or model_source
        if not name:
            raise ValueError(
                "Give the tokenizer: `processing_class`, or tokenizer_name_or_path (the model was given as an object "
                "without a folder)."
            )
        processing_class = AutoTokenizer.from_pretrained(
            check_model_source(name), trust_remote_code=training_args.trust_remote_code
        )
    return training_tokenizer(processing_class, training_args)


def sft_rows(
    rows, split: str, tokenizer, script_args: IHAScriptArguments, training_args: SFTConfig, max_rows: int | None = None
) -> Dataset:
    """The `messages` rows of one split (`load_sft_dataset`: any schema, `script_args.default_system_prompt` for
    rows without one), less those longer than `training_args.max_length` tokens with `script_args.filter_long_rows`
    (dropped, and counted in the log, rather than truncated)."""
    dataset = load_sft_dataset(
        rows,
        split=split,
        config_name=script_args.dataset_config,
        default_system_prompt=script_args.default_system_prompt,
        max_rows=max_rows,
        num_proc=training_args.dataset_num_proc,
    )
    if script_args.filter_long_rows and training_args.max_length is not None:
        dataset, _ = filter_by_length(
            dataset, tokenizer, training_args.max_length, num_proc=training_args.dataset_num_proc
        )
    return dataset


def sft_datasets(
    script_args: IHAScriptArguments,
    training_args: SFTConfig,
    tokenizer,
    train_dataset: Dataset | Sequence[dict] | None = None,
    eval_dataset: Dataset | Sequence[dict] | None = None,
) -> tuple[Dataset, Dataset | None]:
    """The training and evaluation rows (`sft_rows`): `script_args.dataset_name`'s train split and, with an
    `eval_strategy`, `script_args.eval_dataset_name`'s test split; rows given as `train_dataset` / `eval_dataset`
    (a `Dataset` or a list of dicts) are taken instead. The main process reads and converts them first; the others
    then read the `datasets` cache."""
    if train_dataset is None:
        train_dataset = script_args.dataset_name
    if train_dataset is None:
        raise ValueError("Give the rows: dataset_name (a Hub id or a local file), or rows as `train_dataset=`.")
    if eval_dataset is None and training_args.eval_strategy != "no":
        eval_dataset = script_args.eval_dataset_name
    with training_args.main_process_first(desc="preparing SFT rows"):
        train_rows = sft_rows(
            train_dataset,
            script_args.dataset_train_split,
            tokenizer,
            script_args,
            training_args,
            max_rows=script_args.max_train_rows,
        )
        eval_rows = None
        if eval_dataset is not None:
            eval_rows = sft_rows(eval_dataset, script_args.dataset_test_split, tokenizer, script_args, training_args)
    return train_rows, eval_rows


def train_sft(
    script_args: IHAScriptArguments,
    training_args: SFTConfig,
    model_args: IHAModelConfig,
    *,
    model: PreTrainedModel | None = None,
    train_dataset: Dataset | Sequence[dict] | None = None,
    eval_dataset: Dataset | Sequence[dict] | None = None,
    processing_class=None,
    callbacks: list | None = None,
) -> IHASFTTrainer:
    """Fine-tune an IHA model on chat / reasoning rows with TRL and save the result Hub-ready; returns the trainer.

    The configs are TRL's `scripts/sft.py`'s, each with the IHA settings added (the same names as `iha sft`'s flags):

    - `script_args` (`IHAScriptArguments`, or TRL's `ScriptArguments`): the rows, `dataset_name` (any schema
      `iha.data.messages.load_sft_dataset` reads: OpenThoughts-114k / OpenThoughts3 / messages / prompt-completion;
      Hub id or .json / .jsonl / .parquet), `eval_dataset_name`, `default_system_prompt` ("openthoughts":
      OpenThoughts' own), `max_train_rows`, `filter_long_rows` (rows longer than `training_args.max_length` tokens
      dropped and counted rather than truncated).
    - `training_args` (`IHASFTConfig`, or TRL's `SFTConfig`): packing, assistant-only loss, the mixing's learning
      rate, ...; `resume_from_checkpoint` (a checkpoint folder, or "true" / True for the last one in `output_dir`).
    - `model_args` (`IHAModelConfig`, or TRL's `ModelConfig`): `model_name_or_path` (an IHA checkpoint, or a
      Llama-style one converted with `iha_options` unless `convert_to_iha=False`: the baseline), `dtype`,
      `use_peft` and `lora_*` (TRL's `get_peft_config`, with the mixing trained in full: `iha_peft_config`),
      `load_in_4bit` / `load_in_8bit` (QLoRA: the mixing stays fp32), `merge_adapter`.

    From Python, objects can stand in for what the configs name: `model` (a model, converted as a folder would be),
    `train_dataset` / `eval_dataset` (a `Dataset` or a list of dicts, read like a file), `processing_class` (the
    tokenizer), and `callbacks` go to the trainer.

    The final model (or adapter, with `iha_sft_base.json` to rebuild its base) and tokenizer go to
    `training_args.output_dir`; an IHA model is saved with its code files and `auto_map`, so the folder loads with
    `trust_remote_code=True` where `iha` is not installed.
    """
    script_args = as_iha_config(script_args, IHAScriptArguments)
    model_args = as_iha_config(model_args, IHAModelConfig)
    _check_processes_are_connected(training_args)
    # Missing folders and files, each said before the model loads (and, with --convert_to_iha, converts).
    if model is None and model_args.model_name_or_path is not None:
        check_model_source(model_args.model_name_or_path)
    if model_args.tokenizer_name_or_path is not None:
        check_model_source(model_args.tokenizer_name_or_path)
    eval_source = eval_dataset if eval_dataset is not None else script_args.eval_dataset_name
    for source in (
        train_dataset if train_dataset is not None else script_args.dataset_name,
        eval_source if training_args.eval_strategy != "no" else None,
    ):
        if isinstance(source, (str, os.PathLike)):
            local_data_path(source)

    model, model_source, converted = sft_model(model_args, training_args, model)
    tokenizer = sft_tokenizer(model_args, training_args, model_source, processing_class)
    train_rows, eval_rows = sft_datasets(script_args, training_args, tokenizer, train_dataset, eval_dataset)

    trainer = IHASFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        peft_config=iha_peft_config(model_args),
        callbacks=callbacks,
        card_details={
            "base": model_source,
            "converted": converted,
            "train_source": train_dataset if train_dataset is not None else script_args.dataset_name,
        },
    )
    trainer.train(resume_from_checkpoint=_resolve_resume(training_args.resume_from_checkpoint))
    save_sft_output(trainer, model_args, model_source, converted)
    return trainer


def save_sft_output(trainer: IHASFTTrainer, model_args: IHAModelConfig, model_source: str | None, converted: bool):
    """Save what `train_sft` trained into `trainer.args.output_dir` (`save_final_model`); next to a LoRA adapter,
    how to rebuild its base (`iha_sft_base.json`) and, with `model_args.merge_adapter`, the merged model in
    `merged/`."""
    output_dir = trainer.args.output_dir
    save_final_model(trainer, output_dir)
    if not model_args.use_peft:
        return
    if trainer.accelerator.is_main_process:
        quantization_config = get_quantization_config(model_args)
        record = {
            "base_model_name_or_path": model_source,
            "converted_to_iha": converted,
            "iha_options": model_args.iha_options or {},
            # The adapter reloads on the base quantized the same way (`load_sft_output`); merges use it unquantized.
            "quantization_config": quantization_config.to_dict() if quantization_config is not None else None,
        }
        write_json_atomic(record, Path(output_dir, BASE_RECORD_NAME))
        if model_args.merge_adapter:
            merged_dir = merge_lora(output_dir, Path(output_dir) / "merged")
            trainer.accelerator.print(f"Merged model saved to {merged_dir}.")
    trainer.accelerator.wait_for_everyone()


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
