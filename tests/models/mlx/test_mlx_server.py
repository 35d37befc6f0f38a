"""Stock `mlx_lm.server --trust-remote-code` serves an IHA folder that `iha export mlx` prepared: started as a user
starts it (127.0.0.1, a free port, HOME and HF_HOME empty temporary folders, offline), one greedy /v1/completions
request with a text prompt and one greedy /v1/chat/completions request (the folder's ChatML template) answer the
token ids of transformers' `generate()` on the same model and prompt, and the server is stopped (a fixture with a
`finally`). Bounded: two requests of 16 tokens."""

import json
import sys
import urllib.request

import pytest
import torch


pytest.importorskip("mlx_lm")

from testing_utils import (  # noqa: E402
    TINY,
    build_tiny_tokenizer,
    free_port,
    fresh_machine_environment,
    randomize_mixing,
    start_server,
    stop_server,
)

import iha  # noqa: E402
from iha.cli.main import run  # noqa: E402


STARTUP_SECONDS = 300
REQUEST_SECONDS = 120
MAX_TOKENS = 16
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
QUESTION = "How many clips did Natalia sell altogether in April and May?"


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory):
    """A tiny random IHA folder (P = 2, GQA, virtual positions, random mixing) with the tiny GSM8K tokenizer, prepared
    for MLX by the `iha export mlx` command; and the model as transformers loads it from the folder."""
    folder = tmp_path_factory.mktemp("served") / "tiny-iha"
    tokenizer = build_tiny_tokenizer(folder)
    config = iha.IHAConfig(
        **{**TINY, "num_key_value_heads": 2, "vocab_size": len(tokenizer)},
        initializer_range=0.1,  # a wide init: greedy tokens decided by clear margins rather than rounding
        num_pseudo_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = iha.IHAForCausalLM(config).eval()
    randomize_mixing(model, scale=0.5, seed=0)
    model.save_pretrained(folder)
    assert run("export", ["mlx", str(folder)], prog="iha export") == 0
    model = iha.IHAForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, tokenizer, model


@pytest.fixture(scope="module")
def server(served_folder, tmp_path_factory):
    folder, _, _ = served_folder
    port = free_port()
    home = tmp_path_factory.mktemp("machine")
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--trust-remote-code"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log = home / "server.log"
    process = start_server(
        command, cwd=home, env=fresh_machine_environment(home), log=log, port=port, seconds=STARTUP_SECONDS
    )
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        assert stop_server(process), "mlx_lm.server did not stop within 30 s of SIGTERM"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
        return json.load(response)


def reference_greedy(model, input_ids: list[int], eos_token_id: int) -> list[int]:
    """`generate()`'s greedy tokens, ending with the end-of-turn token if it comes (mlx_lm.server stops there too and
    returns it among the answer's tokens)."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([input_ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    return output[0, len(input_ids) :].tolist()


def answer_tokens(response: dict) -> list[int]:
    # With "logprobs": true the server lists each answer token as {"id": ..., "logprob": ...}.
    return [entry["id"] for entry in response["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow
def test_completion_and_chat_answer_what_generate_answers(server, served_folder):
    url, log = server
    folder, tokenizer, model = served_folder
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}

    completion = post(f"{url}/v1/completions", {"prompt": PROMPT, **greedy})
    prompt_ids = tokenizer(PROMPT)["input_ids"]  # the server encodes a text prompt with the folder's tokenizer
    assert completion["usage"]["prompt_tokens"] == len(prompt_ids), log.read_text()[-3000:]
    expected = reference_greedy(model, prompt_ids, tokenizer.eos_token_id)
    assert answer_tokens(completion) == expected
    shown = [token for token in expected if token != tokenizer.eos_token_id]
    assert completion["choices"][0]["text"] == tokenizer.decode(shown)

    messages = [{"role": "user", "content": QUESTION}]
    chat = post(f"{url}/v1/chat/completions", {"messages": messages, **greedy})
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert answer_tokens(chat) == reference_greedy(model, chat_ids, tokenizer.eos_token_id)
