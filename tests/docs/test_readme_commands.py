"""Every shell command in README.md, checked the way a user meets it, so that the README cannot rot.

The commands of the README's ```bash blocks are checked in README order, in one scratch folder (later commands use
what earlier ones wrote, as they would for a user who follows the README). Each command is

1. **run as written**, with three mechanical changes, all listed below:
   - `LOCAL_COPIES`: a Hub id is replaced by a local stand-in: GSM8K / MATH-500 by the benchmark files the tests
     read, SmolLM2-135M-Instruct by `tiny-smollm2`, a tiny random Llama with SmolLM2's tokenizer and chat template
     (the same code paths in seconds; the real weights go through them in tests/conversion/test_convert_smollm2.py
     and test_demo.py);
   - `PLACEHOLDERS`: a name the README uses for "your folder" (`CONVERTED_DIR`, `./my-llama`) becomes a real one;
   - `TINY_SETTINGS`: flags appended to make the run small (argparse and `HfArgumentParser` keep the last value of
     a repeated flag, so these override the README's own values: fewer steps, rows, tokens, examples, epochs, seeds);
2. or, when the README marks it "needs the Hub" or "needs GPUs" (and `NOT_RUN` says why), **parsed** by the
   command's own argument parser: its arguments must be valid, nothing runs; so is a command whose tiny run would
   repeat one that runs elsewhere (`RUN_ELSEWHERE` says where: once shrunk, every `python -m research.synthetic`
   preset is the tiny one, which the README's own `--preset tiny` command runs);
3. or, for `make` and `pip install`, checked without building or downloading anything: `make -n TARGET` must work,
   and the versions `pip install` pins must be the ones installed;
4. or, for a server (`iha serve`), started in the background on a free port instead of the README's, on a machine
   without a Hugging Face cache (HOME and HF_HOME empty folders), kept running for the commands after it (`curl` is
   run against it, with `--fail`) and stopped at the end of the module.

A command that fits none of these fails, so a new README command has to be made runnable or marked.

Every ```python snippet is run as written too, each in a fresh process in a scratch folder that holds what the
README's commands would have written before it (`smollm2-iha`, `gsm8k_openthoughts.jsonl`), with the same local
stand-ins for Hub ids (`SNIPPET_COPIES`), the training configs given tiny settings (`SNIPPET_TRAINING_SETTINGS`,
applied over the snippet's own) and the client snippet pointed at an `iha serve` of the test's own on a free port. Last, everything the commands wrote must be ignored by git (and so by ruff's `make lint`).
"""

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testing_utils import REPO_ROOT, TEST_DATA, free_port, fresh_machine_environment, start_server, stop_server


README = REPO_ROOT / "README.md"
BIN = Path(sys.executable).parent  # the console scripts of this environment (iha, iha-sft, trl, lm_eval, ...)
CONSOLE_SCRIPTS = {
    "iha",
    "iha-convert",
    "iha-sft",
    "iha-eval",
    "trl",
    "lm_eval",
    "accelerate",
    "mlx_lm.generate",
    "mlx_lm.convert",
}

