"""QLoRA with `iha-sft` and TRL's quantization flags on CPU (bitsandbytes): the base quantized, the mixing trained in
full and in fp32, the adapter saved, reloaded on the same quantized base and merged into the unquantized one."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import (
    QUIET_RUN_FLAGS,
    TRAINING_MODEL,
    build_tiny_tokenizer,
    gsm8k_message_rows,
    identity_mixing,
    mixing_parameters,
    tiny_iha_model,
    tiny_llama_for_tokenizer,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM

import iha
from iha.cli.sft import run_cli
from iha.data.messages import write_jsonl
from iha.hub.model_card import read_model_card
from iha.training import (
    BASE_RECORD_NAME,
    IHAModelConfig,
    IHAScriptArguments,
    IHASFTConfig,
    is_mixing_parameter,
    load_sft_output,
    train_sft,
)


bitsandbytes = pytest.importorskip("bitsandbytes")

MAX_LENGTH = 256


def logits(model, input_ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def base_layer_class(model) -> str:
    """The class of the first q_proj's base layer under PEFT (Linear4bit, Linear8bitLt or Linear)."""
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    return type(getattr(q_proj, "base_layer", q_proj)).__name__


def assert_mixing_trained_in_fp32(model):
    identity = identity_mixing(model)
    trained = mixing_parameters(model)
    assert len(trained) == 8 and {value.dtype for value in trained.values()} == {torch.float32}
    for name, value in trained.items():
        assert (value - identity[name]).abs().max() > 1e-3, name
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert any("lora_A" in name for name in trainable)
    assert all("lora_" in name or is_mixing_parameter(name) for name in trainable)


def test_qlora_4bit_on_a_llama_converted_on_the_fly_saves_reloads_and_merges(tmp_path):
    llama_dir = tmp_path / "llama"
    tokenizer = build_tiny_tokenizer(llama_dir)
    # Widths that are multiples of bitsandbytes' 4-bit block (64): on a CPU with AVX512-BF16, a Linear4bit in eval
    # mode repacks its weight for a fused kernel that needs each input width to hold whole blocks (the default tiny
    # width, 32, failed there with a reshape error in bitsandbytes 0.50.2; real models' widths are multiples of 64).
    tiny_llama_for_tokenizer(tokenizer, seed=3, hidden_size=64, intermediate_size=128).save_pretrained(llama_dir)
    write_jsonl(gsm8k_message_rows(16), tmp_path / "train.jsonl")
    output_dir = tmp_path / "qlora"
    trainer = run_cli(
        [
            "--model_name_or_path", str(llama_dir),
            "--iha_options", '{"num_pseudo_heads": 2}',
            "--dataset_name", str(tmp_path / "train.jsonl"),
            "--output_dir", str(output_dir),
            "--use_peft", "--load_in_4bit",
            "--lora_r", "8",
            "--max_steps", "4",
            "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-2",
            "--mixing_learning_rate", "3e-2",
            "--max_length", str(MAX_LENGTH),
            "--packing",
            "--gradient_checkpointing", "true",
            *QUIET_RUN_FLAGS,
            "--merge_adapter",
        ]
    )  # fmt: skip
    model = trainer.model
    assert isinstance(model.get_base_model(), iha.IHAForCausalLM) and base_layer_class(model) == "Linear4bit"
    # Packing, gradient checkpointing and the tied LM head (an embedding: never quantized) under QLoRA.
    assert trainer.args.packing and model.get_base_model().is_gradient_checkpointing
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight and base.lm_head.weight.dtype == torch.float32
    history = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 4 and all(math.isfinite(loss) for loss in history)
    # TRL casts a quantized model's trainable weights to bf16: the adapters are, the mixing is kept in fp32.
    assert_mixing_trained_in_fp32(model)

    saved = load_file(output_dir / "adapter_model.safetensors")
    saved_mixing = {name: tensor for name, tensor in saved.items() if is_mixing_parameter(name)}
    assert len(saved_mixing) == 8 and {tensor.dtype for tensor in saved_mixing.values()} == {torch.float32}
    record = json.loads((output_dir / BASE_RECORD_NAME).read_text())
    assert record["converted_to_iha"] and record["quantization_config"]["load_in_4bit"]
    card = read_model_card(output_dir).sections["Training"]
    assert "QLoRA" in card and "4-bit nf4" in card and "mixing float32" in card

    input_ids = torch.tensor([tokenizer.encode("Weng earns 12/60 = $0.2 per minute.")])
    # PEFT loads adapters in fp32 (their saved bf16 values exactly): compute the trained model's LoRA branch in fp32
    # too, so that what is compared is the weights.
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    expected = logits(model, input_ids)
    # Reloaded: the recorded base, converted and quantized again the same way, gives the trained model's outputs.
    reloaded = load_sft_output(output_dir)
    assert base_layer_class(reloaded) == "Linear4bit"
    torch.testing.assert_close(logits(reloaded, input_ids), expected, rtol=0, atol=1e-5)
    # Merged (PEFT's rule for a quantized base would re-quantize the sum; here the base is loaded unquantized): the
    # merged folder computes what the adapter computes on the unquantized base, mixing included.
    on_full_base = load_sft_output(output_dir, quantization_config=None)
    assert base_layer_class(on_full_base) == "Linear"
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged")
    torch.testing.assert_close(logits(merged, input_ids), logits(on_full_base, input_ids), rtol=0, atol=1e-5)
    for name, value in mixing_parameters(model).items():
        assert torch.equal(merged.get_parameter(name), value), name
    # The merge changed the base (or the comparison above would prove nothing).
    with on_full_base.disable_adapter():
        assert (logits(on_full_base, input_ids) - logits(merged, input_ids)).abs().max() > 1e-3


def test_8bit_lora_trains_an_iha_folder(tmp_path):
    base_dir = tmp_path / "base"
    tokenizer = build_tiny_tokenizer(base_dir)
    tiny_iha_model(seed=1, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer)).save_pretrained(base_dir)
    args = IHASFTConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        mixing_learning_rate=3e-2, max_length=MAX_LENGTH, packing=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    rows = gsm8k_message_rows(16)
    with pytest.raises(ValueError, match="with --use_peft"):
        IHAModelConfig(model_name_or_path=str(base_dir), load_in_8bit=True)
    model_args = IHAModelConfig(model_name_or_path=str(base_dir), use_peft=True, lora_r=8, load_in_8bit=True)
    trainer = train_sft(IHAScriptArguments(), args, model_args, train_dataset=rows)
    assert base_layer_class(trainer.model) == "Linear8bitLt"
    assert_mixing_trained_in_fp32(trainer.model)
    assert "8-bit" in read_model_card(tmp_path / "out").sections["Training"]


def test_quantization_without_lora_is_refused_on_the_command_line(capsys):
    from iha.cli.sft import main

    assert main(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--load_in_4bit"]) == 2
    assert "with --use_peft" in capsys.readouterr().err
