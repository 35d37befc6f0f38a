"""The vLLM commands of the README and the docs pages, run as written in `.venv-vllm` (`make vllm-test`): `vllm serve`
with the variables at the start of its line and the `curl` after it, the `LLM(...)` line, and `lm_eval --model vllm`
on the offline GSM8K task. tests/docs/ runs every other command of those pages (and skips these, pointing here).

Each page's commands run in page order in a scratch folder of their own, as a user runs them from a checkout, on a
machine that never used Hugging Face (HOME and HF_HOME empty). What is changed, and only that: the page's
`smollm2-iha` is a tiny IHA folder with random mixing and a word-level tokenizer (vLLM's CPU kernel takes its head size;
the real SmolLM2 conversion serves in tests/serving/vllm_plugin/test_vllm_serve.py's way too, in minutes), the page's
`.venv-vllm` is this environment, `vllm serve` listens on 127.0.0.1 on a free port instead of every interface's 8000,
and `lm_eval` scores 2 problems with 8 new tokens. The variables vLLM's CPU build needs come from the page's own line:
the test process's own (vllm_cases.py sets them for the engines it starts itself) are taken out of the commands'
environment, so that a line without them would fail here as it fails for a user.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm")

from testing_utils import (  # noqa: E402
    DOC_PAGES,
    REPO_ROOT,
    free_port,
    fresh_machine_environment,
    page_commands,
    program_name,
    start_server,
    stop_server,
)
from vllm_cases import tiny_iha_folder, word_tokenizer  # noqa: E402


STARTUP_SECONDS = 600
COMMAND_SECONDS = 900
PAGE_SERVER_PORT = "8000"
# What the test process holds for its own engines (vllm_cases.py) and a user's shell does not.
NOT_A_USERS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")
LM_EVAL_TINY = ["--limit", "2", "--gen_kwargs", "max_gen_toks=8"]


def vllm_commands(page: str) -> list:
    """The page's commands that run vLLM or talk to a vLLM server, and the `cp` lines that give them their files."""
    return [
        command for command in page_commands(page) if command.engine == "vllm" or program_name(command.argv) == "cp"
    ]


PAGES = [page for page in DOC_PAGES if any(command.engine == "vllm" for command in page_commands(page))]


def test_the_readme_and_the_serving_page_have_vllm_commands():
    assert {"README.md", "docs/serving.md"} <= set(PAGES)
    names = {program_name(command.argv) for command in vllm_commands("docs/serving.md")}
    assert {"vllm", "curl", "python", "lm_eval"} <= names


@pytest.fixture(scope="module", params=PAGES)
def page(request, tmp_path_factory):
    """(page, scratch folder, environment, the servers started), the servers stopped at the end."""
    scratch = tmp_path_factory.mktemp("vllm-" + request.param.replace("/", "-"))
    tiny_iha_folder(scratch / "smollm2-iha", num_pseudo_heads=2)
    word_tokenizer(256).save_pretrained(scratch / "smollm2-iha")
    (scratch / ".venv-vllm").symlink_to(Path(sys.prefix))
    for name in ("examples", "tests"):
        (scratch / name).symlink_to(REPO_ROOT / name)
    environment = fresh_machine_environment(
        tmp_path_factory.mktemp("machine"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    for name in NOT_A_USERS:
        environment.pop(name, None)
    servers = []
    yield request.param, scratch, environment, servers
    for process in servers:
        stop_server(process, seconds=60, process_group=True)


def answers_200(response) -> bool:
    return response.status == 200


@pytest.mark.slow
def test_page_vllm_commands_run_as_written(page):
    name, scratch, environment, servers = page
    port = None
    for command in vllm_commands(name):
        program = program_name(command.argv)
        line = command.text
        if program == "vllm" and command.argv[1:2] == ["serve"]:
            port = free_port()
            line = line.split("#")[0].replace(f"--port {PAGE_SERVER_PORT}", f"--port {port}") + " --host 127.0.0.1"
            log = scratch / f"vllm-serve-{port}.log"
            servers.append(
                start_server(
                    ["bash", "-c", line], cwd=scratch, env=environment, log=log, port=port, seconds=STARTUP_SECONDS,
                    healthy=answers_200, start_new_session=True,
                )
            )  # fmt: skip
            continue
        if program == "curl":
            assert port, f"no vLLM server of {name} runs for {command.text}"
            line = line.replace(f"localhost:{PAGE_SERVER_PORT}", f"127.0.0.1:{port}") + " --fail --max-time 300"
        elif program == "lm_eval":
            line = line.split("#")[0] + " " + " ".join(LM_EVAL_TINY)
        result = subprocess.run(
            ["bash", "-c", line],
            cwd=scratch,
            env=environment,
            capture_output=True,
            text=True,
            timeout=COMMAND_SECONDS,
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, f"{command.text}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        if program == "curl":
            assert '"choices"' in result.stdout, result.stdout[-3000:]
        if program == "lm_eval":
            assert "gsm8k_local" in result.stdout, result.stdout[-3000:]
            assert "IHAForCausalLM" in result.stdout + result.stderr  # vLLM resolved the plugin's architecture
