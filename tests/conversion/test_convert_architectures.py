"""Converting Qwen3, SmolLM3 and Gemma 3 checkpoints: tiny random models of transformers' own classes convert
exactly (MHA and GQA, padded batches longer than their windows, every rope type, cached greedy generation), load
through remote code in a process without `iha`, and every config field IHA cannot carry is refused by name."""

import json
import textwrap
from pathlib import Path

import pytest
import testing_utils
import torch
import transformers
from huggingface_hub.dataclasses import strict
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import iha
from iha import conversion as convert
from iha.cli import convert as convert_command
from iha.conversion.options import EXACT_ATOL


# SmolLM3's default special tokens lie outside a tiny vocabulary: every source gets these.
TINY = {**testing_utils.TINY, "num_hidden_layers": 3, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1}
WINDOW = 8
TINY_SOURCES = {
    # Qwen3, MHA, head_dim 16 (hidden / heads is 12), untied head.
    "qwen3_mha": lambda: Qwen3ForCausalLM(Qwen3Config(**{**TINY, "num_key_value_heads": 4}, head_dim=16)),
    # Qwen3, GQA, sliding layers from max_window_layers on, tied embeddings.
    "qwen3_sliding": lambda: Qwen3ForCausalLM(
        Qwen3Config(
            **TINY,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        )
    ),
    # SmolLM3, GQA, its default NoPE pattern (every 3rd layer here), tied embeddings.
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**TINY, no_rope_layer_interval=3)),
    # SmolLM3, MHA, the NoPE layer slides, biases on, untied head.
    "smollm3_sliding": lambda: SmolLM3ForCausalLM(
        SmolLM3Config(
            **{**TINY, "num_key_value_heads": 4},
            no_rope_layers=[1, 0, 1],
            use_sliding_window=True,
            sliding_window=WINDOW,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        )
    ),
    # Gemma 3: two sliding layers and a full one, one KV head (like the 270M), its scale apart from head_dim.
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            **{**TINY, "num_key_value_heads": 1},
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=WINDOW,
            sliding_window_pattern=3,
        )
    ),
}


