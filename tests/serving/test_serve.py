"""`iha serve` end to end: a server on 127.0.0.1 on a free port, a few concurrent greedy /v1/chat/completions
requests through the `openai` client, each answer compared with `generate()` on the same model, then the server is
stopped (a fixture with a `finally`). Bounded in count (3 requests of 12 tokens) and time."""

import concurrent.futures
import os
import sys

import pytest
from server_utils import free_port, start_server, stop_server
from testing_utils import REPO_ROOT, TRAINING_MODEL, tiny_iha_model, tokenizer_settings
from transformers import AutoModelForCausalLM, AutoTokenizer

import iha
from iha.cli import serve


pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

STARTUP_SECONDS = 180
REQUEST_SECONDS = 120
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Tell me a story about a dragon."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_iha_dir(tmp_path_factory):
    """A tiny IHA model (GQA, random mixing, weights large enough for varied greedy text) with SmolLM2's tokenizer
    and chat template."""
    from iha.conversion.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_iha_model(
        **{**TRAINING_MODEL, **tokenizer_settings(tokenizer), "max_position_embeddings": 1024, "initializer_range": 0.2}
    )
    folder = tmp_path_factory.mktemp("tiny-iha")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(params=[True, False], ids=["continuous-batching", "generate"], scope="module")
def server(request, tiny_iha_dir, tmp_path_factory):
    """`iha serve` in its own process, its output in a log file; always stopped (SIGTERM, then killed if it
    lingers). Yields the base URL, whether it batches continuously, and the log."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "iha.cli",
        "serve",
        str(tiny_iha_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += ["--device", "cpu"] + (["--continuous_batching"] if request.param else [])
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    log = tmp_path_factory.mktemp("serve") / "server.log"
    process = start_server(command, REPO_ROOT, environment, log, port, STARTUP_SECONDS)
    try:
        yield f"http://127.0.0.1:{port}", request.param, log
    finally:
        assert stop_server(process), "iha serve did not stop within 30 s of SIGTERM"


def expected_answer(model, tokenizer, question: str) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_concurrent_chat_completions_answer_what_generate_answers(server, tiny_iha_dir):
    url, continuous_batching, log = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)

    def ask(question):
        return client.chat.completions.create(
            model=str(tiny_iha_dir),
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        responses = list(pool.map(ask, QUESTIONS))

    model = AutoModelForCausalLM.from_pretrained(tiny_iha_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_iha_dir)
    answers = [response.choices[0].message.content for response in responses]
    assert answers == [expected_answer(model, tokenizer, question) for question in QUESTIONS]
    assert len(set(answers)) == len(QUESTIONS), "the test model must answer each question differently"
    assert all(response.usage.completion_tokens == MAX_TOKENS for response in responses)
    # The server took the path it was asked for (transformers' server logs it per request).
    assert log.read_text().count(f"CB: {continuous_batching}") == len(QUESTIONS)


def test_a_model_the_server_cannot_load_is_one_line(tmp_path, capsys):
    # A folder without a config: the server never starts, and the command says why in one line.
    status = serve.main([str(tmp_path), "--device", "cpu", "--port", str(free_port())])
    assert status == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha serve: error:") and "\n" not in error


def test_cpu_continuous_batching_gets_a_stated_bounded_cache(tiny_iha_dir, capsys):
    args = serve.make_parser().parse_args([str(tiny_iha_dir), "--continuous_batching", "--device", "cpu"])
    config = iha.IHAConfig.from_pretrained(tiny_iha_dir)
    settings = serve.continuous_batching_settings(args, config, "iha serve")
    page_size = serve.engine_page_size()
    assert settings["cb_num_blocks"] * page_size == serve.CPU_CACHE_TOKENS
    assert settings["cb_max_batch_tokens"] == serve.CPU_MAX_BATCH_TOKENS
    stated = capsys.readouterr().out
    assert f"paged cache of {serve.CPU_CACHE_TOKENS} tokens" in stated
    # Given sizes win.
    args = serve.make_parser().parse_args([str(tiny_iha_dir), "--continuous_batching", "--cb_num_blocks", "3"])
    assert serve.continuous_batching_settings(args, config, "iha serve")["cb_num_blocks"] == 3


def test_the_class_lookup_of_transformers_server_finds_iha(tiny_iha_dir):
    import transformers

    config = iha.IHAConfig.from_pretrained(tiny_iha_dir)
    serve.expose_model_class(config)
    assert getattr(transformers, config.architectures[0]) is iha.IHAForCausalLM
