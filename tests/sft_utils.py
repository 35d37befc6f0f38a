"""Offline pieces for the SFT tests: a tiny ChatML tokenizer trained on GSM8K text and the size of their tiny IHA
models (built by `conftest.tiny_iha_model`).

SmolLM2's 49k-token vocabulary makes the LM head dominate a tiny model's step on CPU; a 1k-token byte-level BPE
trained on the same GSM8K -> OpenThoughts rows keeps the tests fast while using SmolLM2's exact chat template and
special tokens.
"""

import socket
from pathlib import Path

import torch
from conftest import SHARED_DATA
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import iha
from iha.chat_templates import SMOLLM2_CHAT_TEMPLATE
from iha.gsm8k import gsm8k_file_to_openthoughts, read_gsm8k_rows


GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# `iha-sft` flags of a short test run: a loss every step, no trackers, checkpoints or progress bars.
QUIET_RUN_FLAGS = ["--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def free_port() -> int:
    """A TCP port free now, for `accelerate launch --main_process_port` (the default 29500 is shared by every run)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def gsm8k_openthoughts_rows(limit: int = 64) -> list[dict]:
    return gsm8k_file_to_openthoughts(GSM8K_TRAIN, limit=limit)


def gsm8k_message_rows(limit: int = 16) -> list[dict]:
    """GSM8K question -> worked solution as `messages` rows: a few hundred tokens each, no system prompt, for the
    shortest runs."""

    return [
        {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}
        for row in read_gsm8k_rows(GSM8K_TRAIN, limit=limit)
    ]


def build_tiny_tokenizer(save_dir: str | Path | None = None, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on 300 GSM8K rows in OpenThoughts format, SmolLM2's ChatML template and specials."""
    rows = gsm8k_openthoughts_rows(300)
    texts = [row["system"] for row in rows] + [turn["value"] for row in rows for turn in row["conversations"]]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


# The tiny IHA model of the training tests (GQA, tied embeddings), on top of `conftest.TINY` and sized to the
# tokenizer: `tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))`.
TRAINING_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_key_value_heads=2,
    num_pseudo_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def mixing_parameters(model) -> dict[str, torch.Tensor]:
    """name -> value of every mixing coefficient / collapse weight, names without PEFT's wrapper parts (on the CPU,
    like `identity_mixing`'s, wherever the model is)."""
    found = {}
    for name, parameter in model.named_parameters():
        if ".head_mixing." in name and "original_module" not in name:
            found[name.replace("modules_to_save.default.", "").replace("base_model.model.", "")] = (
                parameter.detach().cpu().clone()
            )
    return found


def identity_mixing(model) -> dict[str, torch.Tensor]:
    """The identity value of every mixing parameter of `model`, keyed like `mixing_parameters`."""
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, iha.IHAHeadMixing) and "original_module" not in module_name:
            prefix = module_name.replace("modules_to_save.default", "").replace("base_model.model.", "").rstrip(".")
            for name, value in module.identity_tensors().items():
                found[f"{prefix}.{name}"] = value
    return found
