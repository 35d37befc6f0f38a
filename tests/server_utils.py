"""A server of the package (`iha serve`) in its own process, for tests: on a free port, waited for until it answers
/health, stopped with SIGTERM (killed if it lingers); the environment of a fresh machine; faults a test can set off
inside the server; plain HTTP requests."""

import http.client
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fresh_machine_environment(folder: Path, **variables: str) -> dict:
    """The environment of a machine that never used Hugging Face: HOME and HF_HOME empty folders under `folder`,
    offline (and `variables` on top)."""
    home, hf_home = folder / "home", folder / "hf_home"
    home.mkdir(parents=True, exist_ok=True)
    hf_home.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "HOME": str(home), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME", "IHA_API_KEY"):
        environment.pop(name, None)
    return {**environment, **variables}


def start_server(
    command: list[str], cwd: Path, env: dict, log: Path, port: int, seconds: float, **popen
) -> subprocess.Popen:
    """Start `command` (output to `log`) and wait until http://127.0.0.1:PORT/health says ok; AssertionError with the
    log's end if it exits or does not answer within `seconds` (the process is stopped then)."""
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True, **popen
        )
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{command} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if json.load(response).get("status") == "ok":
                    return process
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise AssertionError(f"{command} did not answer /health within {seconds} s:\n{log.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen, seconds: float = 30, signum: int = signal.SIGTERM) -> bool:
    """`signum` (SIGTERM), then kill after `seconds`; whether it stopped on the signal (True also if it had already
    exited)."""
    if process.poll() is not None:
        return True
    process.send_signal(signum)
    try:
        process.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


def restore_ctrl_c() -> None:
    """For `preexec_fn`: Ctrl-C as in an interactive shell, even when the tests run as a background job (which
    starts with SIGINT ignored, and the server respects that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# `python -c FAULTY_SERVER ARGS...` is `iha ARGS...` with faults inside the model's forward, set off by the tokens a
# request sends: a forward whose input holds the token pair (RAISE, RAISE) raises RuntimeError("injected fault"); one
# whose input holds (HOLD, HOLD) blocks until the file RELEASE exists (at most 300 s), as a slow step would. A pair,
# so that a model never sets one off by generating a token.
FAULTY_SERVER = """
import functools, os, sys, time
from pathlib import Path
import iha

raise_token = int(os.environ["IHA_TEST_RAISE_TOKEN"])
hold_token = int(os.environ["IHA_TEST_HOLD_TOKEN"])
release = Path(os.environ["IHA_TEST_RELEASE"])
forward = iha.IHAForCausalLM.forward

def holds_pair(input_ids, token):
    ids = input_ids.reshape(-1)
    return bool(((ids[:-1] == token) & (ids[1:] == token)).any())

@functools.wraps(forward)
def forward_with_faults(self, input_ids=None, *args, **kwargs):
    if input_ids is not None and holds_pair(input_ids, raise_token):
        raise RuntimeError(f"injected fault: the token pair ({raise_token}, {raise_token})")
    if input_ids is not None and holds_pair(input_ids, hold_token):
        deadline = time.monotonic() + 300
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return forward(self, input_ids, *args, **kwargs)

iha.IHAForCausalLM.forward = forward_with_faults
from iha.cli import main
sys.exit(main(sys.argv[1:]))
"""


def request(
    method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None, timeout: float = 300
) -> tuple[int, dict, object]:
    """A plain HTTP request: (status, headers with lower-case names, the body as JSON, or as text if it is not)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **(headers or {})}
    call = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=timeout) as response:
            status, answer_headers, content = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, answer_headers, content = error.code, error.headers, error.read()
    headers = {name.lower(): value for name, value in answer_headers.items()}
    try:
        return status, headers, json.loads(content)
    except json.JSONDecodeError:
        return status, headers, content.decode()


class EventStream:
    """A streamed request read event by event (`data: ...` lines of server-sent events) on its own connection, which
    `close` drops as a client that leaves does."""

    def __init__(self, port: int, path: str, body: dict, headers: dict | None = None, timeout: float = 300):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        self.response = self.connection.getresponse()
        self.status = self.response.status

    def next_event(self) -> str | None:
        """The next event's data (None once the stream ends)."""
        while True:
            line = self.response.readline()
            if not line:
                return None
            line = line.decode().strip()
            if line.startswith("data: "):
                return line[len("data: ") :]

    def events(self) -> list[str]:
        events = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        if self.connection.sock is not None:
            self.connection.sock.shutdown(socket.SHUT_RDWR)
        self.connection.close()
