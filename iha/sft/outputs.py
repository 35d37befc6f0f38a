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
"""Reading what training wrote (full models and LoRA adapters) and merging adapters into full models."""

import json
import os
import shutil
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..atomic_folders import staged_folder
from ..licenses import license_card_parts, write_code_license
from .config import BASE_RECORD_NAME, is_mixing_parameter
from .model import load_model_for_sft


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
    deterministic: identity mixing), and quantized as it was in training (QLoRA) unless the adapter is merged.
    `merge=True` folds the adapters and the trained mixing weights into a plain `IHAForCausalLM`. After QLoRA the
    merge goes into the base loaded unquantized (`dtype` of `from_pretrained_kwargs`, float32 by default): PEFT merges
    into a bitsandbytes base by dequantizing each weight, adding the LoRA update and quantizing it again, which rounds
    the update away in part; the merged model differs from the trained one by the base's quantization error.
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
        quantization = record.get("quantization_config")
        if quantization is not None and not merge and "quantization_config" not in from_pretrained_kwargs:
            from transformers import BitsAndBytesConfig

            from_pretrained_kwargs["quantization_config"] = BitsAndBytesConfig.from_dict(quantization)
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
    from ..convert import looks_like_hub_id

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
    from ..model_card import ModelCardContent, how_to_load_section, read_model_card, write_model_card

    card = read_model_card(adapter_dir) or ModelCardContent(title="")
    card.metadata["library_name"] = "transformers"
    card.metadata["tags"] = [tag for tag in card.metadata.get("tags", []) if tag != "lora"]
    card.title = f"{adapter_dir.resolve().name} (IHA, fine-tuned, LoRA merged)"
    card.intro = (
        f"The LoRA adapter in `{adapter_dir.name}` merged into its IHA base (adapters and trained mixing weights "
        "folded in): a plain IHA model. " + card.intro.replace("A LoRA adapter for", "Trained from", 1)
    ).strip()
    card.sections["How to load"] = how_to_load_section(str(output_dir))
    write_code_license(folder)  # the card's "License" section, carried over from the adapter's, names it
    write_model_card(folder, card)


def trained_dtypes(model) -> str:
    """The dtypes the trainable weights were kept in, the mixing's apart ("bfloat16; mixing float32")."""
    mixing, others = set(), set()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (mixing if is_mixing_parameter(name) else others).add(str(parameter.dtype).removeprefix("torch."))
    text = ", ".join(sorted(others)) or "none"
    return f"{text}; mixing {', '.join(sorted(mixing))}" if mixing else text


def quantization_description(quantization_config) -> str | None:
    """How a bitsandbytes config quantizes the base, in words ("4-bit nf4, compute dtype float32"); None for none."""
    if quantization_config is None:
        return None
    if quantization_config.load_in_4bit:
        compute_dtype = str(quantization_config.bnb_4bit_compute_dtype).removeprefix("torch.")
        nested = ", nested" if quantization_config.bnb_4bit_use_double_quant else ""
        return f"4-bit {quantization_config.bnb_4bit_quant_type}{nested}, compute dtype {compute_dtype}"
    return "8-bit (LLM.int8)"


def training_card_section(
    trainer, base, converted: bool, train_source, num_rows: int | None, peft_config, quantization: str | None = None
) -> str:
    """The model card's "Training" section: base model, data, method, settings and the loss reached."""
    args = trainer.args
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    source = train_source if isinstance(train_source, str | os.PathLike) else f"{type(train_source).__name__} in memory"
    method = "full fine-tuning"
    if peft_config is not None:
        method = f"LoRA (r={peft_config.r}, alpha={peft_config.lora_alpha}; `head_mixing` trained in full, in fp32)"
    if quantization is not None:
        method = f"QLoRA: {method} on a base quantized with bitsandbytes ({quantization})"
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
        ("trained weights", trained_dtypes(trainer.model)),
        ("assistant-only loss", str(args.assistant_only_loss)),
    ]
    if losses:
        rows.append(("training loss", f"{losses[0]:.4f} (first logged) -> {losses[-1]:.4f} (last logged)"))
    return "| setting | value |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def write_training_card(
    output_dir, trainer, base, converted, train_source, num_rows, peft_config, quantization=None
) -> None:
    """Write the model card of a training output: what it was trained from and on, and how to load it.

    It replaces the generic card TRL (and PEFT) write, which name no local base ("fine-tuned version of None") and
    load without `trust_remote_code`. The metadata's `base_model` is a Hub id or absent (the Hub accepts nothing
    else); a converted base folder's "IHA settings" section is carried over.
    """
    from ..convert import looks_like_hub_id
    from ..model_card import (
        DEFAULT_TAGS,
        ModelCardContent,
        card_license,
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
    base_name = hub_base or (Path(str(base)).name if base is not None else "the base model")
    metadata["license"], license_section = license_card_parts(output_dir, card_license(base_card), base_name)
    if isinstance(train_source, str) and not Path(train_source).exists() and looks_like_hub_id(train_source):
        metadata["datasets"] = [train_source]
    intro = finetuned_intro(base, adapter=peft_config is not None, converted=converted)
    sections = {
        "Training": training_card_section(trainer, base, converted, train_source, num_rows, peft_config, quantization)
    }
    if base_card is not None and "IHA settings" in base_card.sections:
        sections["IHA settings"] = base_card.sections["IHA settings"]
    if peft_config is not None:
        sections["How to load"] = how_to_load_adapter_section(str(output_dir))
    else:
        sections["How to load"] = how_to_load_section(str(output_dir))
    sections["License"] = license_section
    title = f"{Path(output_dir).resolve().name} (IHA, fine-tuned)"
    write_model_card(output_dir, ModelCardContent(title=title, metadata=metadata, intro=intro, sections=sections))
