"""What Qwen3, SmolLM3 and Gemma 3 add around IHA's attention: per-head q/k norms, layers without RoPE, Gemma 3's
block, scale and RoPE base per layer type; each against the plain reference, through the caches and the configs."""

import json

import pytest
import torch
from testing_utils import TINY, generation_position_ids, greedy_without_cache, left_padded_batch, randomize_mixing

import iha
from iha.models.iha.naive_iha import reference_forward


SIZES = {**TINY, "num_hidden_layers": 3, "head_dim": 16}
ARCHITECTURES = {
    # Qwen3: q/k norm, head_dim 16 apart from hidden / heads (12); an IHA sliding layer and a standard full one.
    "qwen3": lambda **settings: iha.IHAConfig(
        **{
            **SIZES,
            "use_qk_norm": True,
            "attention_types": ["iha_full_attention", "iha_sliding_attention", "full_attention"],
            "sliding_window": 3,
            **settings,
        }
    ),
    # SmolLM3: the middle layer has no RoPE (and slides, as SmolLM3's NoPE layers do); tied embeddings.
    "smollm3": lambda **settings: iha.IHAConfig(
        **{
            **SIZES,
            "no_rope_layers": [1, 0, 1],
            "attention_types": ["iha_full_attention", "iha_sliding_attention", "iha_full_attention"],
            "sliding_window": 3,
            "tie_word_embeddings": True,
            **settings,
        }
    ),
    # Gemma 3: two sliding layers then a full one (its RoPE base differs), its own scale.
    "gemma3": lambda **settings: iha.IHAGemma3Config(
        **{**SIZES, "query_pre_attn_scalar": 12, "sliding_window": 3, "sliding_window_pattern": 3, **settings}
    ),
}


def tiny_model(architecture: str, seed: int = 0, **settings):
    """A tiny IHA model of `architecture` whose every weight, norms included, is away from its initial value."""
    config = ARCHITECTURES[architecture](**settings)
    causal_lm_class = iha.IHAGemma3ForCausalLM if architecture == "gemma3" else iha.IHAForCausalLM
    torch.manual_seed(seed)
    model = causal_lm_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".head_mixing." not in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return randomize_mixing(model, seed=seed)


MODES = [  # (mask, positions, collapse, P)
    ("flat_causal", "shared", "per_head", 3),
    ("token_causal", "virtual", "global", 2),
]


