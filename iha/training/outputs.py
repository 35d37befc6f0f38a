"""Reading what training wrote (full models and LoRA adapters) and merging adapters into full models (their model
cards are `iha.training.card`'s)."""

import json
import os
import shutil
from pathlib import Path

from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..utils.atomic_folders import staged_folder
from ..utils.model_source import looks_like_hub_id
from .card import write_merged_card
from .config import BASE_RECORD_NAME
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
