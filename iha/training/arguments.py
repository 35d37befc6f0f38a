"""The arguments the package adds to TRL's own: to `ModelConfig` (`IHAModelArguments`, in `IHAModelConfig`), to
`ScriptArguments` (`IHADataArguments`, in `IHAScriptArguments`) and to `SFTConfig` (`IHATrainingArguments`, in
`IHASFTConfig`); the three configs are `iha.training.config`'s.

TRL owns the flags it declares (`--model_name_or_path`, `--dtype`, `--use_peft`, `--lora_r`, `--load_in_4bit`,
`--dataset_name`, `--learning_rate`, ...); each setting added here says "(iha)" first in `iha-sft --help`.
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
            "help": "(iha) Learning rate of the IHA mixing coefficients and collapse weights (default: learning_rate)."
        },
    )
    mixing_weight_decay: float = field(
        default=0.0,
        metadata={
            "help": "(iha) Weight decay of the IHA mixing parameters (decay pulls them to zero, not to identity)."
        },
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={
            "help": "(iha default: true; TRL's: false) Compute the loss on the assistant turns only (needs "
            "{%% generation %%} markers, added here)."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "(iha default) bf16 mixed precision. Not set: on (TRL's default) on a bf16-capable GPU/XPU/NPU "
            "or with --use_cpu true; off where TRL's default would fail (no such accelerator, no --use_cpu)."
        },
    )


@dataclass
class IHAModelArguments:
    """What `IHAModelConfig` adds to TRL's `ModelConfig` (the model, its dtype and attention, the LoRA and
    quantization settings are TRL's)."""

    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "(iha) Tokenizer (default: the model's)."}
    )
    convert_to_iha: bool = field(
        default=True,
        metadata={
            "help": "(iha) Convert a non-IHA (Llama-style) checkpoint to IHA before training. False trains it as is."
        },
    )
    # A dict from Python, its JSON text from the command line (`IHAModelConfig` reads the text into a dict).
    iha_options: dict | str | None = field(
        default=None,
        metadata={
            "help": "(iha) JSON object of iha.conversion.IHAConversionOptions, e.g. '{\"num_pseudo_heads\": 2}'."
        },
    )
    merge_adapter: bool = field(
        default=False,
        metadata={
            "help": "(iha) After LoRA training, also write the merged full model to <output_dir>/merged (merged into "
            "the base loaded unquantized, also after QLoRA)."
        },
    )


@dataclass
class IHADataArguments:
    """What `IHAScriptArguments` adds to TRL's `ScriptArguments`. Any schema of `iha.data.messages`
    (OpenThoughts-114k, OpenThoughts3, messages, prompt/completion)."""

    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "(iha) Evaluation rows (Hub id or local file), with --eval_strategy."}
    )
    default_system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "(iha) System prompt for rows that have none; 'openthoughts' means the OpenThoughts-114k prompt "
            "(useful for OpenThoughts3, which has no system column)."
        },
    )
    max_train_rows: int | None = field(default=None, metadata={"help": "(iha) Use only the first N rows."})
    filter_long_rows: bool = field(
        default=True,
        metadata={"help": "(iha) Drop rows longer than max_length tokens instead of truncating their reasoning."},
    )