# Hub id -> the same data on this machine, per program (GSM8K: the training split for data preparation, the test
# split for evaluation, as each command reads by default).
LOCAL_COPIES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": lambda program: "tiny-smollm2",
    "openai/gsm8k": lambda program: str(
        TEST_DATA / "gsm8k" / ("test.jsonl" if program == "iha-eval" else "train.jsonl")
    ),
    "HuggingFaceH4/MATH-500": lambda program: str(TEST_DATA / "math500" / "test.jsonl"),
}
# README placeholder -> what stands for it (whole arguments only: `./my-llama-iha` is an output name, not one).
PLACEHOLDERS = {
    "CONVERTED_DIR": "smollm2-iha",  # the folder the README's first `iha-convert` command writes
    "./my-llama": "tiny-smollm2",  # a Llama checkpoint of your own
}
SFT_TINY = ["--max_steps", "1", "--max_length", "512", "--per_device_train_batch_size", "1", "--report_to", "none"]
# (program, first argument) -> flags appended.
TINY_SETTINGS = {
    ("iha", "data gsm8k-to-openthoughts"): ["--limit", "48"],
    ("iha-sft", None): [*SFT_TINY, "--max_train_rows", "8"],
    ("trl", "sft"): SFT_TINY,
    ("accelerate", "launch"): [*SFT_TINY, "--max_train_rows", "8"],
    ("iha-eval", "math"): ["--limit", "1", "--num-samples", "2", "--max-new-tokens", "8"],
    ("iha-eval", "needle"): ["--num-examples", "1", "--lengths", "256", "--max-new-tokens", "8"],
    ("python", "-m research.synthetic"): ["--tasks", "binary", "--max-epochs", "1", "--num-train", "128"],
    ("python", "-m research.polynomial_filter"): [
        "--steps",
        "100",
        "--seeds",
        "0",
        "1",
        "--attentions",
        "linear",
    ],
}
# Commands the README marks as needing the Hub or GPUs: a distinctive part of the command -> why it is not run here.
NOT_RUN = {
    "--push_to_hub me/my-llama-p2": "uploads to the Hub (the offline failure is tested in tests/conversion/test_convert.py)",
    "--dataset_name open-thoughts/OpenThoughts-114k": "OpenThoughts-114k is on the Hub only",
    "examples/accelerate/fsdp.yaml": "the GPU configuration as shipped (8 processes, bf16); its CPU run is run",
    "research.ab --preset gpu": "the gpu preset trains on all of GSM8K on a CUDA device (tests/research/ab/test_ab.py runs the tiny one)",
    "lm_eval --model hf": "the lm-eval gsm8k task downloads GSM8K (tests/evaluation/test_lm_eval.py runs lm_eval offline)",
}
# Commands that, given their tiny settings, would only repeat a run made elsewhere: the command's first words -> where
# that run is made. Every such command that trains a preset other than `tiny` is parsed instead (the presets' own
# settings are what a user's run takes; none is tiny); `--preset tiny`, --report and --summarize run as written.
RUN_ELSEWHERE = {
    "python -m research.synthetic": "shrunk to the tiny preset, as the README's `--preset tiny` command runs it",
    "python -m research.ab": "shrunk to the tiny preset, which tests/research/ab/test_ab.py runs whole",
}
MARKER = re.compile(r"#.*needs (the Hub|GPUs)")
# The port the README's server commands use, replaced by a free one; how long a server may take to answer /health.
README_SERVER_PORT = "8000"
SERVER_STARTUP_SECONDS = 300


def readme_commands(page: Path = README) -> list[tuple[str, str]]:
    """(command as one line, its comment) for every command of the page's ```bash blocks, in order."""
    commands = []
    in_block = False
    pending = ""
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_block = line.strip() == "```bash" if not in_block else False
            continue
        if not in_block or (not pending and (not line.strip() or line.lstrip().startswith("#"))):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append(pending + line.strip())
        pending = ""
    return [(command, MARKER.search(command).group(1) if MARKER.search(command) else "") for command in commands]


COMMANDS = readme_commands()


def substitute(arguments: list[str], program: str) -> list[str]:
    result = []
    for argument in arguments:
        argument = PLACEHOLDERS.get(argument, argument)
        for hub_id, local_copy in LOCAL_COPIES.items():
            if hub_id in argument:
                argument = argument.replace(hub_id, local_copy(program))
        result.append(argument)
    return result


def tiny_settings(program: str, arguments: list[str]) -> list[str]:
    for (name, first), flags in TINY_SETTINGS.items():
        if name == program and (first is None or " ".join(arguments).startswith(first)):
            return flags
    return []


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The folder the commands run in: with `examples/` (configurations the README names) and `tiny-smollm2`."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "examples").symlink_to(REPO_ROOT / "examples")
    save_tiny_smollm2(folder / "tiny-smollm2")
    return folder


