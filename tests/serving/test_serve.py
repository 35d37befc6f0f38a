"""`iha serve` as a server people leave running, tried the way clients meet it, on a fresh machine.

Three servers, each in its own process on 127.0.0.1 on a free port, with HOME and HF_HOME pointed at empty folders
(no Hugging Face cache), offline, a tiny random IHA model with SmolLM2's tokenizer and chat template, and faults a
request can set off inside the model's forward (`testing_utils.FAULTY_SERVER`: a token pair that raises, one that holds
the forward until the test releases it):

- `generate_server`: `generate()`, an API key, `--max_model_len 64`, 16 requests at once;
- `batching_server`: continuous batching on a paged cache of 512 tokens (2 blocks: smaller than the model's context);
- `sampling_server`: the same with per-request sampling (`--cb_sampling`);
- `timeout_server`: `generate()` with a request timeout of 2 s.

Each is started once for the tests that share it and always stopped (a fixture with a `finally`); the last test of
the first two stops its server with a signal, with a request in flight. Requests are bounded (12 new tokens, at most
17 at once). Answers are compared with `generate()` on the same model in this process, token for token, never timed.
"""

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from testing_utils import (
    FAULTY_SERVER,
    REPO_ROOT,
    TRAINING_MODEL,
    EventStream,
    free_port,
    fresh_machine_environment,
    request,
    restore_ctrl_c,
    start_server,
    stop_server,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

import iha
from iha.cli import serve as serve_command
from iha.conversion.builtin import smollm2_dir
from iha.serving import server as serve
from iha.serving.admission import exposure_warning, is_local_address
from iha.serving.limits import token_limit


pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

STARTUP_SECONDS = 300
REQUEST_SECONDS = 300
MAX_TOKENS = 12
API_KEY = "iha-test-key"
MODEL_NAME = "tiny-iha"  # how the servers are given the model: a folder relative to their working directory
# Sixteen different chat requests (the load tests send them at once).
QUESTIONS = [f"Question {index}: what is {index} + {index + 3}?" for index in range(16)]
CONTEXT = 1024  # the tiny model's max_position_embeddings
GENERATE_MAX_MODEL_LEN = 64
BATCHING_BLOCKS = 2  # of 256 tokens: a paged cache of 512, less than the context
TIMEOUT = 2  # seconds, the request timeout of `timeout_server`
# What a load of 16 requests may add to the batching server's memory beyond its paged cache (Python objects, the
# allocator, per-forward activations of at most 512 tokens): unbounded growth, as a prompt beyond the cache made
# before the limits (2.7 GB), is what this catches.
MEMORY_SLACK_MIB = 128


@pytest.fixture(scope="module")
def model_parent(tmp_path_factory) -> Path:
    """A folder holding `tiny-iha`: a tiny IHA model (GQA, random mixing, weights large enough for varied greedy
    text) with SmolLM2's tokenizer and chat template."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_iha_model(
        **{
            **TRAINING_MODEL,
            **tokenizer_settings(tokenizer),
            "max_position_embeddings": CONTEXT,
            "initializer_range": 0.2,
        }
    )
    parent = tmp_path_factory.mktemp("models")
    model.save_pretrained(parent / MODEL_NAME)
    tokenizer.save_pretrained(parent / MODEL_NAME)
    return parent


@pytest.fixture(scope="module")
def model_dir(model_parent) -> Path:
    return model_parent / MODEL_NAME


@pytest.fixture(scope="module")
def fault_tokens(model_dir) -> dict:
    """The token ids whose pairs set off the faults (the vocabulary's last two: never a pair in these prompts)."""
    vocab_size = iha.IHAConfig.from_pretrained(model_dir).vocab_size
    return {"raise": vocab_size - 1, "hold": vocab_size - 2}


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """question -> the greedy answer of `generate()` on the model in this process, each question alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = {}
    for question in QUESTIONS:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers[question] = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(set(answers.values())) >= 12, "the test model must answer the questions differently"
    return answers


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path
    release: Path
    key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, key: str | None = "server's") -> dict:
        key = self.key if key == "server's" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body=None, raw: bytes | None = None, key: str | None = "server's"):
        return request("POST", self.url + path, body, self.headers(key), raw=raw, timeout=REQUEST_SECONDS)

    def get(self, path: str, key: str | None = "server's"):
        return request("GET", self.url + path, headers=self.headers(key), timeout=REQUEST_SECONDS)

    def health(self) -> dict:
        return self.get("/health")[2]

    def client(self, key: str | None = "server's"):
        key = self.key if key == "server's" else key
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", timeout=REQUEST_SECONDS, max_retries=0)

    def stream(self, path: str, body: dict) -> EventStream:
        return EventStream(self.port, path, {**body, "stream": True}, self.headers(), timeout=REQUEST_SECONDS)

    def wait_for(self, condition, what: str, attempts: int = 600) -> dict:
        """Poll /health until `condition(health)` (bounded: 600 polls of 0.1 s), and return it."""
        import time

        for _ in range(attempts):
            health = request("GET", self.url + "/health", timeout=REQUEST_SECONDS)[2]
            if condition(health):
                return health
            time.sleep(0.1)
        raise AssertionError(f"the server never got to {what}: {health}\n{self.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def launch(model_parent, fault_tokens, tmp_path_factory):
    """launch(name, flags, key=None): `iha serve tiny-iha FLAGS` with the faults, on a fresh machine; every server
    launched is stopped after the module."""
    processes = []

    def start(name: str, flags: list[str], key: str | None = None) -> Server:
        folder = tmp_path_factory.mktemp(name)
        port = free_port()
        release = folder / "release"
        variables = {
            "PYTHONPATH": str(REPO_ROOT),
            "IHA_TEST_RAISE_TOKEN": str(fault_tokens["raise"]),
            "IHA_TEST_HOLD_TOKEN": str(fault_tokens["hold"]),
            "IHA_TEST_RELEASE": str(release),
        }
        if key is not None:
            variables["IHA_API_KEY"] = key
        command = [sys.executable, "-c", FAULTY_SERVER, "serve", MODEL_NAME, "--host", "127.0.0.1"]
        command += ["--port", str(port), "--device", "cpu", *flags]
        log = folder / "server.log"
        environment = fresh_machine_environment(folder, **variables)
        process = start_server(
            command, model_parent, environment, log, port, STARTUP_SECONDS, preexec_fn=restore_ctrl_c
        )
        processes.append(process)
        return Server(process, port, log, release, key)

    try:
        yield start
    finally:
        for process in processes:
            assert stop_server(process), "iha serve did not stop within 30 s of SIGTERM"


@pytest.fixture(scope="module")
def generate_server(launch) -> Server:
    flags = ["--max_model_len", str(GENERATE_MAX_MODEL_LEN), "--max_concurrent_requests", "16"]
    return launch("generate", flags, key=API_KEY)


@pytest.fixture(scope="module")
def batching_server(launch) -> Server:
    return launch("batching", ["--continuous_batching", "--cb_num_blocks", str(BATCHING_BLOCKS)])


@pytest.fixture(scope="module")
def sampling_server(launch) -> Server:
    return launch("sampling", ["--continuous_batching", "--cb_sampling", "--cb_num_blocks", str(BATCHING_BLOCKS)])


@pytest.fixture(scope="module")
def timeout_server(launch) -> Server:
    return launch("timeout", ["--request_timeout", str(TIMEOUT)])


def chat(question: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS, **fields}


def assert_error(answer, status: int, param=None, code=None, words: tuple[str, ...] = ()) -> dict:
    """The answer is `status` with an OpenAI error object (message, type, param, code) naming `param` / `code`."""
    got_status, _headers, body = answer
    assert got_status == status, answer
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    if param is not None:
        assert error["param"] == param, body
    if code is not None:
        assert error["code"] == code, body
    for word in words:
        assert word in error["message"], (word, body)
    return error


def ask_all(server: Server, questions: list[str], **fields) -> list:
    client = server.client()

    def ask(question):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, **fields
        )

    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def streamed_text(events: list[str], kind: str = "chat") -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    if kind == "chat":
        return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    return "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])


def children_of(server: Server) -> list:
    return psutil.Process(server.process.pid).children(recursive=True)


def peak_memory_kib(pid: int) -> tuple[int, int]:
    """(resident now, resident at its peak) of a process, in KiB (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


# --- the listing, the model's names, health -------------------------------------------------------------------------


def test_the_model_listing_works_without_a_hugging_face_cache(generate_server, model_dir):
    client = generate_server.client()
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL_NAME]
    (model,) = models
    assert model.object == "model" and model.owned_by == "local"
    assert model.created == int((model_dir / "config.json").stat().st_mtime)
    assert model.model_extra["max_model_len"] == GENERATE_MAX_MODEL_LEN
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert client.models.retrieve(str(model_dir)).id == MODEL_NAME  # another spelling of the folder
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("some-other-model")
    assert missing.value.body["code"] == "model_not_found"
    # The server's HOME and HF_HOME stayed empty: nothing was downloaded or cached.
    home = generate_server.log.parent
    assert not list((home / "hf_home").iterdir()) and not list((home / "home").iterdir())


@pytest.mark.parametrize("spelling", ["{name}", "./{name}", "{name}/", "{absolute}", "{absolute}/../{name}", None])
def test_requests_name_the_model_in_any_spelling_and_replies_name_it_as_given(
    generate_server, model_dir, reference, spelling
):
    question = QUESTIONS[0]
    body = chat(question)
    if spelling is not None:
        body["model"] = spelling.format(name=MODEL_NAME, absolute=model_dir)
    status, _, answer = generate_server.post("/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["model"] == MODEL_NAME
    assert answer["choices"][0]["message"]["content"] == reference[question]


def test_an_unknown_model_is_a_404_naming_the_served_one(generate_server):
    error = assert_error(
        generate_server.post("/v1/chat/completions", chat("hi", model="gpt-4o")), 404, "model", "model_not_found"
    )
    assert "gpt-4o" in error["message"] and MODEL_NAME in error["message"]
    with pytest.raises(openai.NotFoundError):
        generate_server.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_health_says_what_serves(generate_server, batching_server):
    health = generate_server.health()
    assert health["status"] == "ok" and health["engine"] == "generate" and health["model"] == MODEL_NAME
    assert health["max_model_len"] == GENERATE_MAX_MODEL_LEN
    health = batching_server.health()
    assert health["status"] == "ok" and health["engine"] == "continuous batching"
    assert health["paged_cache"]["tokens"] == health["max_model_len"] == BATCHING_BLOCKS * serve.engine_page_size()


# --- the API key ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no key", "wrong key"])
def test_requests_without_the_key_get_401(generate_server, key):
    for answer in (
        generate_server.post("/v1/chat/completions", chat("hi"), key=key),
        generate_server.get("/v1/models", key=key),
    ):
        assert_error(answer, 401, code="invalid_api_key", words=("Authorization: Bearer",))
        assert answer[1]["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        generate_server.client(key=key).models.list()
    assert request("GET", generate_server.url + "/health")[0] == 200  # open, for supervisors


def test_listening_beyond_this_machine_without_a_key_warns(tmp_path, capsys):
    assert is_local_address("localhost") and is_local_address("127.0.0.1") and is_local_address("::1")
    assert not is_local_address("0.0.0.0") and not is_local_address("192.168.1.20")
    assert exposure_warning("127.0.0.1", None, "iha serve") is None
    assert exposure_warning("0.0.0.0", "a key", "iha serve") is None
    # The command prints it before anything else (here a folder without a model, which then fails in one line).
    assert serve_command.main([str(tmp_path), "--host", "0.0.0.0", "--port", str(free_port())]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert (
        lines[0].startswith("iha serve: warning: listening on 0.0.0.0 without an API key") and "IHA_API_KEY" in lines[0]
    )
    assert lines[1].startswith("iha serve: error:")


# --- bad requests -----------------------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (endpoint, body, param, code)
    ("chat", {"messages": HI, "temperature": "hot"}, "temperature", "invalid_type"),
    ("chat", {"messages": HI, "temperature": -1}, "temperature", "decimal_below_min_value"),
    ("chat", {"messages": HI, "temperature": 2.5}, "temperature", "decimal_above_max_value"),
    ("chat", {"messages": HI, "top_p": 0}, "top_p", "decimal_below_min_value"),
    ("chat", {"messages": HI, "top_p": 1.5}, "top_p", "decimal_above_max_value"),
    ("chat", {"messages": HI, "max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ("chat", {"messages": HI, "max_tokens": -1}, "max_tokens", "integer_below_min_value"),
    ("chat", {"messages": HI, "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ("chat", {"messages": HI, "max_tokens": True}, "max_tokens", "invalid_type"),
    ("chat", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value"),
    ("chat", {"messages": HI, "n": 0}, "n", "integer_below_min_value"),
    ("chat", {"messages": HI, "n": 2}, "n", "unsupported_parameter"),
    ("chat", {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
    ("chat", {"messages": HI, "stop": [""]}, "stop", "empty_string"),
    ("chat", {"messages": HI, "stop": 3}, "stop", "invalid_type"),
    ("chat", {"messages": HI, "stream": "yes"}, "stream", "invalid_type"),
    ("chat", {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("chat", {"messages": HI, "logprobs": True}, "logprobs", "unsupported_parameter"),
    ("chat", {"messages": HI, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    ("chat", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ("chat", {"messages": HI, "response_format": {"type": "json_object"}}, "response_format", None),
    ("chat", {"messages": HI, "temprature": 0}, "temprature", "unknown_parameter"),
    ("chat", {"max_tokens": 3}, "messages", "missing_required_parameter"),
    ("chat", {"messages": "hi"}, "messages", "invalid_type"),
    ("chat", {"messages": []}, "messages", "empty_array"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role", "unsupported_parameter"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ("chat", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "mood": "ok"}]}, "messages[0].mood", "unknown_parameter"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
        "unsupported_value",
    ),
    ("chat", {"messages": HI, "model": 3}, "model", "invalid_type"),
    ("completion", {"max_tokens": 3}, "prompt", "missing_required_parameter"),
    ("completion", {"prompt": ["one", "two"]}, "prompt", "unsupported_value"),
    ("completion", {"prompt": {"text": "hi"}}, "prompt", "invalid_type"),
    ("completion", {"prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
    ("completion", {"prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter"),
    ("completion", {"prompt": [5, 10**9]}, "prompt[1]", "invalid_value"),
    ("completion", {"prompt": ""}, "prompt", "empty_prompt"),
    ("completion", {"prompt": []}, "prompt", "empty_prompt"),
]


@pytest.mark.parametrize(
    "endpoint, body, param, code", BAD_REQUESTS, ids=[f"{e}-{json.dumps(b)[:60]}" for e, b, _, _ in BAD_REQUESTS]
)
def test_a_bad_request_is_a_400_naming_the_field_and_the_rule(generate_server, endpoint, body, param, code):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    error = assert_error(generate_server.post(path, body), 400, param, code)
    assert error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]
    assert generate_server.health()["engine_requests"] == 0  # refused before any work


def test_the_openai_client_reads_the_errors(generate_server):
    client = generate_server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=3)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "messages"
    assert "empty array" in bad.value.message


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', ("not valid JSON",)),
        (b"\xff\xfe", ("not valid JSON",)),
        (b'["hi"]', ("JSON object", "an array")),
        (b'"hi"', ("JSON object", "a string")),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400(generate_server, raw, words):
    assert_error(generate_server.post("/v1/chat/completions", raw=raw), 400, None, "invalid_json", words)


def test_unknown_routes_and_methods_answer_in_the_same_shape(generate_server):
    assert_error(generate_server.get("/v1/nothing"), 404, code="not_found")
    assert_error(request("DELETE", generate_server.url + "/v1/models", headers=generate_server.headers()), 405)


# --- limits -----------------------------------------------------------------------------------------------------------


def test_token_limit_is_the_smallest_bound():
    assert token_limit(8192, None, None).tokens == 8192
    assert token_limit(8192, 4096, None) == token_limit(8192, 4096, 8192)
    limit = token_limit(8192, None, 2048)
    assert limit.tokens == 2048 and "paged cache" in limit.reason
    with pytest.raises(ValueError, match="more than the model's context of 8192"):
        token_limit(8192, 10000, None)


def test_a_prompt_over_the_limit_is_refused_at_once_with_the_numbers(generate_server):
    long_prompt = " ".join(["word"] * 12000)
    error = assert_error(
        generate_server.post("/v1/chat/completions", chat(long_prompt)), 400, "messages", "context_length_exceeded"
    )
    assert f"at most {GENERATE_MAX_MODEL_LEN} tokens per request" in error["message"]
    prompt_tokens = int(re.search(r"asks for \d+: (\d+) in the prompt", error["message"]).group(1))
    assert prompt_tokens > 12000
    # Fits alone, but not with the completion asked for.
    error = assert_error(
        generate_server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 100}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert "4 in the prompt and 100 for the completion" in error["message"] and "at most 60" in error["message"]
    assert generate_server.health()["status"] == "ok"


def test_max_tokens_left_out_is_what_the_limit_leaves(generate_server):
    status, _, answer = generate_server.post("/v1/completions", {"prompt": "Once upon a time"})
    assert status == 200, answer
    usage = answer["usage"]
    assert usage["prompt_tokens"] == 4
    if answer["choices"][0]["finish_reason"] == "length":
        assert usage["total_tokens"] == GENERATE_MAX_MODEL_LEN
    else:  # an end-of-sequence token came first
        assert usage["total_tokens"] < GENERATE_MAX_MODEL_LEN


def test_max_model_len_over_the_context_stops_the_command_before_loading(model_dir, capsys):
    assert serve_command.main([str(model_dir), "--max_model_len", "5000", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha serve: error: --max_model_len 5000 is more than the model's context of 1024")
    assert "\n" not in error


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--port", "99999"], "argument --port: expected a port number from 1 to 65535, not '99999'"),
        (["--port", "0"], "argument --port: expected a port number from 1 to 65535, not '0'"),
        (["--cb_num_blocks", "0"], "--cb-num-blocks: expected a whole number of at least 1, not '0'"),
        (
            ["--cb_max_memory_percent", "90"],
            "--cb-max-memory-percent: expected a number above 0 and at most 1",
        ),
        (["--request_timeout", "-1"], "--request-timeout: expected a number above 0, not '-1'"),
        (["--max_model_len", "1"], "--max-model-len: expected a whole number of at least 2, not '1'"),
        (["--log_level", "loud"], "--log-level: invalid choice: 'loud'"),
    ],
)
def test_a_flag_value_the_server_cannot_honour_is_a_usage_error(flags, words, tmp_path, capsys):
    # `--port 99999` printed that port and listened on another: now the parser refuses it, before anything loads.
    with pytest.raises(SystemExit) as exit_info:
        serve_command.main([str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--cb_num_blocks", "4"], "--cb_num_blocks applies to continuous batching only: add --continuous_batching"),
        (["--cb_sampling", "--cb_max_batch_tokens", "64"], "--cb_max_batch_tokens, --cb_sampling apply to continuous"),
        (["--dtype", "float33"], "--dtype float33 is not a torch dtype"),
        (["--device", "gpu"], "--device gpu is not a device"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid is no address this machine can listen on"),
        (["--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine"),
    ],
)
def test_flags_the_server_cannot_honour_stop_it_before_the_model_is_read(flags, words, tmp_path, capsys):
    # tmp_path holds no model: an error about anything but the flag would mean the command read the folder first.
    argv = [str(tmp_path), "--port", str(free_port()), *flags]
    assert serve_command.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha serve: error: ") and words in error and "\n" not in error


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with CUDA has the device")
def test_a_cuda_device_on_a_machine_without_one_is_refused_before_loading(tmp_path, capsys):
    assert serve_command.main([str(tmp_path), "--device", "cuda", "--port", str(free_port())]) == 2
    assert "--device cuda: torch sees no CUDA device on this machine" in capsys.readouterr().err


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert serve_command.main([str(tmp_path), "--host", "127.0.0.1", "--port", str(port)]) == 1
    error = capsys.readouterr().err.strip()
    assert (
        error
        == f"iha serve: error: port {port} on 127.0.0.1 is in use (another server?): stop it, or give another --port"
    )


def test_a_model_the_server_cannot_load_is_one_line(tmp_path, capsys):
    # A folder without a config: the server never starts, and the command says why in one line.
    status = serve_command.main([str(tmp_path), "--device", "cpu", "--port", str(free_port())])
    assert status == 2  # a folder that holds no model: the input is wrong
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha serve: error:") and "\n" not in error


def test_cpu_continuous_batching_gets_a_bounded_cache(model_dir):
    args = serve_command.make_parser().parse_args([str(model_dir), "--continuous_batching", "--device", "cpu"])
    settings = serve.continuous_batching_settings(args)
    assert settings["num_blocks"] * serve.engine_page_size() == serve.CPU_CACHE_TOKENS
    assert settings["max_batch_tokens"] == serve.CPU_MAX_BATCH_TOKENS
    args = serve_command.make_parser().parse_args([str(model_dir), "--continuous_batching", "--cb_num_blocks", "3"])
    assert serve.continuous_batching_settings(args)["num_blocks"] == 3  # given sizes win


# --- answers: concurrency, streams, stops, sampling ------------------------------------------------------------------


def test_sixteen_concurrent_greedy_requests_answer_as_each_alone(generate_server, reference):
    responses = ask_all(generate_server, QUESTIONS, temperature=0)
    assert [response.choices[0].message.content for response in responses] == [reference[q] for q in QUESTIONS]
    assert all(response.model == MODEL_NAME for response in responses)
    assert all(response.usage.completion_tokens == MAX_TOKENS for response in responses)
    assert generate_server.health()["requests_in_flight"] == 0


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_is_the_same_answer_and_ends_with_done(generate_server, reference, include_usage):
    question = QUESTIONS[1]
    stream = generate_server.stream(
        "/v1/chat/completions", chat(question, stream_options={"include_usage": include_usage})
    )
    events = stream.events()
    stream.close()
    assert stream.status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_text(events) == reference[question]
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    usage_chunks = [chunk for chunk in chunks if "usage" in chunk]
    assert len(usage_chunks) == int(include_usage)
    if include_usage:
        assert usage_chunks[0]["choices"] == [] and usage_chunks[0]["usage"]["completion_tokens"] == MAX_TOKENS
    # The openai client reads it the same way.
    parts = generate_server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(part.choices[0].delta.content or "" for part in parts if part.choices) == reference[question]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_ends_the_answer_before_it(generate_server, reference, streamed):
    question = QUESTIONS[2]
    answer = reference[question]
    stop = answer[len(answer) // 2 : len(answer) // 2 + 3]
    body = chat(question, stop=[stop, "never in the answer"])
    if streamed:
        stream = generate_server.stream("/v1/chat/completions", body)
        events = stream.events()
        stream.close()
        text = streamed_text(events)
        finish = json.loads(events[-2])["choices"][0]["finish_reason"]
    else:
        status, _, response = generate_server.post("/v1/chat/completions", body)
        assert status == 200, response
        text, finish = response["choices"][0]["message"]["content"], response["choices"][0]["finish_reason"]
    assert text == answer[: answer.index(stop)] and finish == "stop"


def test_a_seeded_sampled_request_is_reproducible(generate_server):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0}
    answers = [generate_server.post("/v1/completions", {**body, "seed": seed})[2] for seed in (1, 1, 2)]
    texts = [answer["choices"][0]["text"] for answer in answers]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_a_failure_in_the_model_is_a_500_and_the_server_keeps_serving(generate_server, fault_tokens, reference):
    poison = fault_tokens["raise"]
    error = assert_error(
        generate_server.post("/v1/completions", {"prompt": [poison, poison, 5], "max_tokens": 3}),
        500,
        code="generation_failed",
        words=("injected fault", "server's log"),
    )
    assert error["type"] == "server_error"
    log = generate_server.log.read_text()
    assert "Traceback" in log and "RuntimeError: injected fault" in log
    question = QUESTIONS[3]
    status, _, answer = generate_server.post("/v1/chat/completions", chat(question))
    assert status == 200 and answer["choices"][0]["message"]["content"] == reference[question]


def test_a_busy_server_answers_429_and_clients_that_leave_free_their_slots(generate_server, fault_tokens, reference):
    server = generate_server
    hold = fault_tokens["hold"]
    server.release.unlink(missing_ok=True)
    # One request holds the generate worker in its forward; fifteen more wait their turn: all 16 slots taken.
    holder = server.stream("/v1/completions", {"prompt": [hold, hold, 5], "max_tokens": 3})
    waiting = [server.stream("/v1/chat/completions", chat(question)) for question in QUESTIONS[:15]]
    server.wait_for(lambda health: health["requests_in_flight"] == 16, "16 requests in flight")
    status, headers, body = server.post("/v1/chat/completions", chat(QUESTIONS[0]))
    assert_error((status, headers, body), 429, code="too_many_requests", words=("--max_concurrent_requests",))
    assert headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=3)
    # Every client leaves: their slots are free at once, though the worker is still held.
    for stream in [holder, *waiting]:
        stream.close()
    server.wait_for(lambda health: health["requests_in_flight"] == 0, "no request in flight")
    server.release.write_text("go")
    # The worker drops the requests whose clients left, and serves the next one as usual.
    server.wait_for(lambda health: health["engine_requests"] == 0, "an engine without requests")
    question = QUESTIONS[4]
    status, _, answer = server.post("/v1/chat/completions", chat(question))
    assert status == 200 and answer["choices"][0]["message"]["content"] == reference[question]
    assert server.log.read_text().count("generation cancelled") >= 15


# --- continuous batching ----------------------------------------------------------------------------------------------


def test_sixteen_concurrent_requests_under_continuous_batching_answer_as_each_alone(batching_server, reference):
    # 16 requests of ~50 tokens do not fit the 512-token cache together: the engine offloads and resumes some.
    rss_before, _ = peak_memory_kib(batching_server.process.pid)
    responses = ask_all(batching_server, QUESTIONS)
    assert [response.choices[0].message.content for response in responses] == [reference[q] for q in QUESTIONS]
    assert all(response.usage.completion_tokens == MAX_TOKENS for response in responses)
    health = batching_server.health()
    assert health["requests_in_flight"] == 0 and health["engine_requests"] == 0
    # The paged cache is the one stated at start, allocated once: the load did not grow it.
    stated = re.search(
        r"paged cache of (\d+) tokens \((\d+) blocks of (\d+), ([\d.]+) MiB", batching_server.log.read_text()
    )
    tokens, blocks, page_size, mib = int(stated[1]), int(stated[2]), int(stated[3]), float(stated[4])
    assert health["paged_cache"]["tokens"] == tokens == blocks * page_size == BATCHING_BLOCKS * page_size
    assert health["paged_cache"]["bytes"] / 2**20 == pytest.approx(mib, abs=0.05)
    # And the process stayed inside it: the cache's pages are touched as requests write them, the rest is what a
    # Python server allocates on the way (25 MiB measured here, with a cache of 0.5 MiB).
    _, peak_after = peak_memory_kib(batching_server.process.pid)
    assert (peak_after - rss_before) / 1024 < mib + MEMORY_SLACK_MIB


def test_a_prompt_over_the_paged_cache_is_refused_with_the_numbers(batching_server):
    cache_tokens = BATCHING_BLOCKS * serve.engine_page_size()
    prompt = " ".join(["word"] * (cache_tokens + 100))  # within the model's context of 1024, over the cache
    error = assert_error(
        batching_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
        400,
        "prompt",
        "context_length_exceeded",
        words=(f"at most {cache_tokens} tokens per request", "paged cache"),
    )
    assert "--cb_num_blocks" in error["message"]
    assert batching_server.health()["status"] == "ok" and batching_server.health()["engine_restarts"] == 0


def test_a_sampled_request_is_refused_by_a_greedy_batching_engine(batching_server):
    error = assert_error(
        batching_server.post("/v1/chat/completions", chat("hi", temperature=0.7)),
        400,
        "temperature",
        "unsupported_value",
        words=("--cb_sampling",),
    )
    assert "greedily" in error["message"]


@pytest.mark.parametrize("streamed", [True, False], ids=["mid-stream", "waiting for the whole answer"])
def test_a_client_that_leaves_is_cancelled_in_the_batch(batching_server, reference, streamed):
    body = chat(QUESTIONS[5], max_tokens=400)
    if streamed:
        stream = batching_server.stream("/v1/chat/completions", body)
        assert stream.next_event() is not None and stream.next_event() is not None  # the role, the first text
        stream.close()
    else:
        connection = socket.create_connection(("127.0.0.1", batching_server.port))
        payload = json.dumps(body).encode()
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        connection.sendall(head.encode() + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        batching_server.wait_for(lambda health: health["engine_requests"] == 1, "the request in the engine")
        connection.close()
    batching_server.wait_for(
        lambda health: health["requests_in_flight"] == 0 and health["engine_requests"] == 0,
        "the request cancelled in the engine's scheduler",
    )
    assert "generation cancelled" in batching_server.log.read_text()
    question = QUESTIONS[6]
    status, _, answer = batching_server.post("/v1/chat/completions", chat(question))
    assert status == 200 and answer["choices"][0]["message"]["content"] == reference[question]


def test_a_dead_batching_worker_is_replaced(batching_server, fault_tokens, reference):
    poison = fault_tokens["raise"]
    assert_error(
        batching_server.post("/v1/completions", {"prompt": [poison, poison, 7], "max_tokens": 3}),
        500,
        code="generation_failed",
        words=("injected fault",),
    )
    health = batching_server.wait_for(
        lambda health: health["status"] == "ok" and health["engine_restarts"] == 1, "a restarted engine"
    )
    assert health["paged_cache"]["tokens"] == BATCHING_BLOCKS * serve.engine_page_size()
    log = batching_server.log.read_text()
    assert "Traceback" in log and "starting a new one" in log
    responses = ask_all(batching_server, QUESTIONS[:4])
    assert [response.choices[0].message.content for response in responses] == [reference[q] for q in QUESTIONS[:4]]


# --- per-request sampling under continuous batching; timeouts ------------------------------------------------------


def test_greedy_requests_of_a_sampling_batching_engine_answer_as_each_alone(sampling_server, reference):
    # Greedy requests sample their single most likely token (top_k 1), in one batch with requests that sample.
    greedy, sampled = QUESTIONS[8:11], QUESTIONS[11:13]
    bodies = [chat(question, temperature=0) for question in greedy]
    bodies += [chat(question, temperature=1.0, top_p=0.9) for question in sampled]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: sampling_server.post("/v1/chat/completions", body), bodies))
    assert all(status == 200 for status, _, _ in answers), answers
    texts = [answer["choices"][0]["message"]["content"] for _, _, answer in answers]
    assert texts[:3] == [reference[question] for question in greedy]
    assert all(answer["usage"]["completion_tokens"] == MAX_TOKENS for _, _, answer in answers)
    assert_error(
        sampling_server.post("/v1/chat/completions", chat("hi", temperature=1.0, seed=3)),
        400,
        "seed",
        "unsupported_parameter",
    )


def test_a_request_past_its_timeout_is_cancelled_with_504(timeout_server, fault_tokens):
    server = timeout_server
    hold = fault_tokens["hold"]
    server.release.unlink(missing_ok=True)
    # The stream holds the worker in its forward past its timeout; the request behind it waits past its own.
    stream = server.stream("/v1/completions", {"prompt": [hold, hold, 9], "max_tokens": 3})
    events = stream.events()
    stream.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and f"{TIMEOUT} s" in error["message"]
    assert_error(
        server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3}),
        504,
        code="request_timeout",
        words=("--request_timeout", "after 0 generated tokens"),
    )
    server.release.write_text("go")
    server.wait_for(lambda health: health["engine_requests"] == 0, "an engine without requests")
    status, _, answer = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


# --- stopping (last: these stop their servers) -------------------------------------------------------------------------


def assert_stopped_cleanly(server: Server, children: list, signal_name: str) -> None:
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(f"the server did not exit within 30 s of {signal_name}") from None
    assert server.process.returncode == 0, server.log.read_text()[-3000:]
    assert not [child for child in children if child.is_running()]
    assert f"iha serve: stopped ({signal_name})" in server.log.read_text()


def test_sigterm_stops_the_server_cancelling_a_request_stuck_in_the_model(generate_server, fault_tokens):
    server = generate_server
    hold = fault_tokens["hold"]
    server.release.unlink(missing_ok=True)
    stream = server.stream("/v1/completions", {"prompt": [hold, hold, 11], "max_tokens": 3})
    server.wait_for(lambda health: health["requests_in_flight"] == 1, "the held request in flight")
    children = children_of(server)
    server.process.send_signal(signal.SIGTERM)
    events = stream.events()
    stream.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    # The worker is still in its forward (never released): the process exits anyway.
    assert_stopped_cleanly(server, children, "SIGTERM")


def test_ctrl_c_stops_the_batching_server_ending_its_streams(batching_server):
    stream = batching_server.stream("/v1/chat/completions", chat(QUESTIONS[7], max_tokens=300))
    assert stream.next_event() is not None
    children = children_of(batching_server)
    batching_server.process.send_signal(signal.SIGINT)
    events = stream.events()
    stream.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert_stopped_cleanly(batching_server, children, "SIGINT")
