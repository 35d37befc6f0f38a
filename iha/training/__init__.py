"""OpenThoughts-style reasoning SFT of IHA models with TRL: full fine-tuning, LoRA or QLoRA, one process or several;
and the pieces for TRL's other trainers (DPO, GRPO): `with_iha_mixing`, `boxed_answer_reward`, `math_prompt_rows`.

Python:

```python
>>> from iha.training import IHAModelConfig, IHAScriptArguments, IHASFTConfig, train_sft
>>> data = IHAScriptArguments(dataset_name="open-thoughts/OpenThoughts-114k")
>>> args = IHASFTConfig(output_dir="smollm2-iha-sft", max_length=4096, packing=True, mixing_learning_rate=1e-3)
>>> trainer = train_sft(data, args, IHAModelConfig(model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
...                                                iha_options={"num_pseudo_heads": 2}))  # converted on the fly
>>> trainer = train_sft(data, args, IHAModelConfig(model_name_or_path="my-iha-model", use_peft=True, lora_r=16))
>>> trainer = train_sft(data, args, IHAModelConfig(model_name_or_path="my-iha-model", use_peft=True,
...                                                load_in_4bit=True))                     # QLoRA
>>> trainer = train_sft(IHAScriptArguments(), args, IHAModelConfig(), model=model, train_dataset=rows,
...                     processing_class=tokenizer)                     # a model and rows already in memory
>>> dpo = with_iha_mixing(DPOTrainer)(model=policy, ref_model=reference, args=..., train_dataset=pairs,
...                                   mixing_learning_rate=5e-5)                            # any TRL trainer
```

`train_sft(script_args, training_args, model_args)` takes the configs TRL's `scripts/sft.py` takes, each with the IHA
settings added; their fields are the flags of `iha-sft`.

Command line (the same configs' flags, parsed by TRL's parser):

```bash
iha-sft --model_name_or_path my-iha-model --dataset_name open-thoughts/OpenThoughts-114k \
    --output_dir out --max_length 4096 --packing --learning_rate 2e-5 --mixing_learning_rate 1e-3
accelerate launch --config_file examples/accelerate/fsdp.yaml -m iha.cli sft ...   # several processes
```
"""

from .config import (
    BASE_RECORD_NAME,
    IHAModelConfig,
    IHAScriptArguments,
    IHASFTConfig,
    bf16_supported_here,
    is_mixing_parameter,
)
from .model import iha_lora_config, iha_peft_config, load_model_for_sft
from .outputs import load_sft_output, merge_lora
from .parameter_groups import IHAMixingMixin, refuse_mixed_dtypes_under_fsdp, with_iha_mixing
from .process_exit import exit_after_deepspeed_run
from .rewards import boxed_answer_reward, math_prompt_rows
from .train import train_sft
from .trainer import IHASFTTrainer


__all__ = [
    "BASE_RECORD_NAME",
    "IHAMixingMixin",
    "IHAModelConfig",
    "IHASFTConfig",
    "IHASFTTrainer",
    "IHAScriptArguments",
    "bf16_supported_here",
    "boxed_answer_reward",
    "exit_after_deepspeed_run",
    "iha_lora_config",
    "iha_peft_config",
    "is_mixing_parameter",
    "load_model_for_sft",
    "load_sft_output",
    "math_prompt_rows",
    "merge_lora",
    "refuse_mixed_dtypes_under_fsdp",
    "train_sft",
    "with_iha_mixing",
]
