"""Folders and settings the plugin does not serve stop before vLLM starts its engine, with one sentence that says why
(not later, with wrong tokens, nor inside a worker's traceback): the token causal mask, LoRA and another attention
backend with the plugin's sentence, the last line printed when run as a user runs them (`vllm serve FOLDER`,
`LLM(FOLDER)` in a script of their own); a folder written with the retired token window (`iha_window_unit: "token"`)
with its own config's re-convert sentence, raised where vLLM reads the config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm")

from testing_utils import fresh_machine_environment  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from vllm_cases import on_cuda_platform, tiny_gemma3_folder, tiny_iha_folder, vllm_engine  # noqa: E402

from iha.serving.vllm.support import UnsupportedByVLLMError  # noqa: E402


SLIDING_IHA = dict(attention_types=["iha_sliding_attention", "iha_full_attention"], sliding_window=8)
REFUSAL_SECONDS = 300


def token_causal_folder(folder: Path) -> tuple[Path, str]:
    """A folder with the token causal mask, and the sentence its IHA layers refuse vLLM's kernels with."""
    tiny_iha_folder(folder, iha_mask_mode="token_causal")
    config = AutoConfig.from_pretrained(folder)
    return folder, config.layer_spec(config.iha_layer_indices[0]).stock_kernel_refusal("vLLM's paged attention")


def token_window_folder(folder: Path, block: str) -> tuple[Path, str]:
    """A folder of the first versions: sliding IHA layers at P = 2 (Llama's block or Gemma 3's) whose config.json
    records `iha_window_unit: "token"`; and the one-line sentence its config refuses it with, as transformers reads it."""
    tiny_gemma3_folder(folder) if block == "gemma3" else tiny_iha_folder(folder, **SLIDING_IHA)
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "iha_window_unit": "token"}))
    with pytest.raises(ValueError, match=r"iha_window_unit='token'") as refused:
        AutoConfig.from_pretrained(folder)
    sentence = str(refused.value)
    assert "Re-convert the source checkpoint (`iha-convert" in sentence and "\n" not in sentence
    return folder, sentence


def test_token_causal_folder_stops_at_load(tmp_path):
    folder, sentence = token_causal_folder(tmp_path)
    assert "iha_mask_mode='token_causal' needs an explicit mask" in sentence
    with pytest.raises(UnsupportedByVLLMError) as refused:
        with vllm_engine(folder):
            pass
    assert str(refused.value) == sentence


@pytest.mark.parametrize("block", ["llama", "gemma3"])
def test_a_folder_written_with_the_token_window_stops_at_load(tmp_path, block):
    folder, sentence = token_window_folder(tmp_path, block)
    # vLLM builds its config in pydantic, which reports the config's ValueError as a ValidationError (a ValueError).
    with pytest.raises(ValueError) as refused:
        with vllm_engine(folder):
            pass
    assert sentence in str(refused.value)


def test_lora_stops_at_load(tmp_path):
    folder = tiny_iha_folder(tmp_path)
    with pytest.raises(UnsupportedByVLLMError, match="LoRA adapters are not served for IHA models"):
        with vllm_engine(folder, enable_lora=True):
            pass


def failed_output(command: list[str], tmp_path: Path) -> tuple[str, str]:
    """Run `command` as a user would (its own process, vLLM's engine in processes of its own, HOME and HF_HOME
    empty), which must fail before vLLM starts an engine; what it printed (stdout and stderr), and the last line."""
    environment = fresh_machine_environment(tmp_path / "machine")
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vllm_cases runs engines in-process; users do not
    completed = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=REFUSAL_SECONDS,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode != 0, output[-3000:]
    # vLLM's engine process prefixes its log lines with "(EngineCore" and fails with this line.
    assert "Engine core initialization failed" not in output and "(EngineCore" not in output, output[-3000:]
    return output, completed.stderr.strip().splitlines()[-1]


def last_line_of(command: list[str], tmp_path: Path) -> str:
    return failed_output(command, tmp_path)[1]


@pytest.mark.slow
def test_vllm_serve_refuses_with_the_plugins_sentence_last(tmp_path):
    folder, sentence = token_causal_folder(tmp_path / "model")
    vllm_script = Path(sys.executable).parent / "vllm"
    last = last_line_of([str(vllm_script), "serve", str(folder), "--enforce-eager", "--port", "1"], tmp_path)
    assert last == f"iha.serving.vllm.support.UnsupportedByVLLMError: {sentence}"


@pytest.mark.slow
def test_vllm_serve_and_llm_refuse_a_token_window_folder_with_its_configs_sentence(tmp_path):
    """vLLM reads the config inside pydantic, which prints the config's sentence in its ValidationError (with a link
    after it, so not as the last line), before any engine process starts."""
    folder, sentence = token_window_folder(tmp_path / "model", "llama")
    vllm_script = Path(sys.executable).parent / "vllm"
    script = f"from vllm import LLM\nLLM({str(folder)!r}, enforce_eager=True)\n"
    for command in (
        [str(vllm_script), "serve", str(folder), "--enforce-eager", "--port", "1"],
        [sys.executable, "-c", script],
    ):
        output, _ = failed_output(command, tmp_path)
        assert sentence in output, output[-3000:]


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
