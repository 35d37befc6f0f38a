"""Folders and settings the plugin does not serve stop before vLLM starts its engine, with the plugin's one line (not
later, with wrong tokens, nor inside a worker's traceback): the token causal mask, sliding IHA layers whose window
counts whole tokens (Llama's and Gemma 3's blocks), LoRA, another attention backend. Run as a user runs them (`vllm serve FOLDER`, `LLM(FOLDER)` in a script of
their own), the plugin's sentence is the last line printed."""

import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm")

from testing_utils import TINY, fresh_machine_environment  # noqa: E402
from vllm_cases import on_cuda_platform, tiny_iha_folder, vllm_engine  # noqa: E402

import iha  # noqa: E402
from iha.serving.vllm.support import UnsupportedByVLLMError  # noqa: E402


SLIDING_IHA = dict(attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8)
REFUSAL_SECONDS = 300


def test_token_causal_folder_stops_at_load(tmp_path):
    folder = tiny_iha_folder(tmp_path, iha_mask_mode="token_causal")
    with pytest.raises(UnsupportedByVLLMError, match="iha_mask_mode='token_causal' is not served by vLLM"):
        with vllm_engine(folder):
            pass


def test_sliding_iha_folder_with_a_token_window_stops_at_load(tmp_path):
    folder = tiny_iha_folder(tmp_path, **SLIDING_IHA)
    with pytest.raises(UnsupportedByVLLMError, match=r"Sliding IHA layers \(layers 0\) with iha_window_unit 'token'"):
        with vllm_engine(folder):
            pass


def test_gemma3_folder_with_a_token_window_stops_at_load(tmp_path):
    config = iha.IHAGemma3Config(**{**TINY, "hidden_size": 128, "head_dim": 32}, sliding_window=8)
    config.architectures = ["IHAGemma3ForCausalLM"]
    iha.IHAGemma3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(
        UnsupportedByVLLMError, match=r"Sliding IHA layers \(layers 0, 1\) with iha_window_unit 'token'"
    ):
        with vllm_engine(tmp_path):
            pass


def test_lora_stops_at_load(tmp_path):
    folder = tiny_iha_folder(tmp_path)
    with pytest.raises(UnsupportedByVLLMError, match="LoRA adapters are not served for IHA models"):
        with vllm_engine(folder, enable_lora=True):
            pass


def last_line_of(command: list[str], tmp_path: Path) -> str:
    """Run `command` as a user would (its own process, vLLM's engine in processes of its own, HOME and HF_HOME
    empty), which must fail; the last line it printed."""
    environment = fresh_machine_environment(tmp_path / "machine")
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vllm_cases runs engines in-process; users do not
    completed = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=REFUSAL_SECONDS,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0, output[-3000:]
    assert "Engine core initialization failed" not in output, output[-3000:]
    return completed.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_vllm_serve_refuses_with_the_plugins_sentence_last(tmp_path):
    folder = tiny_iha_folder(tmp_path / "model", **SLIDING_IHA)
    vllm_script = Path(sys.executable).parent / "vllm"
    last = last_line_of([str(vllm_script), "serve", str(folder), "--enforce-eager", "--port", "1"], tmp_path)
    assert last.startswith(
        "iha.serving.vllm.support.UnsupportedByVLLMError: Sliding IHA layers (layers 0) with iha_window_unit 'token'"
    )
    assert last.endswith(
        "serve it with transformers instead: `iha serve FOLDER --continuous_batching` or `generate()`."
    )


@pytest.mark.slow
def test_llm_refuses_another_attention_backend_with_the_plugins_sentence_last(tmp_path):
    folder = tiny_iha_folder(tmp_path / "model")
    script = f"from vllm import LLM\nLLM({str(folder)!r}, enforce_eager=True, attention_backend='FLEX_ATTENTION')\n"
    last = last_line_of([sys.executable, "-c", script], tmp_path)
    served = "FLASH_ATTN" if on_cuda_platform() else "CPU_ATTN"
    assert last == (
        "iha.serving.vllm.support.UnsupportedByVLLMError: IHA layers run on vLLM's CPU_ATTN (CPU) and FLASH_ATTN "
        "(CUDA GPU) attention backends, not FLEX_ATTENTION: leave the attention backend unset or set it to "
        f"{served}."
    )