def save_tiny_smollm2(folder: Path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer, chat template and generation config."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from iha.conversion.builtin import smollm2_dir

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig.from_pretrained(smollm2_dir()).save_pretrained(folder)


def command_environment(scratch: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),  # the package of this checkout
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_MODULES_CACHE": str(scratch / ".hf_modules"),
    }


def server_environment(scratch: Path) -> dict:
    """The commands' environment on a machine that never used Hugging Face (HOME and HF_HOME empty folders): where
    the README's server and its clients must work as written."""
    return fresh_machine_environment(
        scratch / FRESH_MACHINE,
        PYTHONPATH=str(REPO_ROOT),
        TOKENIZERS_PARALLELISM="false",
        HF_MODULES_CACHE=str(scratch / ".hf_modules"),
    )


def run_command(program: str, arguments: list[str], scratch: Path) -> subprocess.CompletedProcess:
    executable = [sys.executable] if program == "python" else [str(BIN / program)]
    return subprocess.run(
        executable + arguments,
        cwd=scratch,
        env=command_environment(scratch),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def servers():
    """The servers the README's commands started: {"port": ...} of the running one; all stopped after the module."""
    running = {"processes": [], "port": None}
    yield running
    for process in running["processes"]:
        stop_server(process)


def start_readme_server(program: str, arguments: list[str], scratch: Path, servers: dict) -> None:
    """`iha serve ...` in the background on a free port instead of the README's, until it answers /health."""
    port = free_port()
    arguments = [str(port) if argument == README_SERVER_PORT else argument for argument in arguments]
    log = scratch / f"{SERVER_LOG_PREFIX}{port}.log"
    environment = server_environment(scratch)
    servers["processes"].append(
        start_server([str(BIN / program), *arguments], scratch, environment, log, port, SERVER_STARTUP_SECONDS)
    )
    servers["port"] = port


def parse_only(program: str, arguments: list[str]) -> None:
    """The command's own argument parser accepts the arguments (SystemExit from argparse fails the test)."""
    if program == "iha-convert":
        from iha.cli.convert import make_parser

        make_parser().parse_args(arguments)
    elif program == "iha-sft":
        from iha.cli.sft import parse_args

        parse_args(arguments)
    elif research_task(program, arguments):
        research_parser(research_task(program, arguments)).parse_args(arguments[2:])
    elif program == "lm_eval":
        from lm_eval._cli import HarnessCLI

        HarnessCLI()._parser.parse_args(["run", *arguments])
    elif program == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        launch = launch_command_parser().parse_args(arguments[1:])
        # `-m iha.cli sft ...`: the package's command line, as each process of the launch runs it.
        assert launch.module and launch.training_script == "iha.cli", arguments
        assert launch.training_script_args[:1] == ["sft"], arguments
        from iha.cli.sft import parse_args

        parse_args(launch.training_script_args[1:])
    else:
        pytest.fail(f"no argument parser known for {program}: run the command or teach this test its parser")


def check_without_running(program: str, arguments: list[str]) -> None:
    if program == "make":
        dry_run = subprocess.run(["make", "-n", *arguments], cwd=REPO_ROOT, capture_output=True, text=True)
        assert dry_run.returncode == 0, dry_run.stderr
        return
    # pip install: every pinned version is the installed one; an editable install names extras the package has.
    for argument in arguments:
        if "==" in argument:
            name, _, version = argument.partition("==")
            assert importlib.metadata.version(name).split("+")[0] == version, argument
        elif argument.startswith(".["):
            extras = set(argument[2:-1].split(","))
            provided = set(importlib.metadata.metadata("iha-transformers").get_all("Provides-Extra") or [])
            assert extras <= provided, (extras, provided)


def research_task(program: str, arguments: list[str]) -> str | None:
    """`python -m research.TASK ...` -> TASK (research/, run from the checkout: `python -m`), else None."""
    if program == "python" and arguments[:1] == ["-m"] and arguments[1:2] and arguments[1].startswith("research."):
        return arguments[1].removeprefix("research.")
    return None


def research_parser(task: str):
    """The argument parser of `python -m research.TASK` (its `cli.make_parser`)."""
    import importlib

    return importlib.import_module(f"research.{task}.cli").make_parser()


def run_elsewhere(program: str, arguments: list[str]) -> str | None:
    """Where the run this command's tiny run would repeat is made (`RUN_ELSEWHERE`), or None."""
    words = [program, *arguments]
    where = next(
        (where for start, where in RUN_ELSEWHERE.items() if words[: len(start.split())] == start.split()), None
    )
    preset = arguments[arguments.index("--preset") + 1] if "--preset" in arguments[:-1] else None
    if where is None or preset == "tiny" or {"--report", "--summarize"} & set(arguments):
        return None
    return where


def test_every_command_run_elsewhere_is_in_the_readme():
    split = [shlex.split(command, comments=True) for command, _ in COMMANDS]
    for start in RUN_ELSEWHERE:
        assert any(
            run_elsewhere(words[0], words[1:]) for words in split if words[: len(start.split())] == start.split()
        ), start


def test_every_marked_command_is_listed_with_its_reason():
    marked = [command for command, marker in COMMANDS if marker]
    listed = {key: [command for command in marked if key in command] for key in NOT_RUN}
    assert all(len(commands) == 1 for commands in listed.values()), listed
    assert sorted(command for commands in listed.values() for command in commands) == sorted(marked)


@pytest.mark.slow
@pytest.mark.parametrize("command, marker", COMMANDS, ids=[command[:60] for command, _ in COMMANDS])
def test_readme_command(command, marker, scratch, servers):
    program, *arguments = shlex.split(command, comments=True)
    if program in ("make", "pip"):
        check_without_running(program, arguments[1:] if program == "pip" else arguments)
        return
    if program == "curl":
        assert servers["port"], f"no server of the README runs for {command}"
        url = f"localhost:{README_SERVER_PORT}"
        arguments = [argument.replace(url, f"127.0.0.1:{servers['port']}") for argument in arguments]
        result = subprocess.run(["curl", "--fail", "--max-time", "300", *arguments], capture_output=True, text=True)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert '"choices"' in result.stdout, result.stdout[-3000:]
        return
    if program != "python" and program not in CONSOLE_SCRIPTS:
        pytest.fail(f"README command with an unknown program {program!r}: {command}")
    arguments = substitute(arguments, program)
    if marker or run_elsewhere(program, arguments):
        parse_only(program, arguments)
        return
    if program == "iha" and arguments[:1] == ["serve"]:
        start_readme_server(program, arguments, scratch, servers)
        return
    result = run_command(program, arguments + tiny_settings(program, arguments), scratch)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


# The files the commands leave in their folder that are the test's own stand-ins, not README outputs, and the logs
# of the servers it starts.
FRESH_MACHINE = ".fresh-machine"  # the servers' empty HOME and HF_HOME
STAND_INS = {"examples", "tiny-smollm2", ".hf_modules", FRESH_MACHINE}
SERVER_LOG_PREFIX = "server-"


# The docs pages' `iha-sft` and `accelerate launch` commands (full, on the fly, LoRA, multi-process): what a user
# copies from there must parse as well. Their runs are the README's (a command ending in `...` is a pattern, not a
# command).
DOCS_TRAINING_COMMANDS = [
    command
    for page in sorted((REPO_ROOT / "docs").glob("*.md"))
    for command, _ in readme_commands(page)
    if command.split()[0] in {"iha-sft", "accelerate"} and "..." not in command
]


def test_the_docs_have_training_commands():
    assert len(DOCS_TRAINING_COMMANDS) >= 4


@pytest.mark.parametrize("command", DOCS_TRAINING_COMMANDS, ids=[command[:60] for command in DOCS_TRAINING_COMMANDS])
def test_docs_training_command_parses(command):
    program, *arguments = shlex.split(command, comments=True)
    parse_only(program, arguments)


# Every `python -m research.<task>` command the pages show, in a code block (```bash or plain, `\` continuations
# joined) or in running text (`...`): what a user copies must parse with the task's own parser. The README's run as
# well (above); the long presets elsewhere are the same code with other settings.
RESEARCH_PAGES = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "CONTRIBUTING.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / "benchmarks").glob("*/README.md")),
]
RESEARCH_COMMAND = re.compile(r"python -m research\.[a-z_]+(?: [^`\n]*)?")


