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
"""The arguments `iha-sft` adds to TRL's: the model (`ModelArguments`), the data (`DataArguments`) and the IHA
training settings (`IHATrainingArguments`, which `IHASFTConfig` adds to TRL's `SFTConfig`).

Plain dataclasses, without TRL, so that `iha sft --help` lists them without loading TRL (`iha.sft.cli`).
"""

from dataclasses import dataclass, field


# Every Llama-family projection. Attention and MLP adapters are what OpenThoughts-style LoRA recipes train; the
# embeddings and the LM head stay frozen (TRL's fused LM head cannot train an adapter on `lm_head` anyway).
DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class IHATrainingArguments:
    """The training settings `IHASFTConfig` adds to TRL's `SFTConfig` or changes (documented there)."""

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
        metadata={
            "help": "After LoRA training, also write the merged full model to <output_dir>/merged (merged into the "
            "base loaded unquantized, also after QLoRA)."
        },
    )
    # QLoRA: TRL's `ModelConfig` flags, with TRL's names and meaning (bitsandbytes: `pip install "iha-transformers[qlora]"`).
    load_in_4bit: bool = field(
        default=False, metadata={"help": "QLoRA: load the base in 4 bit (bitsandbytes) and train LoRA (--use_peft)."}
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base in 8 bit (bitsandbytes) and train LoRA (--use_peft)."}
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantization type.", "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Quantize the 4-bit scales again."})
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "Storage dtype of the 4-bit weights (e.g. bfloat16 for FSDP-QLoRA)."}
    )

    def __post_init__(self):
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("Choose one of --load_in_4bit and --load_in_8bit.")
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_peft:
            raise ValueError(
                "--load_in_4bit / --load_in_8bit freeze the base in a quantized form: train LoRA adapters on it "
                "with --use_peft (the IHA mixing is trained in full beside them)."
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
