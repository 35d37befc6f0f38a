"""What the vLLM plugin serves and refuses, on configs alone (`iha.serving.vllm.support`; no vLLM needed): every
refusal is one line naming what is missing."""

import pytest
from testing_utils import TINY, tiny_iha_config

import iha
from iha.serving.vllm.support import (
    TESTED_VLLM_RELEASES,
    UnsupportedByVLLMError,
    check_servable,
    check_vllm_release,
    folds_mixing,
)


def vllm_config(**overrides) -> iha.IHAConfig:
    """A tiny config with a head size vLLM's CPU kernel takes (d = 32)."""
    return tiny_iha_config(**{"hidden_size": 128, "head_dim": 32, **overrides})


def refusal(config, **settings) -> str:
    with pytest.raises(UnsupportedByVLLMError) as error:
        check_servable(config, **settings)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_pseudo_heads": 3, "iha_position_mode": "shared", "iha_collapse_mode": "global"},
        {"num_key_value_heads": 2, "qkv_bias": True, "o_proj_bias": False, "tie_word_embeddings": False},
        {"attention_types": ["full_attention", "iha_full_attention"]},
        {"attention_types": ["sliding_attention", "iha_full_attention"], "sliding_window": 16},
        {"use_qk_norm": True},
        {"no_rope_layers": [1, 0]},
    ],
)
def test_served_layouts(overrides):
    check_servable(vllm_config(**overrides))


def test_tensor_parallelism_is_served_where_the_mixing_folds():
    check_servable(vllm_config(num_key_value_heads=2), tensor_parallel_size=2)
    assert "per-head q/k norm" in refusal(vllm_config(use_qk_norm=True), tensor_parallel_size=2)
    assert "iha_fold_mixing" in refusal(vllm_config(iha_fold_mixing=False), tensor_parallel_size=2)


def test_folding_follows_the_norm_and_the_override():
    assert folds_mixing(vllm_config())
    assert not folds_mixing(vllm_config(use_qk_norm=True))
    assert not folds_mixing(vllm_config(iha_fold_mixing=False))


def test_token_causal_mask_is_refused_with_the_layers_own_sentence():
    """The sentence is the layer's (`IHALayerSpec.stock_kernel_refusal`, written once in layer_iha.py)."""
    config = vllm_config(iha_mask_mode="token_causal", attention_types=["full_attention", "iha_full_attention"])
    message = refusal(config)
    assert message == config.layer_spec(1).stock_kernel_refusal("vLLM's paged attention")
    assert "iha_mask_mode='token_causal'" in message and "--mask_mode flat_causal" in message


def test_token_causal_mask_without_iha_layers_is_plain_attention():
    check_servable(vllm_config(iha_mask_mode="token_causal", attention_types=["full_attention"] * 2))


def test_sliding_iha_layers_are_served():
    """Sliding IHA layers have one window, the paper's flat window of sliding_window * P virtual tokens."""
    check_servable(vllm_config(attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8))
    hybrid = iha.IHAConfig.paper_hybrid(256, **{**TINY, "hidden_size": 128, "head_dim": 32, "num_hidden_layers": 5})
    check_servable(hybrid)


def test_gemma3_folders_are_served():
    gemma3 = iha.IHAGemma3Config(**{**TINY, "hidden_size": 128, "head_dim": 32}, sliding_window=8)
    check_servable(gemma3)
    assert not folds_mixing(gemma3)  # its q/k norm
    assert "per-head q/k norm" in refusal(gemma3, tensor_parallel_size=2)


def test_head_sizes_the_cpu_kernel_lacks_are_refused_on_cpu_only():
    config = tiny_iha_config()  # d = 12
    assert "head_dim 12" in refusal(config, device_type="cpu")
    check_servable(config, device_type="cuda")


def test_float32_is_refused_on_cuda_only():
    """On CUDA the IHA layers run on FlashAttention, which has no float32 kernel; vLLM's CPU backend has one."""
    message = refusal(vllm_config(), device_type="cuda", dtype="float32")
    assert "dtype float32 is not served on CUDA GPUs" in message and "dtype='bfloat16'" in message
    check_servable(vllm_config(), device_type="cuda", dtype="bfloat16")
    check_servable(vllm_config(), device_type="cpu", dtype="float32")
    check_servable(vllm_config(attention_types=["full_attention"] * 2), device_type="cuda", dtype="float32")


def test_context_parallelism_is_refused():
    assert "Context parallelism" in refusal(vllm_config(), device_type="cuda", decode_context_parallel_size=2)
    assert "Context parallelism" in refusal(vllm_config(), device_type="cuda", prefill_context_parallel_size=2)


def test_pipeline_parallelism_is_refused_on_cpu():
    assert "Pipeline parallelism" in refusal(vllm_config(), pipeline_parallel_size=2)


def test_only_the_tested_vllm_releases():
    for release in TESTED_VLLM_RELEASES:
        check_vllm_release(release)
    for untested in ("0.31.0", "0.33.0", "0.35.0"):
        with pytest.raises(UnsupportedByVLLMError, match=rf"this is vLLM {untested}.*pip install 'vllm==0\.34\.0' "):
            check_vllm_release(untested)


def test_a_platform_without_cpu_or_cuda_is_refused():
    """vLLM's CUDA build on a machine without a GPU finds no platform (device type "")."""
    assert "vLLM found neither platform here" in refusal(vllm_config(), device_type="")