def research_commands(page: Path) -> list[str]:
    """The page's `python -m research.TASK ...` commands, as one line each (a pattern with `...` left out)."""
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    spans = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).replace("\n", " "))
    found = [match.group(0).strip() for piece in [*lines, *spans] for match in RESEARCH_COMMAND.finditer(piece)]
    return [command for command in found if "..." not in command]


RESEARCH_COMMANDS = sorted(
    {(str(page.relative_to(REPO_ROOT)), command) for page in RESEARCH_PAGES for command in research_commands(page)}
)


def test_the_pages_show_every_research_task():
    tasks = {command.split()[2] for _, command in RESEARCH_COMMANDS}
    assert tasks == {"research.synthetic", "research.polynomial_filter", "research.ab"}, tasks


@pytest.mark.parametrize("page, command", RESEARCH_COMMANDS, ids=[f"{p}: {c[:50]}" for p, c in RESEARCH_COMMANDS])
def test_every_research_command_the_pages_show_parses(page, command, capsys):
    words = shlex.split(command, comments=True)
    if words[-1] == "&":  # run in the background, beside the next command
        words = words[:-1]
    words = ["1" if word == "N" else word for word in words]  # `--seed N`: a placeholder for a seed
    program, *arguments = words
    task = research_task(program, arguments)
    assert task is not None, command
    if arguments[2:] == ["--help"]:
        with pytest.raises(SystemExit) as exit_info:
            research_parser(task).parse_args(arguments[2:])
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python -m research.{task}")
        return
    research_parser(task).parse_args(arguments[2:])


