"""OpenThoughts-style reasoning SFT of IHA models with TRL: full fine-tuning, LoRA or QLoRA, one process or several;
and the pieces for TRL's other trainers (DPO, GRPO): `with_iha_mixing`, `boxed_answer_reward`, `math_prompt_rows`.

Python:

```python
>>> from iha.training import IHASFTConfig, iha_lora_config, train_sft
>>> args = IHASFTConfig(output_dir="smollm2-iha-sft", max_length=4096, packing=True, mixing_learning_rate=1e-3)
>>> trainer = train_sft("HuggingFaceTB/SmolLM2-135M-Instruct", "open-thoughts/OpenThoughts-114k", args,
...                     iha_options={"num_pseudo_heads": 2})            # a Llama checkpoint is converted on the fly
>>> trainer = train_sft("my-iha-model", "data.jsonl", args, peft_config=iha_lora_config(r=16))   # LoRA
>>> trainer = train_sft("my-iha-model", "data.jsonl", args, peft_config=iha_lora_config(r=16),
...                     quantization_config=BitsAndBytesConfig(load_in_4bit=True))             # QLoRA
>>> dpo = with_iha_mixing(DPOTrainer)(model=policy, ref_model=reference, args=..., train_dataset=pairs,
...                                   mixing_learning_rate=5e-5)                            # any TRL trainer
```

Command line (TRL's `ModelConfig`, `ScriptArguments` and `SFTConfig` flags, parsed by TRL's parser, plus those of
`iha.training.arguments`):

```bash
iha-sft --model_name_or_path my-iha-model --dataset_name open-thoughts/OpenThoughts-114k \
    --output_dir out --max_length 4096 --packing --learning_rate 2e-5 --mixing_learning_rate 1e-3
accelerate launch --config_file examples/accelerate/fsdp.yaml -m iha.cli sft ...   # several processes
```
"""

from ..utils.lazy_imports import lazy_attributes


# Public name -> the module that defines it, imported on first use (`import iha.training` does not import TRL).
_EXPORTS = {
    "DEFAULT_LORA_TARGET_MODULES": "arguments",
    "IHADataArguments": "arguments",
    "IHAModelArguments": "arguments",
    "IHATrainingArguments": "arguments",
    "BASE_RECORD_NAME": "config",
    "MIXING_MODULE_NAME": "config",
    "MIXING_PARAMETER_PATTERN": "config",
    "IHASFTConfig": "config",
    "bf16_supported_here": "config",
    "is_mixing_parameter": "config",
    "has_iha_layers": "model",
    "iha_lora_config": "model",
    "is_iha_model": "model",
    "load_model_for_sft": "model",
    "prepare_tokenizer": "model",
    "resolve_model_source": "model",
    "load_adapter_base": "outputs",
    "load_sft_output": "outputs",
    "merge_lora": "outputs",
    "training_card_section": "card",
    "write_merged_card": "card",
    "write_training_card": "card",
    "boxed_answer_reward": "rewards",
    "completion_text": "rewards",
    "math_prompt_rows": "rewards",
    "save_final_model": "train",
    "train_sft": "train",
    "IHAMixingMixin": "parameter_groups",
    "iha_parameter_groups": "parameter_groups",
    "keep_mixing_in_fp32": "parameter_groups",
    "refuse_mixed_dtypes_under_fsdp": "parameter_groups",
    "with_iha_mixing": "parameter_groups",
    "IHASFTTrainer": "trainer",
    "enable_fsdp_on_cpu": "trainer",
    "own_class_while_saving": "trainer",
}


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
