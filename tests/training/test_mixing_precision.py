"""The mixing stays fp32 under 16-bit weights (package and remote code), so its identity entries learn in bf16; the
forward at identity is unchanged, bit for bit, against the bf16 source."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from bf16_mixing_steps import mixing_dtypes, other_dtypes, train_a_few_steps, unmoved_identity_entries
from safetensors import safe_open
from testing_utils import left_padded_batch, tiny_iha_config, tiny_iha_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import iha
from iha.conversion import convert_checkpoint, llama_to_iha


@pytest.fixture(scope="module")
def identity_folder(tmp_path_factory):
    """A saved tiny IHA model (GQA) at identity mixing, as a converted checkpoint starts."""
    folder = tmp_path_factory.mktemp("identity") / "model"
    tiny_iha_model(randomize=False, num_key_value_heads=2, num_pseudo_heads=2).save_pretrained(folder)
    return folder


def test_mixing_loads_and_builds_in_fp32_under_16_bit_dtypes(identity_folder):
    for dtype in (torch.bfloat16, torch.float16):
        model = AutoModelForCausalLM.from_pretrained(identity_folder, dtype=dtype)
        assert mixing_dtypes(model) == {torch.float32} and other_dtypes(model) == {dtype}, dtype
    built = AutoModelForCausalLM.from_config(tiny_iha_config(), dtype=torch.bfloat16)
    assert mixing_dtypes(built) == {torch.float32} and other_dtypes(built) == {torch.bfloat16}
    assert mixing_dtypes(AutoModelForCausalLM.from_pretrained(identity_folder, dtype=torch.float64)) == {torch.float64}


def test_gemma3_mixing_loads_in_fp32_too(tmp_path):
    from testing_utils import TINY

    config = iha.IHAGemma3Config(**{**TINY, "num_key_value_heads": 2}, query_pre_attn_scalar=12, sliding_window=3)
    iha.IHAGemma3ForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(model) is iha.IHAGemma3ForCausalLM
    assert mixing_dtypes(model) == {torch.float32} and other_dtypes(model) == {torch.bfloat16}
    train_a_few_steps(model)
    assert unmoved_identity_entries(model)[0] == 0


def test_bf16_steps_move_the_identity_entries_and_a_reload_keeps_them(identity_folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(identity_folder, dtype=torch.bfloat16)
    still, total = unmoved_identity_entries(model)
    assert still == total > 0
    train_a_few_steps(model)
    # In bf16 every one of them would have stayed at 1.0 (an update of ~lr is below half the spacing near 1.0).
    assert unmoved_identity_entries(model)[0] == 0
    trained = {name: value.detach().clone() for name, value in model.named_parameters() if ".head_mixing." in name}

    model.save_pretrained(tmp_path / "trained")
    with safe_open(tmp_path / "trained" / "model.safetensors", framework="pt") as weights:
        assert weights.get_tensor("model.layers.0.self_attn.head_mixing.alpha_q").dtype == torch.float32
        assert weights.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        reloaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=dtype).named_parameters())
        for name, value in trained.items():
            assert torch.equal(reloaded[name], value), (dtype, name)


def test_remote_code_keeps_the_mixing_in_fp32_in_a_process_without_iha(identity_folder, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["iha"] = None  # a process that never imports the package: any attempt would fail loudly
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        from transformers import AutoModelForCausalLM
        from bf16_mixing_steps import mixing_dtypes, other_dtypes, train_a_few_steps, unmoved_identity_entries

        model = AutoModelForCausalLM.from_pretrained({str(identity_folder)!r}, dtype=torch.bfloat16,
                                                     trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        print("dtypes", mixing_dtypes(model), other_dtypes(model))
        print("before", *unmoved_identity_entries(model))
        train_a_few_steps(model)
        print("after", *unmoved_identity_entries(model))
        model.save_pretrained({str(tmp_path / "trained")!r})
        reloaded = AutoModelForCausalLM.from_pretrained({str(tmp_path / "trained")!r}, dtype=torch.bfloat16,
                                                        trust_remote_code=True)
        same = all(torch.equal(a, b) for (n, a), b in zip(model.named_parameters(), reloaded.parameters()))
        print("reloaded equal", same)
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["dtypes"] == "{torch.float32} {torch.bfloat16}"
    still, total = map(int, lines["before"].split())
    assert still == total > 0 and lines["after"].startswith("0 ")
    assert lines["reloaded"] == "equal True"


def test_identity_in_bf16_is_unchanged_against_the_bf16_source(tmp_path):
    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(llama_config).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    convert_checkpoint(tmp_path / "llama", tmp_path / "iha", dtype="bfloat16", show_progress=False)
    with safe_open(tmp_path / "iha" / "model.safetensors", framework="pt") as weights:
        assert weights.get_tensor("model.layers.1.self_attn.head_mixing.alpha_v").dtype == torch.float32

    source = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "iha", dtype=torch.bfloat16).eval()
    in_memory = llama_to_iha(source)
    # The mixing in bf16, as it was loaded before it was kept in fp32: the forward must be bit for bit the same.
    bf16_mixing = AutoModelForCausalLM.from_pretrained(tmp_path / "iha", dtype=torch.bfloat16).eval()
    for module in bf16_mixing.modules():
        if isinstance(module, iha.IHAHeadMixing):
            module.to(torch.bfloat16)
    assert mixing_dtypes(converted) == mixing_dtypes(in_memory) == {torch.float32}
    assert mixing_dtypes(bf16_mixing) == {torch.bfloat16}

    source_eager = AutoModelForCausalLM.from_pretrained(
        tmp_path / "llama", dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    input_ids, attention_mask = left_padded_batch(seed=1)
    real = attention_mask.bool()
    with torch.no_grad():
        expected = source(input_ids, attention_mask=attention_mask).logits
        unchanged = bf16_mixing(input_ids, attention_mask=attention_mask).logits
        # bf16 rounding of this model: how far the source moves when only its attention kernel changes.
        tolerance = 4 * (expected - source_eager(input_ids, attention_mask=attention_mask).logits)[real].abs().max()
        for model in (converted, in_memory):
            logits = model(input_ids, attention_mask=attention_mask).logits
            assert torch.equal(logits, unchanged)
            assert (logits - expected)[real].abs().max() <= max(tolerance.item(), 1e-2)


def test_iha_sft_in_bf16_trains_the_identity_entries_with_packing_checkpointing_and_tied_embeddings(tmp_path):
    from testing_utils import QUIET_RUN_FLAGS, build_tiny_tokenizer, gsm8k_message_rows, tiny_llama_for_tokenizer

    from iha.cli.sft import run_cli
    from iha.data.messages import write_jsonl
    from iha.hub.model_card import read_model_card

    llama_dir = tmp_path / "llama"
    tokenizer = build_tiny_tokenizer(llama_dir)
    tiny_llama_for_tokenizer(tokenizer, seed=3).save_pretrained(llama_dir)  # tied embeddings
    write_jsonl(gsm8k_message_rows(16), tmp_path / "train.jsonl")
    output_dir = tmp_path / "bf16"
    trainer = run_cli(
        [
            "--model_name_or_path", str(llama_dir),
            "--iha_options", '{"num_pseudo_heads": 2}',
            "--dtype", "bfloat16",
            "--dataset_name", str(tmp_path / "train.jsonl"),
            "--output_dir", str(output_dir),
            "--max_steps", "3",
            "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-3",
            "--max_length", "256",
            "--packing",
            "--gradient_checkpointing", "true",
            *QUIET_RUN_FLAGS,
        ]
    )  # fmt: skip
    model = trainer.model  # converted on the fly from the bf16 Llama
    assert isinstance(model, iha.IHAForCausalLM) and model.is_gradient_checkpointing and trainer.args.packing
    assert mixing_dtypes(model) == {torch.float32} and other_dtypes(model) == {torch.bfloat16}
    assert unmoved_identity_entries(model)[0] == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "| trained weights | bfloat16; mixing float32 |" in read_model_card(output_dir).sections["Training"]
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.bfloat16)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    trained = dict(model.named_parameters())
    for name, value in reloaded.named_parameters():
        assert torch.equal(value, trained[name]), name


def test_fsdp_refuses_16_bit_weights_beside_the_fp32_mixing(identity_folder):
    from iha.training import refuse_mixed_dtypes_under_fsdp

    # torch's fully_shard asserts one dtype per unit; the trainers of iha.training say so first, with the fix.
    with pytest.raises(ValueError, match=r"weights are bfloat16 and the IHA mixing float32 .* --dtype float32"):
        refuse_mixed_dtypes_under_fsdp(AutoModelForCausalLM.from_pretrained(identity_folder, dtype=torch.bfloat16))
    refuse_mixed_dtypes_under_fsdp(AutoModelForCausalLM.from_pretrained(identity_folder))  # fp32: one dtype
