"""A server of the package (`iha serve`) in its own process, for tests: on a free port, waited for until it answers
/health, stopped with SIGTERM (killed if it lingers)."""

import json
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


def start_server(command: list[str], cwd: Path, env: dict, log: Path, port: int, seconds: float) -> subprocess.Popen:
    """Start `command` (output to `log`) and wait until http://127.0.0.1:PORT/health says ok; AssertionError with the
    log's end if it exits or does not answer within `seconds` (the process is stopped then)."""
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
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


def stop_server(process: subprocess.Popen, seconds: float = 30) -> bool:
    """SIGTERM, then kill after `seconds`; whether it stopped on SIGTERM (True also if it had already exited)."""
    if process.poll() is not None:
        return True
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False
