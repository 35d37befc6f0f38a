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


def test_token_causal_mask_is_refused():
    message = refusal(vllm_config(iha_mask_mode="token_causal"))
    assert "iha_mask_mode='token_causal'" in message and "iha serve" in message


def test_token_causal_mask_without_iha_layers_is_plain_attention():
    check_servable(vllm_config(iha_mask_mode="token_causal", attention_types=["full_attention"] * 2))


def test_sliding_iha_layers_with_the_flat_window_are_served():
    check_servable(
        vllm_config(
            attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8, iha_window_unit="virtual"
        )
    )
    hybrid = iha.IHAConfig.paper_hybrid(
        256, **{**TINY, "hidden_size": 128, "head_dim": 32, "num_hidden_layers": 5}, iha_window_unit="virtual"
    )
    check_servable(hybrid)


def test_sliding_iha_layers_with_a_token_window_are_refused():
    """Today's token window (the function of every folder written before `iha_window_unit` existed)."""
    config = vllm_config(attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8)
    message = refusal(config)
    assert "Sliding IHA layers (layers 0) with iha_window_unit 'token'" in message
    assert "iha-convert" in message and "iha serve" in message
    hybrid = iha.IHAConfig.paper_hybrid(256, **{**TINY, "hidden_size": 128, "head_dim": 32, "num_hidden_layers": 5})
    hybrid.iha_window_unit = "token"
    assert "layers 0, 1, 2, 3" in refusal(hybrid)


def test_gemma3_folders_are_served_with_the_flat_window():
    gemma3 = dict(**{**TINY, "hidden_size": 128, "head_dim": 32}, sliding_window=8)
    check_servable(iha.IHAGemma3Config(**gemma3, iha_window_unit="virtual"))
    assert "with iha_window_unit 'token'" in refusal(iha.IHAGemma3Config(**gemma3, iha_window_unit="token"))
    assert not folds_mixing(iha.IHAGemma3Config(**gemma3, iha_window_unit="virtual"))  # its q/k norm
    assert "per-head q/k norm" in refusal(
        iha.IHAGemma3Config(**gemma3, iha_window_unit="virtual"), tensor_parallel_size=2
    )


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
