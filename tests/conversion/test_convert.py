"""Converting Llama-style checkpoints to IHA: exactness, the output folder, the command line and bad input."""

import json
import os
from pathlib import Path

import pytest
import testing_utils
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from testing_utils import TINY_SOURCES, folder_listing, make_source
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
)

import iha
from iha import conversion as convert
from iha.cli import convert as convert_command
from iha.cli.main import run
from iha.conversion import writers
from iha.conversion.options import EXACT_ATOL
from iha.hub.model_card import read_model_card


def random_batch(vocab_size: int) -> dict:
    """Left-padded, and longer than the sliding windows (8) of the tiny Mistral and Qwen2."""
    input_ids, attention_mask = testing_utils.left_padded_batch(vocab_size, seq_len=40, seed=1)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@torch.no_grad()
def max_logit_difference(source_dir, converted_dir, dtype=torch.float32) -> float:
    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=dtype).eval()
    converted = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=dtype).eval()
    assert isinstance(converted, iha.IHAForCausalLM)
    batch = random_batch(source.config.vocab_size)
    valid = batch["attention_mask"].bool()
    return float((converted(**batch).logits - source(**batch).logits)[valid].abs().max())


# ---------------------------------------------------------------------------------------------------------------
# Small random Llama-3 / Llama-2 / Mistral / Qwen2 models
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(TINY_SOURCES))
def test_random_models_convert_exactly(kind, tmp_path):
    source = make_source(kind, tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", show_progress=False)

    assert report.exact and report.function_changes == []
    assert report.verification.passed, report.verification.message
    assert report.verification.max_abs_diff <= EXACT_ATOL
    assert report.verification.top1_agreement == 1.0
    # An independent check on another batch, loading the output the way users do.
    assert max_logit_difference(source, tmp_path / "iha") <= EXACT_ATOL

    source_config = json.loads((source / "config.json").read_text())
    config = json.loads((tmp_path / "iha" / "config.json").read_text())
    assert config["model_type"] == "iha" and config["architectures"] == ["IHAForCausalLM"]
    assert config["rope_parameters"] == source_config["rope_parameters"]
    assert config["tie_word_embeddings"] == source_config["tie_word_embeddings"]
    assert (config["iha_position_mode"], config["iha_mask_mode"], config["iha_collapse_init"]) == (
        "shared",
        "flat_causal",
        "last",
    )
    if kind == "qwen2_sliding":
        assert (config["qkv_bias"], config["o_proj_bias"]) == (True, False)
        assert config["attention_types"] == ["iha_full_attention", "iha_sliding_attention", "iha_sliding_attention"]
        assert config["sliding_window"] == 8
    elif kind == "mistral_sliding":
        assert config["attention_types"] == ["iha_sliding_attention"] * 3 and config["sliding_window"] == 8
    elif kind == "llama_bias":
        assert (config["qkv_bias"], config["o_proj_bias"], config["mlp_bias"]) == (True, True, True)
    else:
        assert config["attention_types"] == ["iha_full_attention"] * 3
    # The window has one meaning (the paper's W * P virtual tokens), so no field records a unit.
    assert "iha_window_unit" not in config


def test_sliding_window_is_exercised_by_the_checks(tmp_path):
    """The Mistral window (8) is shorter than the verification batch: a converter that dropped it would fail."""
    source = make_source("mistral_sliding", tmp_path / "source")
    convert.convert_checkpoint(source, tmp_path / "iha", show_progress=False, verify=False)
    config = json.loads((tmp_path / "iha" / "config.json").read_text())
    config["attention_types"] = ["iha_full_attention"] * 3
    config["sliding_window"] = None
    config.pop("layer_types")
    (tmp_path / "iha" / "config.json").write_text(json.dumps(config))
    assert max_logit_difference(source, tmp_path / "iha") > 1e-3


def test_the_papers_window_converts_a_sliding_source_exactly_and_the_card_names_it(tmp_path):
    source = make_source("mistral_sliding", tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", num_pseudo_heads=3, show_progress=False)
    assert report.exact and report.verification.passed, report.verification.message
    assert report.options == convert.IHAConversionOptions(num_pseudo_heads=3)  # the report keeps the options
    assert max_logit_difference(source, tmp_path / "iha") <= EXACT_ATOL
    card = (tmp_path / "iha" / "README.md").read_text()
    assert (
        "the paper's flat window of 24 virtual tokens; the last pseudo-head of a token sees exactly its last 8" in card
    )


def test_the_window_with_another_collapse_init_is_reported_as_a_change():
    source_config = MistralConfig(**{**testing_utils.TINY, "num_key_value_heads": 2}, sliding_window=8)
    plan = convert.plan_conversion(source_config, collapse_init="mean", mask_mode="token_causal")
    assert any("part of the token just before the source's window" in change for change in plan.function_changes)
    exact = convert.plan_conversion(source_config, mask_mode="token_causal")
    assert exact.function_changes == []


def test_sharded_source_and_sharded_output(tmp_path):
    source = make_source("llama3", tmp_path / "source", max_shard_size="20KB")
    assert (source / "model.safetensors.index.json").is_file()
    report = convert.convert_checkpoint(source, tmp_path / "iha", max_shard_size="20KB", show_progress=False)
    output = tmp_path / "iha"
    assert len(report.weight_files) > 1 and not (output / "model.safetensors").exists()
    index = json.loads((output / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(report.weight_files)
    names_in_files = set()
    for name in report.weight_files:
        with safe_open(output / name, framework="pt") as shard:
            names_in_files.update(shard.keys())
    assert names_in_files == set(index["weight_map"])
    assert "model.layers.2.self_attn.head_mixing.alpha_q" in names_in_files
    assert "lm_head.weight" not in names_in_files  # tied
    assert max_logit_difference(source, output) <= EXACT_ATOL


def test_head_mixing_is_written_at_identity(tmp_path):
    source = make_source("llama3", tmp_path / "source")
    convert.convert_checkpoint(source, tmp_path / "iha", num_pseudo_heads=3, show_progress=False, verify=False)
    with safe_open(tmp_path / "iha" / "model.safetensors", framework="pt") as weights:
        alpha_q = weights.get_tensor("model.layers.0.self_attn.head_mixing.alpha_q")
        alpha_k = weights.get_tensor("model.layers.1.self_attn.head_mixing.alpha_k")
        collapse = weights.get_tensor("model.layers.2.self_attn.head_mixing.collapse")
        source_q = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
    with safe_open(source / "model.safetensors", framework="pt") as weights:
        assert torch.equal(source_q, weights.get_tensor("model.layers.0.self_attn.q_proj.weight"))
    assert torch.equal(alpha_q, torch.eye(4).unsqueeze(-1).expand(4, 4, 3))
    assert torch.equal(alpha_k, torch.eye(2).unsqueeze(-1).expand(2, 2, 3))
    assert torch.equal(collapse, torch.tensor([[0.0, 0.0, 1.0]] * 4))


def test_explicit_layer_list_keeps_the_others_standard_and_stays_exact(tmp_path):
    source = make_source("qwen2_sliding", tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", layers="0,2", show_progress=False)
    assert report.attention_types == ["iha_full_attention", "sliding_attention", "iha_sliding_attention"]
    assert report.exact and report.verification.max_abs_diff <= EXACT_ATOL


def test_bfloat16_output_is_reported_as_a_change(tmp_path):
    source = make_source("llama3", tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", dtype="bfloat16", show_progress=False)
    assert report.function_changes == ["weights are rounded from float32 to bfloat16"]
    assert report.verification.passed and report.verification.tolerance is None
    assert report.verification.max_abs_diff > EXACT_ATOL
    with safe_open(tmp_path / "iha" / "model.safetensors", framework="pt") as weights:
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16
        assert weights.get_tensor("model.layers.0.self_attn.head_mixing.collapse").dtype == torch.float32


def test_llama_to_iha_in_memory():
    torch.manual_seed(0)
    source = TINY_SOURCES["llama3"]().eval()
    batch = random_batch(source.config.vocab_size)
    valid = batch["attention_mask"].bool()

    copied = iha.conversion.llama_to_iha(source)
    shared = iha.conversion.llama_to_iha(source, share_weights=True)
    with torch.no_grad():
        expected = source(**batch).logits[valid]
        for model in (copied, shared):
            assert isinstance(model, iha.IHAForCausalLM)
            assert (model(**batch).logits[valid] - expected).abs().max() <= EXACT_ATOL
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert shared.get_parameter(q_proj).data_ptr() == source.get_parameter(q_proj).data_ptr()
    assert copied.get_parameter(q_proj).data_ptr() != source.get_parameter(q_proj).data_ptr()
    assert copied.lm_head.weight.data_ptr() == copied.model.embed_tokens.weight.data_ptr()  # still tied


def test_virtual_positions_are_flagged_and_measured(tmp_path, caplog):
    source = make_source("llama3", tmp_path / "source")
    with caplog.at_level("WARNING", logger="iha.conversion"):
        report = convert.convert_checkpoint(source, tmp_path / "iha", position_mode="virtual", show_progress=False)
    assert not report.exact
    assert any("virtual positions" in change for change in report.function_changes)
    assert report.verification.passed and report.verification.max_abs_diff > 1e-3
    assert "these settings change what the model computes" in caplog.text
    card = read_model_card(tmp_path / "iha")
    assert "virtual positions" in card.sections["IHA settings"]


def test_hybrid_layout_is_flagged(tmp_path):
    source = make_source("llama3", tmp_path / "source", seed=3)
    report = convert.convert_checkpoint(
        source, tmp_path / "iha", layers="hybrid", training_length=32, show_progress=False
    )
    # 3 layers: none is a 5th layer, so all become sliding IHA with window 32 / (2 * 2^2) = 4 tokens.
    assert report.attention_types == ["iha_sliding_attention"] * 3 and report.sliding_window == 4
    assert report.function_changes == ["layers 0-2 attend to the last 4 tokens (the source: all earlier tokens)"]
    assert report.verification.max_abs_diff > 1e-3


def test_collapse_mean_with_flat_mask_is_flagged_but_token_mask_is_exact(tmp_path):
    source = make_source("llama3", tmp_path / "source")
    flat = convert.plan_conversion(
        AutoModelForCausalLM.from_pretrained(source).config, collapse_init="mean", mask_mode="flat_causal"
    )
    assert not flat.exact and "under-weighted" in flat.function_changes[0]
    report = convert.convert_checkpoint(
        source, tmp_path / "iha", collapse_init="mean", mask_mode="token_causal", show_progress=False
    )
    assert report.exact and report.verification.max_abs_diff <= EXACT_ATOL


# ---------------------------------------------------------------------------------------------------------------
# Command line: success, bad input, warnings
# ---------------------------------------------------------------------------------------------------------------


def test_cli_success(tmp_path, capsys):
    source = make_source("mistral_sliding", tmp_path / "source")
    assert convert_command.main([str(source), str(tmp_path / "iha"), "-P", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "verification: exact" in out and "top-1 agreement 100.00%" in out
    assert "P=3" in out
    expected_files = {"config.json", "configuration_iha.py", "modeling_iha.py", "model.safetensors"}
    assert expected_files <= set(folder_listing(tmp_path / "iha"))
    assert max_logit_difference(source, tmp_path / "iha") <= EXACT_ATOL


def test_cli_unsupported_architecture(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    assert convert_command.main([str(tmp_path / "gpt2"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Unsupported architecture: GPT2LMHeadModel" in err
    for name in convert.SUPPORTED_ARCHITECTURES:
        assert name in err
    assert not (tmp_path / "out").exists()


def save_as_pickle(source: Path) -> Path:
    """Turn a safetensors checkpoint into a pickle-only one (transformers 5 no longer writes .bin itself)."""
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    return source


def test_cli_refuses_pickle_unless_allowed(tmp_path, capsys):
    source = save_as_pickle(make_source("qwen2_sliding", tmp_path / "source"))
    assert convert_command.main([str(source), str(tmp_path / "out")]) == 2
    assert "--allow_pickle" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    assert convert_command.main([str(source), str(tmp_path / "out"), "--allow-pickle", "--quiet"]) == 0
    assert "verification: exact" in capsys.readouterr().out
    assert max_logit_difference(source, tmp_path / "out") <= EXACT_ATOL


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_allowed_pickle_is_still_loaded_weights_only(tmp_path, capsys):
    source = save_as_pickle(make_source("llama3", tmp_path / "source"))
    state_dict = torch.load(source / "pytorch_model.bin", weights_only=True)
    marker = tmp_path / "code-ran"
    state_dict["payload"] = _RunsCodeWhenUnpickled(marker)
    torch.save(state_dict, source / "pytorch_model.bin")

    assert convert_command.main([str(source), str(tmp_path / "out"), "--allow-pickle"]) == 2
    assert "weights_only=True" in capsys.readouterr().err
    assert not marker.exists(), "the pickle's code ran"
    assert not (tmp_path / "out").exists()


def test_cli_never_overwrites_without_the_flag(tmp_path, capsys):
    source = make_source("llama3", tmp_path / "source")
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    assert convert_command.main([str(source), str(output)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert folder_listing(output) == ["notes.txt"] and (output / "notes.txt").read_text() == "mine"

    assert convert_command.main([str(source), str(output), "--overwrite", "--quiet"]) == 0
    assert "notes.txt" not in folder_listing(output) and (output / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failed_conversion_leaves_no_partial_output(tmp_path, capsys):
    source = make_source("llama3", tmp_path / "source")
    with safe_open(source / "model.safetensors", framework="pt") as weights:
        tensors = {name: weights.get_tensor(name) for name in weights.keys() if "layers.2.mlp.up_proj" not in name}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    before = folder_listing(tmp_path)
    assert convert_command.main([str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "missing ['model.layers.2.mlp.up_proj.weight']" in err
    assert folder_listing(tmp_path) == before


def test_interrupted_conversion_leaves_no_partial_output_and_keeps_the_old_one(tmp_path, monkeypatch):
    source = make_source("llama3", tmp_path / "source")
    output = tmp_path / "out"
    convert.convert_checkpoint(source, output, show_progress=False, verify=False)
    old_config = (output / "config.json").read_text()
    listing = folder_listing(tmp_path)

    real_write = writers.write_safetensors_file

    def write_then_interrupt(path, tensors, progress):
        real_write(path, tensors, progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(writers, "write_safetensors_file", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_checkpoint(source, output, num_pseudo_heads=4, overwrite=True, show_progress=False)
    assert folder_listing(tmp_path) == listing  # no temporary folder left next to it
    assert (output / "config.json").read_text() == old_config


def test_cli_failed_verification_exits_nonzero_and_says_what_differed(tmp_path, monkeypatch, capsys):
    source = make_source("llama3", tmp_path / "source")
    real_identity = iha.IHAHeadMixing.identity_tensors

    def off_identity(self):
        tensors = real_identity(self)
        tensors["alpha_v"] = tensors["alpha_v"] * 1.5
        return tensors

    monkeypatch.setattr(iha.IHAHeadMixing, "identity_tensors", off_identity)
    assert convert_command.main([str(source), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Verification failed: NOT exact: max |logit difference|" in err
    assert "exceeds the tolerance 1.0e-05" in err
    assert not (tmp_path / "out").exists()


def test_cli_warns_plainly_about_settings_that_change_the_function(tmp_path, capsys):
    source = make_source("mistral_full", tmp_path / "source")
    assert convert_command.main([str(source), str(tmp_path / "out"), "--position-mode", "virtual", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "WARNING: these settings change what the model computes" in captured.err
    assert "virtual positions" in captured.err
    assert "measured change: max |logit difference|" in captured.err
    assert "verification: changed as intended" in captured.out


def test_cli_bad_layer_list(tmp_path, capsys):
    source = make_source("llama3", tmp_path / "source")
    assert convert_command.main([str(source), str(tmp_path / "out"), "--layers", "0,7"]) == 2
    assert "outside the model's layers 0..2" in capsys.readouterr().err


def test_hub_id_offline_and_not_cached_is_a_clear_error(tmp_path, capsys):
    args = ["someone/not-a-cached-model", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "hub")]
    assert convert_command.main(args) == 2
    err = capsys.readouterr().err
    assert "someone/not-a-cached-model is not a local folder" in err and "HF_HUB_OFFLINE" in err


def test_hub_id_is_served_from_the_hub_cache(tmp_path):
    """The Hub path up to the network: snapshot_download finds the repo in a (hand-made) Hugging Face cache."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_cache = tmp_path / "hub" / "models--someone--tiny-llama"
    make_source("llama3", repo_cache / "snapshots" / commit)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(commit)
    report = convert.convert_checkpoint(
        "someone/tiny-llama", tmp_path / "out", cache_dir=tmp_path / "hub", show_progress=False
    )
    assert report.source == "someone/tiny-llama" and report.exact
    assert read_model_card(tmp_path / "out").metadata["base_model"] == "someone/tiny-llama"


def test_push_to_hub_offline_keeps_the_folder_and_says_how_to_retry(tmp_path, capsys):
    source = make_source("llama3", tmp_path / "source")
    output = tmp_path / "out"
    assert convert_command.main([str(source), str(output), "--quiet", "--push-to-hub", "someone/tiny-iha"]) == 1
    err = capsys.readouterr().err
    assert "Uploading" in err and "someone/tiny-iha" in err and f"iha-convert push {output}" in err
    assert (output / "model.safetensors").is_file()
    # The upload failed, so the folder's card still loads from the folder, not from the repo.
    how_to_load = read_model_card(output).sections["How to load"]
    assert 'from_pretrained("out")' in how_to_load and "someone/tiny-iha" not in how_to_load


def test_push_refuses_a_folder_that_is_not_iha(tmp_path, capsys):
    source = make_source("llama3", tmp_path / "source")
    # `iha-convert push` is routed to `iha push` by the dispatcher, as the console script runs it.
    assert run("convert", ["push", str(source), "someone/x"]) == 2
    assert "not an IHA checkpoint folder" in capsys.readouterr().err