@pytest.mark.parametrize("num_key_value_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: "-".join(map(str, mode)))
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_model_matches_reference(architecture, mode, num_key_value_heads):
    mask_mode, position_mode, collapse_mode, num_pseudo = mode
    model = tiny_model(
        architecture,
        num_key_value_heads=num_key_value_heads,
        num_pseudo_heads=num_pseudo,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
        iha_collapse_mode=collapse_mode,
    ).double()
    input_ids, attention_mask = left_padded_batch(seq_len=12)  # longer than the window of 3 tokens
    position_ids = generation_position_ids(attention_mask)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        expected = reference_forward(model, input_ids, attention_mask, position_ids)
    real = attention_mask.bool()
    # transformers' rotary embeddings compute cos and sin in float32 even in a float64 model, the reference in float64:
    # that alone moves these logits by up to 1.2e-6 (Gemma 3, P = 3; 0.0 against a reference with float32 RoPE).
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache_mode", ["token", "pseudo"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_cached_generation_matches_uncached(architecture, cache_mode):
    model = tiny_model(architecture, num_key_value_heads=2, num_pseudo_heads=2, iha_cache_mode=cache_mode)
    input_ids, attention_mask = left_padded_batch(seq_len=7)
    steps = 8  # past the window of 3 tokens, so the sliding cache drops tokens
    expected = greedy_without_cache(model, input_ids, attention_mask, steps)
    common = dict(attention_mask=attention_mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids, **common), expected)
    assert torch.equal(model.generate(input_ids, cache_implementation="static", **common), expected)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_an_empty_input_is_refused_with_one_clear_error_on_forward_and_generate(architecture):
    # Without the check the attention fails reshaping an empty sequence, with a message about tensor shapes.
    model = tiny_model(architecture)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="IHA got an input of 0 tokens: give at least one token"):
        model(empty)
    with pytest.raises(ValueError, match="IHA got an input of 0 tokens"):
        model.generate(empty, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_gemma3_gradients_reach_mixing_and_norms_and_checkpointing_gives_the_same():
    input_ids, attention_mask = left_padded_batch(seq_len=12)
    gradients = []
    for checkpointing in (False, True):
        model = tiny_model("gemma3", num_pseudo_heads=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
        gradients.append({name: parameter.grad.clone() for name, parameter in model.named_parameters()})
    plain, checkpointed = gradients
    for name in ("model.layers.0.self_attn.head_mixing.alpha_q", "model.layers.2.self_attn.k_norm.weight"):
        assert plain[name].abs().max() > 0, name
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


# --- configs ------------------------------------------------------------------------------------------------------


def test_gemma3_config_keeps_gemmas_layout_with_iha_layers():
    config = iha.IHAGemma3Config(**{**SIZES, "num_hidden_layers": 7}, sliding_window=4)
    assert config.attention_types == ["iha_sliding_attention"] * 5 + ["iha_full_attention", "iha_sliding_attention"]
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert set(config.rope_parameters) == {"sliding_attention", "full_attention"}
    from_layer_types = iha.IHAGemma3Config(**SIZES, layer_types=["full_attention"] * 3)
    assert from_layer_types.attention_types == ["iha_full_attention"] * 3


def test_gemma3_config_round_trip(tmp_path):
    config = ARCHITECTURES["gemma3"](num_pseudo_heads=3, iha_mask_mode="token_causal", iha_position_mode="shared")
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "iha_gemma3"
    loaded = iha.IHAGemma3Config.from_pretrained(tmp_path)
    for field in ("num_pseudo_heads", "iha_mask_mode", "iha_position_mode", "attention_types", "layer_types"):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.rope_parameters == config.rope_parameters and loaded.query_pre_attn_scalar == 12


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"final_logit_softcapping": 30.0},
            r"`final_logit_softcapping` is 30.0, but IHA Gemma 3 models support only None",
        ),
        ({"attn_logit_softcapping": 50.0}, r"`attn_logit_softcapping` is 50.0"),
        ({"use_bidirectional_attention": True}, r"`use_bidirectional_attention` is True"),
        ({"iha_mask_mode": "causal"}, r"`iha_mask_mode` must be one of"),
        ({"attention_types": ["iha_full_attention"] * 2}, r"`attention_types` has 2 entries"),
    ],
)
def test_gemma3_config_refuses_what_it_cannot_compute(settings, message):
    with pytest.raises(ValueError, match=message):
        iha.IHAGemma3Config(**SIZES, **settings)


@pytest.mark.parametrize(
    "no_rope_layers, message",
    [([1, 0], r"`no_rope_layers` has 2 entries but `num_hidden_layers` is 3"), ([1, 2, 1], r"must be 1 \(RoPE\)")],
)
def test_no_rope_layers_are_checked(no_rope_layers, message):
    with pytest.raises(ValueError, match=message):
        iha.IHAConfig(**SIZES, no_rope_layers=no_rope_layers)


def test_both_model_types_are_registered():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    assert iha.IHA_MODEL_TYPES == (iha.IHAConfig.model_type, iha.IHAGemma3Config.model_type)
    config = AutoConfig.for_model("iha_gemma3", **SIZES)
    assert type(config) is iha.IHAGemma3Config
    assert type(AutoModelForCausalLM.from_config(config)) is iha.IHAGemma3ForCausalLM
    assert type(AutoModel.from_config(config)) is iha.IHAGemma3TextModel
