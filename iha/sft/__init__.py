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

Command line (the flags of TRL's `SFTConfig`, plus `ModelArguments` and `DataArguments` of `iha.sft.config`):

```bash
iha-sft --model_name_or_path my-iha-model --dataset_name open-thoughts/OpenThoughts-114k \
    --output_dir out --max_length 4096 --packing --learning_rate 2e-5 --mixing_learning_rate 1e-3
accelerate launch --config_file examples/accelerate/fsdp.yaml -m iha.sft ...   # several processes
```
"""

from .cli import IHA_TRAINING_FLAGS, main, make_parser, parse_args, run_cli
from .config import (
    BASE_RECORD_NAME,
    DEFAULT_LORA_TARGET_MODULES,
    MIXING_MODULE_NAME,
    MIXING_PARAMETER_PATTERN,
    DataArguments,
    IHASFTConfig,
    ModelArguments,
    bf16_supported_here,
    is_mixing_parameter,
)
from .model import (
    has_iha_layers,
    iha_lora_config,
    is_iha_model,
    load_model_for_sft,
    prepare_tokenizer,
    resolve_model_source,
)
from .outputs import (
    load_adapter_base,
    load_sft_output,
    merge_lora,
    training_card_section,
    write_merged_card,
    write_training_card,
)
from .train import save_final_model, train_sft
from .trainer import IHASFTTrainer, enable_fsdp_on_cpu, iha_parameter_groups, own_class_while_saving


__all__ = [
    "BASE_RECORD_NAME",
    "DEFAULT_LORA_TARGET_MODULES",
    "IHA_TRAINING_FLAGS",
    "MIXING_MODULE_NAME",
    "MIXING_PARAMETER_PATTERN",
    "bf16_supported_here",
    "enable_fsdp_on_cpu",
    "has_iha_layers",
    "iha_lora_config",
    "iha_parameter_groups",
    "is_iha_model",
    "is_mixing_parameter",
    "load_adapter_base",
    "load_model_for_sft",
    "load_sft_output",
    "main",
    "make_parser",
    "merge_lora",
    "own_class_while_saving",
    "parse_args",
    "prepare_tokenizer",
    "resolve_model_source",
    "run_cli",
    "save_final_model",
    "train_sft",
    "training_card_section",
    "write_merged_card",
    "write_training_card",
    "DataArguments",
    "IHASFTConfig",
    "IHASFTTrainer",
    "ModelArguments",
]