def perturbed(model):
    """Every weight, norms and biases included, away from its initial value (Gemma's norms start at zero)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def make_source(kind: str, folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    perturbed(TINY_SOURCES[kind]()).save_pretrained(folder)
    return folder


def random_batch(vocab_size: int) -> dict:
    """Left-padded, and longer than the sliding window of 8 tokens."""
    input_ids, attention_mask = testing_utils.left_padded_batch(vocab_size, seq_len=40, seed=1)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


EXPECTED_CONFIG = {
    "qwen3_mha": {"model_type": "iha", "use_qk_norm": True, "head_dim": 16, "tie_word_embeddings": False},
    "qwen3_sliding": {
        "use_qk_norm": True,
        "attention_types": ["iha_full_attention", "iha_sliding_attention", "iha_sliding_attention"],
        "sliding_window": WINDOW,
        "tie_word_embeddings": True,
    },
    "smollm3": {"use_qk_norm": False, "no_rope_layers": [1, 1, 0], "tie_word_embeddings": True},
    "smollm3_sliding": {
        "no_rope_layers": [1, 0, 1],
        "attention_types": ["iha_full_attention", "iha_sliding_attention", "iha_full_attention"],
        "qkv_bias": True,
        "o_proj_bias": True,
        "mlp_bias": True,
    },
    "gemma3": {
        "model_type": "iha_gemma3",
        "architectures": ["IHAGemma3ForCausalLM"],
        "attention_types": ["iha_sliding_attention", "iha_sliding_attention", "iha_full_attention"],
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 12,
        "auto_map": {
            "AutoConfig": "configuration_iha_gemma3.IHAGemma3Config",
            "AutoModel": "modeling_iha_gemma3.IHAGemma3TextModel",
            "AutoModelForCausalLM": "modeling_iha_gemma3.IHAGemma3ForCausalLM",
        },
    },
}


@pytest.mark.parametrize("kind", sorted(TINY_SOURCES))
def test_tiny_models_convert_exactly_and_generate_the_same(kind, tmp_path):
    source_dir = make_source(kind, tmp_path / "source")
    report = convert.convert_checkpoint(source_dir, tmp_path / "iha", num_pseudo_heads=3, show_progress=False)
    assert report.exact and report.verification.passed, report.verification.message
    assert report.verification.max_abs_diff <= EXACT_ATOL

    config = json.loads((tmp_path / "iha" / "config.json").read_text())
    for name, value in EXPECTED_CONFIG[kind].items():
        assert config[name] == value, name
    source_config = json.loads((source_dir / "config.json").read_text())
    assert config["rope_parameters"] == source_config["rope_parameters"]

    # An independent check, loading both folders the way users do: logits on a padded batch past the window, and
    # greedy tokens with the cache (decoding past the window too).
    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "iha", dtype=torch.float32).eval()
    assert type(converted) is (iha.IHAGemma3ForCausalLM if kind == "gemma3" else iha.IHAForCausalLM)
    batch = random_batch(source.config.vocab_size)
    valid = batch["attention_mask"].bool()
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert (converted(**batch).logits - source(**batch).logits)[valid].abs().max() <= EXACT_ATOL
        assert torch.equal(converted.generate(**batch, **greedy), source.generate(**batch, **greedy))


def test_gemma3_layer_list_keeps_the_other_layers_standard_with_their_rope_base(tmp_path):
    source = make_source("gemma3", tmp_path / "source")
    report = convert.convert_checkpoint(source, tmp_path / "iha", layers="0,2", show_progress=False)
    assert report.attention_types == ["iha_sliding_attention", "sliding_attention", "iha_full_attention"]
    assert report.exact and report.verification.max_abs_diff <= EXACT_ATOL


# --- every rope type ------------------------------------------------------------------------------------------------

# Parameters of every rope type transformers offers, for head_dim 16; `original_max_position_embeddings` (and, for
# dynamic, max_position_embeddings = 32) below the 40-token batch, so that each scaling takes effect.
ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


def test_the_rope_types_tested_are_all_that_transformers_offers():
    # A release that adds a rope type must add it to the test, not convert it untested.
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} <= set(ROPE_PARAMETERS)


ROPE_SOURCES = {
    "qwen3": lambda rope: Qwen3ForCausalLM(
        Qwen3Config(**{**TINY, "max_position_embeddings": 32}, head_dim=16, rope_parameters=rope)
    ),
    "smollm3": lambda rope: SmolLM3ForCausalLM(  # head_dim 16 from hidden / heads, as SmolLM3 derives it
        SmolLM3Config(
            **{**TINY, "hidden_size": 64, "max_position_embeddings": 32}, no_rope_layer_interval=3, rope_parameters=rope
        )
    ),
    # Gemma 3 keeps RoPE parameters per layer type; its larger checkpoints scale the full layers' only (linear, 8).
    "gemma3": lambda rope: Gemma3ForCausalLM(
        Gemma3TextConfig(
            **{**TINY, "max_position_embeddings": 32},
            head_dim=16,
            sliding_window=WINDOW,
            sliding_window_pattern=3,
            rope_parameters={"full_attention": rope, "sliding_attention": dict(ROPE_PARAMETERS["default"])},
        )
    ),
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
@pytest.mark.parametrize("architecture", sorted(ROPE_SOURCES))
def test_every_rope_type_converts_exactly(architecture, rope_type):
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        pytest.skip(f"transformers {transformers.__version__} has no {rope_type} rope type")
    torch.manual_seed(0)
    source = perturbed(ROPE_SOURCES[architecture](dict(ROPE_PARAMETERS[rope_type])))
    converted = convert.llama_to_iha(source, num_pseudo_heads=2)
    assert type(converted) is (iha.IHAGemma3ForCausalLM if architecture == "gemma3" else iha.IHAForCausalLM)
    assert converted.config.rope_parameters == source.config.rope_parameters
    batch = random_batch(source.config.vocab_size)
    valid = batch["attention_mask"].bool()
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert (converted(**batch).logits - source(**batch).logits)[valid].abs().max() <= EXACT_ATOL
        assert torch.equal(converted.generate(**batch, **greedy), source.generate(**batch, **greedy))


# --- remote code ----------------------------------------------------------------------------------------------------

REMOTE_CODE_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["iha"] = None  # a process that never imports the package: any attempt fails loudly
    import torch
    from transformers import AutoModelForCausalLM

    expected = torch.load(sys.argv[1])
    for folder, outputs in expected["folders"].items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            logits = model(**expected["batch"]).logits
            tokens = model.generate(**expected["batch"], max_new_tokens=12, do_sample=False, pad_token_id=0)
        difference = (logits - outputs["logits"])[expected["batch"]["attention_mask"].bool()].abs().max().item()
        print("RESULT", folder, type(model).__name__, difference, torch.equal(tokens, outputs["tokens"]), flush=True)
    """
)


