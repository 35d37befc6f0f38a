"""Folders the plugin does not serve stop when vLLM builds the model, with the plugin's one line (not later, with
wrong tokens): the token causal mask, sliding IHA layers, Gemma 3's block."""

import pytest


pytest.importorskip("vllm")

from testing_utils import TINY  # noqa: E402
from vllm_cases import tiny_iha_folder, vllm_engine  # noqa: E402

import iha  # noqa: E402
from iha.serving.vllm.support import UnsupportedByVLLMError  # noqa: E402


def test_token_causal_folder_stops_at_load(tmp_path):
    folder = tiny_iha_folder(tmp_path, iha_mask_mode="token_causal")
    with pytest.raises(UnsupportedByVLLMError, match="iha_mask_mode='token_causal' is not served by vLLM"):
        with vllm_engine(folder):
            pass


def test_sliding_iha_folder_stops_at_load(tmp_path):
    folder = tiny_iha_folder(
        tmp_path, attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8
    )
    with pytest.raises(UnsupportedByVLLMError, match=r"Sliding IHA layers \(layers 0\) are not served"):
        with vllm_engine(folder):
            pass


def test_gemma3_folder_stops_at_load(tmp_path):
    config = iha.IHAGemma3Config(**{**TINY, "hidden_size": 128, "head_dim": 32}, sliding_window=8)
    config.architectures = ["IHAGemma3ForCausalLM"]
    iha.IHAGemma3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedByVLLMError, match="IHA Gemma 3 folders are not served"):
        with vllm_engine(tmp_path):
            pass