@pytest.mark.slow  # it reads what the (slow) README commands above wrote
def test_everything_the_commands_wrote_is_ignored_by_git(scratch):
    """After the README's commands (above; pytest keeps file order), every folder and file they wrote is in
    .gitignore: a user who runs them in the repository gets a clean `git status` and a passing `make lint`."""
    # A folder is named with its trailing slash: `/data/`-style patterns match folders only.
    written = sorted(
        entry.name + "/" * entry.is_dir()
        for entry in scratch.iterdir()
        if entry.name not in STAND_INS and not entry.name.startswith(SERVER_LOG_PREFIX)
    )
    assert written, "run with the README commands above: they write the folders this test checks"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.split()
    assert sorted(ignored) == written, f"not in .gitignore: {sorted(set(written) - set(ignored))}"


# ---------------------------------------------------------------------------------------------------------------------
# The Python snippets
# ---------------------------------------------------------------------------------------------------------------------

SNIPPET_COPIES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "tiny-smollm2",
    "open-thoughts/OpenThoughts-114k": "gsm8k_openthoughts.jsonl",  # a local file in the same (OpenThoughts) format
    "openai/gsm8k": str(TEST_DATA / "gsm8k" / "train.jsonl"),
    "CONVERTED_DIR": "smollm2-iha",
}
# Tiny settings applied over the snippet's own, per training config class (module, class name): one step, short rows.
SNIPPET_TRAINING_SETTINGS = {
    ("iha.training", "IHASFTConfig"): {"max_steps": 1, "max_length": 512, "per_device_train_batch_size": 1},
    ("trl", "DPOConfig"): {"max_steps": 1, "max_length": 256, "per_device_train_batch_size": 2},
    ("trl", "GRPOConfig"): {
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 8,
    },
}