def test_converted_folders_load_through_remote_code_in_a_process_without_iha(tmp_path):
    batch = random_batch(testing_utils.TINY["vocab_size"])
    expected = {"batch": batch, "folders": {}}
    for kind in ("qwen3_sliding", "smollm3_sliding", "gemma3"):
        source_dir = make_source(kind, tmp_path / kind)
        output = tmp_path / f"{kind}-iha"
        convert.convert_checkpoint(source_dir, output, verify=False, show_progress=False)
        source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expected["folders"][str(output)] = {
                "logits": source(**batch).logits,
                "tokens": source.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0),
            }
    torch.save(expected, tmp_path / "expected.pt")
    completed = testing_utils.run_without_the_project(REMOTE_CODE_CHILD, str(tmp_path / "expected.pt"), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = [line.split()[1:] for line in completed.stdout.splitlines() if line.startswith("RESULT")]
    assert [class_name for _, class_name, _, _ in results] == [
        "IHAForCausalLM",
        "IHAForCausalLM",
        "IHAGemma3ForCausalLM",
    ]
    for folder, _, difference, tokens_equal in results:
        assert float(difference) <= EXACT_ATOL and tokens_equal == "True", folder


# --- refusals -------------------------------------------------------------------------------------------------------


def refusal(config) -> str:
    with pytest.raises(convert.ConversionError) as error:
        convert.plan_conversion(config)
    return str(error.value)


def test_gemma3_settings_iha_cannot_compute_are_refused_by_name(tmp_path, capsys):
    torch.manual_seed(0)
    config = Gemma3TextConfig(**TINY, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=30.0)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path / "source")
    assert convert_command.main([str(tmp_path / "source"), str(tmp_path / "out")]) == 2
    assert "`final_logit_softcapping` = 30.0; IHA Gemma 3 models support only None" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    gemma3 = Gemma3ForCausalLM(Gemma3TextConfig(**TINY, head_dim=16, sliding_window=WINDOW)).config
    gemma3.attn_logit_softcapping = 50.0
    assert "`attn_logit_softcapping` = 50.0" in refusal(gemma3)
    with pytest.raises(convert.ConversionError, match="--layers hybrid would move Gemma 3 layers"):
        convert.plan_conversion(Gemma3TextConfig(**TINY, head_dim=16), layers="hybrid")


def test_sliding_layers_without_a_window_are_refused():
    qwen3 = Qwen3Config(**TINY, layer_types=["full_attention", "sliding_attention", "full_attention"])
    qwen3.architectures = ["Qwen3ForCausalLM"]
    assert "marks layers 1 'sliding_attention' but `sliding_window` is None" in refusal(qwen3)
    smollm3 = SmolLM3Config(
        **TINY, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "sliding_attention"]
    )
    smollm3.architectures = ["SmolLM3ForCausalLM"]
    assert "marks layers 1-2 'sliding_attention' but `use_sliding_window` is false" in refusal(smollm3)


def test_a_config_field_the_converter_does_not_know_is_refused_unless_at_its_default():
    @strict
    class NewerQwen3Config(Qwen3Config):  # what a later transformers release could add
        attention_sink_size: int = 0

    assert convert.plan_conversion(NewerQwen3Config(**TINY, architectures=["Qwen3ForCausalLM"])).exact
    newer = NewerQwen3Config(**TINY, architectures=["Qwen3ForCausalLM"], attention_sink_size=4)
    assert "sets `attention_sink_size` = 4 (default 0), a field of NewerQwen3Config that iha does not know" in refusal(
        newer
    )


def test_multimodal_gemma3_is_refused_with_what_converts():
    config = Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(convert.UnsupportedArchitectureError) as error:
        convert.plan_conversion(config)
    message = str(error.value)
    assert message.startswith("Unsupported architecture: Gemma3ForConditionalGeneration.")
    for name in convert.SUPPORTED_ARCHITECTURES:
        assert name in message
