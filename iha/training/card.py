"""The model cards of training outputs: `write_training_card` (what `train_sft` saved: base, data, method, loss,
how to load), `write_merged_card` (a LoRA adapter merged into its base), and `rewrite_trainer_card`, the `iha card`
command, for a folder another trainer (`trl sft`) wrote. Generic card reading and writing is `iha.hub.model_card`'s;
the card of a converted folder is `iha.conversion.card`'s.

This module does not import TRL at its top: `iha card` runs without the training extra.
"""

import os
from pathlib import Path

from ..conversion.builtin import builtin_base_model
from ..hub.licenses import license_card_parts, write_code_license
from ..hub.model_card import (
    DEFAULT_TAGS,
    INSTALL_HINT,
    ModelCardContent,
    card_license,
    how_to_load_section,
    read_model_card,
    write_model_card,
)
from ..utils.model_source import looks_like_hub_id
from .config import is_mixing_parameter  # imports TRL: not at the top (see the module's docstring)


def how_to_load_adapter_section(adapter_path: str) -> str:
    """The "How to load" section of a LoRA output: the adapter on its IHA base, or merged into it."""
    return f"""A LoRA adapter (with the trained IHA mixing weights) for an IHA model. Load it on its base with the `iha`
package ({INSTALL_HINT}), which rebuilds the base recorded in `iha_sft_base.json`:

```python
from iha.training import load_sft_output

model = load_sft_output("{adapter_path}")              # PeftModel on the IHA base
merged = load_sft_output("{adapter_path}", merge=True)  # a plain IHAForCausalLM
```"""


def hub_base_model(source) -> str | None:
    """The Hub id to name as `base_model` in a card's metadata, or None: the Hub only accepts repository ids there.

    A Hub id is itself; a local folder gives the base its own card names (a converted folder records its source),
    or the one `iha.conversion.builtin` stamped into it; any other local path gives None.
    """
    if source is None:
        return None
    path = Path(str(source)).expanduser()
    if not path.exists():
        return str(source) if looks_like_hub_id(str(source)) else None
    card = read_model_card(path)
    if card is not None and isinstance(card.metadata.get("base_model"), str):
        return card.metadata["base_model"]
    return builtin_base_model(path)


def finetuned_intro(
    base, *, adapter: bool = False, converted: bool = False, trainer: str = "TRL's `SFTTrainer`"
) -> str:
    """The intro of a training output's card: what it was trained from (its Hub id where it has one)."""
    base_label = f"`{hub_base_model(base) or Path(str(base)).name}`"
    what = "A LoRA adapter for" if adapter else "A fine-tuned version of"
    return (
        f"{what} {base_label}" + (" converted" if converted else "") + " with **Interleaved Head Attention** (IHA, "
        f"arXiv 2602.21371), trained with {trainer}. The modeling code is stored next to the weights: load with "
        "`trust_remote_code=True`, or with `import iha`."
    )


def rewrite_trainer_card(folder: str | os.PathLike, base: str) -> Path:
    """Turn the generic card a trainer wrote (TRL's "fine-tuned version of None", a quick start without
    `trust_remote_code`) into an IHA card: the base named (Hub metadata only for a Hub id), how to load it, the
    base's IHA settings. The trainer's other sections (training procedure, versions, citations) are kept, without
    the lines that link outside the folder (tracker badges, the citation's URL): the card points nowhere else."""
    folder = Path(folder)
    card = read_model_card(folder) or ModelCardContent(title=folder.resolve().name)
    hub_base = hub_base_model(base)
    card.metadata.pop("base_model", None)
    if hub_base is not None:
        card.metadata["base_model"] = hub_base
    card.metadata["tags"] = [*DEFAULT_TAGS, *[tag for tag in card.metadata.get("tags", []) if tag not in DEFAULT_TAGS]]
    card.metadata.setdefault("pipeline_tag", "text-generation")
    card.title = f"{folder.resolve().name} (IHA, fine-tuned)"
    card.intro = finetuned_intro(base, trainer="TRL")
    sections = {"How to load": how_to_load_section(str(folder))}
    base_card = read_model_card(base) if Path(str(base)).is_dir() else None
    if base_card is not None and "IHA settings" in base_card.sections:
        sections["IHA settings"] = base_card.sections["IHA settings"]
    for heading, body in card.sections.items():
        kept = "\n".join(line for line in body.splitlines() if "://" not in line).strip()
        if heading != "Quick start" and kept:
            sections[heading] = kept
    card.metadata["license"], sections["License"] = license_card_parts(folder, card_license(base_card), str(base))
    card.sections = sections
    return write_model_card(folder, card)


def trained_dtypes(model) -> str:
    """The dtypes the trainable weights were kept in, the mixing's apart ("bfloat16; mixing float32")."""

    mixing, others = set(), set()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (mixing if is_mixing_parameter(name) else others).add(str(parameter.dtype).removeprefix("torch."))
    text = ", ".join(sorted(others)) or "none"
    return f"{text}; mixing {', '.join(sorted(mixing))}" if mixing else text


def quantization_description(quantization_config) -> str | None:
    """How a model's quantization config (a `model.config.quantization_config`: the object, or its dict) quantizes
    the base, in words ("4-bit nf4, compute dtype float32"); None for none."""
    if quantization_config is None:
        return None
    settings = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    if settings.get("load_in_4bit"):
        compute_dtype = str(settings.get("bnb_4bit_compute_dtype")).removeprefix("torch.")
        nested = ", nested" if settings.get("bnb_4bit_use_double_quant") else ""
        return f"4-bit {settings.get('bnb_4bit_quant_type')}{nested}, compute dtype {compute_dtype}"
    if settings.get("load_in_8bit"):
        return "8-bit (LLM.int8)"
    return str(settings.get("quant_method", "quantized"))


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
        ("data", f"`{source}`" + (f", {num_rows} rows" if num_rows is not None else "")),
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


def write_merged_card(folder: Path, adapter_dir: Path, output_dir: Path) -> None:
    """The card of a merged LoRA output: the adapter's card, loading as a full model from `output_dir`."""
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


__all__ = [
    "finetuned_intro",
    "how_to_load_adapter_section",
    "hub_base_model",
    "quantization_description",
    "rewrite_trainer_card",
    "trained_dtypes",
    "training_card_section",
    "write_merged_card",
    "write_training_card",
]