def snippet_prelude(code: str) -> str:
    """Replace every training config class the snippet uses by one that applies the tiny settings over its own."""
    lines = []
    for (module, name), settings in SNIPPET_TRAINING_SETTINGS.items():
        if name in code:
            settings = {**settings, "report_to": "none"}
            lines += [
                f"import {module} as _module",
                f"_module.{name} = (lambda cls: lambda **kw: cls(**{{**kw, **{settings!r}}}))(_module.{name})",
            ]
    return "\n".join(lines) + "\n"


# The README's server address in the client snippet; the test's server runs on a free port instead.
README_SERVER_URL = f"http://localhost:{README_SERVER_PORT}/v1"
# What a user has on disk before the DPO snippet: an SFT output ("out") and TRL preference rows.
PREFERENCE_ROWS = [
    {
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "chosen": [{"role": "assistant", "content": f"{a + b}"}],
        "rejected": [{"role": "assistant", "content": f"{a + b + 1}"}],
    }
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
]


def readme_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


SNIPPETS = readme_snippets()


@pytest.fixture(scope="module")
def snippet_scratch(tmp_path_factory) -> Path:
    """What the README's commands write before its snippets: a converted `smollm2-iha`, OpenThoughts-format rows,
    an SFT output `out` (the converted folder stands in) and preference rows `pairs.jsonl`."""
    import shutil

    from iha.conversion import convert_checkpoint
    from iha.data.gsm8k import gsm8k_file_to_openthoughts
    from iha.data.messages import write_jsonl

    folder = tmp_path_factory.mktemp("readme-snippets")
    save_tiny_smollm2(folder / "tiny-smollm2")
    convert_checkpoint(folder / "tiny-smollm2", folder / "smollm2-iha", show_progress=False)
    shutil.copytree(folder / "smollm2-iha", folder / "out")
    write_jsonl(
        gsm8k_file_to_openthoughts(TEST_DATA / "gsm8k" / "train.jsonl", limit=8), folder / "gsm8k_openthoughts.jsonl"
    )
    write_jsonl(PREFERENCE_ROWS, folder / "pairs.jsonl")
    return folder


@pytest.fixture(scope="module")
def snippet_server(snippet_scratch):
    """`iha serve smollm2-iha` on a free port for the client snippet, started on first use, stopped after the module."""
    running = {}

    def url() -> str:
        if not running:
            port = free_port()
            command = [str(BIN / "iha"), "serve", "smollm2-iha", "--port", str(port)]
            log = snippet_scratch / f"{SERVER_LOG_PREFIX}{port}.log"
            running["process"] = start_server(
                command, snippet_scratch, server_environment(snippet_scratch), log, port, SERVER_STARTUP_SECONDS
            )
            running["url"] = f"http://127.0.0.1:{port}/v1"
        return running["url"]

    yield url
    if running:
        stop_server(running["process"])


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 4 and all("import" in snippet for snippet in SNIPPETS)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[snippet.splitlines()[0][:50] for snippet in SNIPPETS])
def test_readme_snippet_runs_as_written(snippet, snippet_scratch, snippet_server):
    code = snippet
    for hub_id, local_copy in SNIPPET_COPIES.items():
        code = code.replace(f'"{hub_id}"', f'"{local_copy}"')
    if README_SERVER_URL in code:
        code = code.replace(README_SERVER_URL, snippet_server())
    code = snippet_prelude(code) + code
    result = run_command("python", ["-c", code], snippet_scratch)
    assert result.returncode == 0, f"{snippet}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
