"""The real SmolLM2-135M-Instruct converted with the defaults (P = 2, exact: identity mixing) gives the source model's
greedy tokens through stock mlx-lm: its Python API (one prompt, and the prompts batched with padding) and its own
command, `mlx_lm.generate --trust-remote-code`, whose completion is the text transformers' `generate()` gives."""

import os
import subprocess
import sys

import pytest
import torch


pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.utils import load  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from iha import conversion as convert  # noqa: E402
from iha.conversion.builtin import smollm2_dir  # noqa: E402
from iha.export.mlx import add_mlx_model_file  # noqa: E402


pytestmark = pytest.mark.slow
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a cat.",
    "Explain in two sentences why the sky is blue.",
)
STEPS = 24


@pytest.fixture(scope="module")
def smollm2_mlx(tmp_path_factory):
    """The converted folder with the MLX model file, the source's chat prompts and its greedy tokens (float32)."""
    source = smollm2_dir()
    folder = tmp_path_factory.mktemp("smollm2") / "smollm2-iha"
    convert.convert_checkpoint(source, folder, verify=False, show_progress=False)
    add_mlx_model_file(folder)
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        for text in PROMPTS
    ]
    prompts = [list(p["input_ids"]) if not isinstance(p, list) else p for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            output = model.generate(
                torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            expected.append(output[0, len(ids) :].tolist())
    return folder, tokenizer, prompts, expected


def test_mlx_lm_gives_the_sources_greedy_tokens(smollm2_mlx):
    folder, _, prompts, expected = smollm2_mlx
    model, _ = load(str(folder), model_config={}, tokenizer_config={}, trust_remote_code=True)
    for ids, tokens in zip(prompts, expected):
        assert [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=STEPS)] == tokens

    generator = BatchGenerator(model, stop_tokens=[], max_tokens=STEPS)
    uids = generator.insert(prompts, [STEPS] * len(prompts))
    batched = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            batched[response.uid].append(int(response.token))
    generator.close()
    assert [batched[uid] for uid in uids] == expected


def test_mlx_lm_generate_command_prints_generates_completion(smollm2_mlx, tmp_path):
    folder, tokenizer, prompts, expected = smollm2_mlx
    env = {**os.environ, "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(folder), "--trust-remote-code"]
    command += ["--prompt", PROMPTS[0], "--max-tokens", str(STEPS), "--temp", "0"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # mlx_lm.generate prints the completion between two lines of "=", stopping at the end-of-turn token.
    completion = result.stdout.split("==========")[1].strip()
    tokens = expected[0]
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    assert completion == tokenizer.decode(tokens, skip_special_tokens=True).strip()
