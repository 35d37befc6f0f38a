"""IHAConfig: defaults, the paper's hybrid layout, serialisation and every validation error."""

import pytest
import torch
from testing_utils import TINY, tiny_iha_config, tiny_iha_model

import iha
from iha import IHAConfig


def test_defaults_are_the_papers_choices():
    config = tiny_iha_config()
    assert config.model_type == "iha"
    assert config.num_pseudo_heads == 2
    assert config.iha_mask_mode == "flat_causal"
    assert config.iha_position_mode == "virtual"
    assert config.iha_collapse_mode == "per_head"
    assert config.iha_collapse_init == "last"
    assert config.attention_types == ["iha_full_attention"] * TINY["num_hidden_layers"]
    assert config.layer_types == ["full_attention"] * TINY["num_hidden_layers"]


def test_sliding_window_makes_iha_sliding_layers_and_sliding_cache_layers():
    config = tiny_iha_config(sliding_window=16)
    assert config.attention_types == ["iha_sliding_attention"] * 2
    assert config.layer_types == ["sliding_attention"] * 2


def test_biases_follow_attention_bias_unless_set():
    assert tiny_iha_config(attention_bias=True).qkv_bias is True
    assert tiny_iha_config(attention_bias=True).o_proj_bias is True
    qwen_style = tiny_iha_config(qkv_bias=True, o_proj_bias=False)
    assert (qwen_style.qkv_bias, qwen_style.o_proj_bias) == (True, False)


def test_paper_hybrid_layout():
    layout = iha.paper_hybrid_layout(num_hidden_layers=10, num_pseudo_heads=2, training_length=4096)
    assert layout["sliding_window"] == 4096 // 8
    expected = ["iha_sliding_attention"] * 4 + ["full_attention"]
    assert layout["attention_types"] == expected * 2
    config = IHAConfig.paper_hybrid(4096, **{**TINY, "num_hidden_layers": 10})
    assert config.attention_types == expected * 2
    assert config.sliding_window == 512
    assert config.layer_types == (["sliding_attention"] * 4 + ["full_attention"]) * 2


def test_round_trip_through_dict_and_json(tmp_path):
    config = tiny_iha_config(
        num_pseudo_heads=3,
        iha_mask_mode="token_causal",
        iha_position_mode="shared",
        iha_collapse_mode="global",
        iha_collapse_init="mean",
        attention_types=["iha_sliding_attention", "full_attention"],
        sliding_window=7,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    config.save_pretrained(tmp_path)
    loaded = IHAConfig.from_pretrained(tmp_path)
    for field in (
        "num_pseudo_heads",
        "iha_mask_mode",
        "iha_position_mode",
        "iha_collapse_mode",
        "iha_collapse_init",
        "attention_types",
        "layer_types",
        "sliding_window",
        "rope_parameters",
    ):
        assert getattr(loaded, field) == getattr(config, field), field


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"iha_mask_mode": "causal"}, r"`iha_mask_mode` must be one of \['flat_causal', 'token_causal'\]"),
        ({"iha_position_mode": "absolute"}, r"`iha_position_mode` must be one of \['virtual', 'shared'\]"),
        ({"iha_collapse_mode": "sum"}, r"`iha_collapse_mode` must be one of \['per_head', 'global'\]"),
        ({"iha_collapse_init": "random"}, r"`iha_collapse_init` must be one of \['last', 'mean', 'first'\]"),
        ({"num_pseudo_heads": 0}, r"`num_pseudo_heads` must be an integer >= 1"),
        ({"attention_types": ["iha_full_attention"]}, r"`attention_types` has 1 entries but `num_hidden_layers` is 2"),
        ({"attention_types": ["iha_full_attention", "mamba"]}, r"`attention_types` entries must be in"),
        ({"attention_types": ["iha_sliding_attention"] * 2}, r"set `sliding_window` to the window in tokens"),
        ({"num_key_value_heads": 3}, r"must be a multiple of `num_key_value_heads`"),
        (
            {"attention_types": ["iha_full_attention"] * 2, "layer_types": ["sliding_attention"] * 2},
            r"`layer_types` .* disagrees with `attention_types`",
        ),
    ],
)
def test_invalid_settings_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_iha_config(**overrides)


def test_hybrid_layout_rejects_too_short_training_length():
    with pytest.raises(ValueError, match="training_length"):
        iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=4, training_length=16)


@pytest.mark.parametrize("training_length", [8, 15])
def test_hybrid_layout_refuses_a_one_token_window(training_length):
    # 2 P^2 <= training_length < 4 P^2 gives a window of one token, which transformers' sliding caches cannot decode.
    with pytest.raises(ValueError, match="sliding layers need at least 2. Use a training length of at least 16"):
        iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=training_length)
    assert iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=16)["sliding_window"] == 2


def test_one_token_sliding_window_is_refused():
    with pytest.raises(ValueError, match=r"an integer >= 2"):
        tiny_iha_config(sliding_window=1)


def test_smallest_window_decodes_like_a_full_forward():
    model = tiny_iha_model(sliding_window=2, num_pseudo_heads=2)
    input_ids = torch.randint(3, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(0))
    generated = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    uncached = model.generate(input_ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(generated, uncached)


def test_no_tensor_parallel_plan():
    # `None` says "no plan" to transformers; an empty dict reads as a plan that matches no parameter.
    assert iha.IHAConfig.base_model_tp_plan is None
    assert tiny_iha_config().base_model_tp_plan is None
