"""How the README's and the docs pages' commands and snippets are checked: each page's shell commands run as written, in
page order, in one scratch folder of their own (later commands use what earlier ones wrote, as they would for a user
who follows the page), and each of its Python snippets runs in a fresh process. The test files beside this module
(test_readme_commands.py, test_<page>_page_commands.py) apply it to one page each, so that `make test`'s workers
share the pages out.

A command is

1. **run as written**, through bash (so that `NAME=value` prefixes, `$(...)` and `nice` work as in a terminal), with
   this environment's programs first on PATH and with three mechanical changes, all listed below:
   - `LOCAL_COPIES`: a Hub id is replaced by a local stand-in: GSM8K / MATH-500 by the benchmark files the tests
     read, SmolLM2-135M-Instruct by `tiny-smollm2`, a tiny random Llama with SmolLM2's tokenizer and chat template
     (the same code paths in seconds; the real weights go through them in tests/conversion/test_convert_smollm2.py
     and tests/demo/test_demo.py);
   - `PLACEHOLDERS`: a name a page uses for "your folder" (`CONVERTED_DIR`, `./my-llama`) becomes a real one;
   - `TINY_SETTINGS`: flags appended to make the run small (argparse and `HfArgumentParser` keep the last value of
     a repeated flag, so these override the page's own values: fewer steps, rows, tokens, examples, epochs, seeds);
2. or, when the page marks it "needs the Hub" or "needs GPUs", **parsed** by the command's own argument parser: its
   arguments must be valid, nothing runs; so is a command whose tiny run would repeat one made elsewhere
   (`RUN_ELSEWHERE` says where);
3. or, for `make` and `pip install`, checked without building or downloading anything: `make -n TARGET` must work,
   and the versions `pip install` pins must be the ones installed;
4. or, for a server (`iha serve`), started in the background on a free port instead of the page's, on a machine
   without a Hugging Face cache (HOME and HF_HOME empty folders), kept running for the commands after it (`curl` is
   run against it, with `--fail`) and stopped at the end of the module;
5. or, for what runs vLLM (and `curl` against a vLLM server), skipped here: `make vllm-test` runs those as written in
   .venv-vllm (tests/serving/vllm_plugin/test_vllm_docs_commands.py), where they can.

A command that fits none of these fails, so a new command has to be made runnable or marked.

Python snippets run as written too, each in a fresh process in a scratch folder that holds what the pages' commands
would have written before it (`smollm2-iha`, `gsm8k_openthoughts.jsonl`, an SFT output `out`, preference rows), with
the same local stand-ins for Hub ids (`SNIPPET_COPIES`), the training configs given tiny settings
(`SNIPPET_TRAINING_SETTINGS`, applied over the snippet's own) and a client pointed at an `iha serve` of the test's
own on a free port; `SNIPPETS_NOT_RUN` lists the few that cannot run alone, and why.
"""

import importlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testing_utils import (
    REPO_ROOT,
    TEST_DATA,
    free_port,
    fresh_machine_environment,
    page_snippets,
    program_name,
    start_server,
    stop_server,
)


BIN = Path(sys.executable).parent  # the console scripts of this environment (iha, iha-sft, trl, lm_eval, ...)
PROGRAMS = {
    "python",
    "iha",
    "iha-convert",
    "iha-sft",
    "iha-eval",
    "trl",
    "lm_eval",
    "accelerate",
    "mlx_lm.generate",
    "mlx_lm.convert",
    "cp",
}
# The repository's folders a page's commands name by their path from the repository's root, linked into the scratch
# folder (the commands run there as a user runs them from a checkout).
LINKED = ("examples", "benchmarks", "tests")

# Hub id -> the same data on this machine, per program (GSM8K: the training split for data preparation, the test
# split for evaluation, as each command reads by default).
LOCAL_COPIES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": lambda program: "tiny-smollm2",
    "openai/gsm8k": lambda program: str(TEST_DATA / "gsm8k" / ("test.jsonl" if "eval" in program else "train.jsonl")),
    "HuggingFaceH4/MATH-500": lambda program: str(TEST_DATA / "math500" / "test.jsonl"),
}
# Page placeholder -> what stands for it (whole arguments only: `./my-llama-iha` is an output name, not one).
PLACEHOLDERS = {
    "CONVERTED_DIR": "smollm2-iha",  # the folder the README's `iha-convert` command writes
    "./my-llama": "tiny-smollm2",  # a Llama checkpoint of your own
    "gsm8k_train.jsonl": str(TEST_DATA / "gsm8k" / "train.jsonl"),  # your copy of GSM8K's training split
}
SFT_TINY = ["--max_steps", "1", "--max_length", "512", "--per_device_train_batch_size", "1", "--report_to", "none"]
# A checkpoint at every step, so that a page's "resume" command finds one after its one-step run.
SFT_TINY_RUN = [*SFT_TINY, "--max_train_rows", "8", "--save_steps", "1"]
# (program, how its arguments start) -> flags appended.
TINY_SETTINGS = {
    ("iha", "data gsm8k-to-openthoughts"): ["--limit", "48"],
    ("iha", "sft"): SFT_TINY_RUN,
    ("iha-sft", ""): SFT_TINY_RUN,
    ("trl", "sft"): SFT_TINY,
    ("accelerate", "launch"): [*SFT_TINY, "--max_train_rows", "8"],
    ("iha", "eval math"): ["--limit", "1", "--num-samples", "1", "--max-new-tokens", "8"],
    ("iha-eval", "math"): ["--limit", "1", "--num-samples", "1", "--max-new-tokens", "8"],
    ("iha-eval", "needle"): ["--num-examples", "1", "--lengths", "256", "--max-new-tokens", "8"],
    ("lm_eval", ""): ["--limit", "2", "--gen_kwargs", "max_gen_toks=8"],
    ("python", "-m research.synthetic"): ["--tasks", "binary", "--max-epochs", "1", "--num-train", "128"],
    ("python", "-m research.polynomial_filter"): ["--steps", "100", "--seeds", "0", "1", "--attentions", "linear"],
    ("python", "benchmarks/bench_sft.py"): [
        *("--rows", "8", "--max_length", "512", "--steps", "2", "--rounds", "1", "--layouts", "global"),
        *("--output", "runs/bench-sft"),
    ],
}
# Commands a page marks as needing the Hub or GPUs: a distinctive part of the command -> why it is not run here.
NOT_RUN = {
    "--push_to_hub me/my-llama-p2": "uploads to the Hub (the offline failure is tested in tests/conversion/test_convert.py)",
    "--dataset_name open-thoughts/OpenThoughts-114k": "OpenThoughts-114k is on the Hub only",
    "open-thoughts/OpenThoughts3-1.2M": "OpenThoughts3 is on the Hub only",
    "--dataset_name data/ot3.jsonl": "OpenThoughts3's rows, which the command before it downloads from the Hub",
    "examples/accelerate/fsdp.yaml -m iha.cli sft": "the GPU configuration as shipped (8 processes, bf16); its CPU run is run",
    "examples/accelerate/deepspeed_zero3.yaml -m iha.cli sft": "ZeRO-3 on GPUs; its CPU run is the one below",
    "--preset gpu": "the gpu preset trains on all of GSM8K on a CUDA device (tests/research/ab/test_ab.py runs the tiny one)",
    "lm_eval --model hf --model_args pretrained=./smollm2-iha,trust_remote_code=True --tasks gsm8k ": (
        "the lm-eval gsm8k task downloads GSM8K (the offline task below runs)"
    ),
    "--max_length 4096 --batch_size 4 --steps 20": "the benchmark's GPU settings (bf16 where the GPU has it)",
    "--attn_implementation flash_attention_2": "FlashAttention needs a CUDA GPU",
}
# Commands whose run is made elsewhere, at the size it needs: a distinctive part -> where. They are parsed here.
RUN_ELSEWHERE = {
    "--tasks niah_single_1,niah_multikey_2,niah_multikey_3": "benchmarks/layout_study.py runs it at its size (hours)",
    "--output_dir runs/healed-hybrid": "benchmarks/layout_study.py runs it at its size (hours)",
    "deepspeed_zero3.yaml --num_processes 2": "tests/training/test_sft_deepspeed.py runs it (make deepspeed-test)",
}
# The research tasks (research/, python -m research.<task>) with presets: a preset other than `tiny` (the default
# included) is parsed only: hours at its own size, and shrunk it would repeat the tiny run that the page's own
# `--preset tiny` command makes (or that tests/research/ makes).
PRESET_TASKS = ("synthetic", "ab")
# The port the pages' server commands use, replaced by a free one; how long a server may take to answer /health.
PAGE_SERVER_PORT = "8000"
SERVER_STARTUP_SECONDS = 300
# The files a scratch folder holds that are the test's own stand-ins, not the commands' outputs, and the logs of the
# servers it starts.
FRESH_MACHINE = ".fresh-machine"  # the servers' empty HOME and HF_HOME
STAND_INS = {*LINKED, "tiny-smollm2", ".hf_modules", FRESH_MACHINE}
SERVER_LOG_PREFIX = "server-"


def save_tiny_smollm2(folder: Path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer, chat template and generation config."""
    import torch
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


def make_scratch(folder: Path, converted: bool) -> Path:
    """A page's scratch folder: the repository's folders its commands name, `tiny-smollm2`, and (for a page read after
    the README, `converted`) the `smollm2-iha` the README's first command writes."""
    for name in LINKED:
        (folder / name).symlink_to(REPO_ROOT / name)
    save_tiny_smollm2(folder / "tiny-smollm2")
    if converted:
        from iha.conversion import convert_checkpoint

        convert_checkpoint(folder / "tiny-smollm2", folder / "smollm2-iha", show_progress=False)
    return folder


def substitute(arguments: list[str], program: str) -> list[str]:
    result = []
    for argument in arguments:
        argument = PLACEHOLDERS.get(argument, argument)
        for hub_id, local_copy in LOCAL_COPIES.items():
            if hub_id in argument:
                argument = argument.replace(hub_id, local_copy(program + " " + " ".join(arguments[:1])))
        result.append(argument)
    return result


def tiny_settings(program: str, arguments: list[str]) -> list[str]:
    joined = " ".join(arguments)
    for (name, start), flags in TINY_SETTINGS.items():
        if name == program and joined.startswith(start):
            return flags
    return []


def command_environment(scratch: Path) -> dict:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # `python`, `iha`, ... are this environment's
        "PYTHONPATH": str(REPO_ROOT),  # the package of this checkout
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_MODULES_CACHE": str(scratch / ".hf_modules"),
    }


def server_environment(scratch: Path) -> dict:
    """The commands' environment on a machine that never used Hugging Face (HOME and HF_HOME empty folders): where
    the pages' servers and their clients must work as written."""
    return fresh_machine_environment(
        scratch / FRESH_MACHINE,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO_ROOT),
        TOKENIZERS_PARALLELISM="false",
        HF_MODULES_CACHE=str(scratch / ".hf_modules"),
    )


def shell_line(environment: dict, argv: list[str]) -> str:
    """The command as bash runs it: its `NAME=value` prefixes, then its words quoted, a word holding `$(...)` in
    double quotes so that bash substitutes it, as it does in the page."""
    words = [f"{name}={shlex.quote(value)}" for name, value in environment.items()]
    words += [f'"{word}"' if "$(" in word else shlex.quote(word) for word in argv]
    return " ".join(words)


def run_shell(line: str, scratch: Path, environment: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", line],
        cwd=scratch,
        env=environment or command_environment(scratch),
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )


def research_parser(task: str):
    return importlib.import_module(f"research.{task}.cli").make_parser()


def research_task(program: str, arguments: list[str]) -> str | None:
    """`python -m research.<task> ...` -> the task's name, else None."""
    if program == "python" and arguments[:1] == ["-m"] and arguments[1].startswith("research."):
        return arguments[1].removeprefix("research.")
    return None


def tiny_preset(arguments: list[str]) -> bool:
    return "--preset" in arguments[:-1] and arguments[arguments.index("--preset") + 1] == "tiny"


def parse_only(program: str, arguments: list[str]) -> None:
    """The command's own argument parser accepts the arguments (SystemExit from argparse fails the test)."""
    task = research_task(program, arguments)
    if program == "iha-convert":
        from iha.cli.convert import make_parser

        make_parser().parse_args(arguments)
    elif program == "iha-sft" or (program == "iha" and arguments[:1] == ["sft"]):
        from iha.cli.sft import parse_args

        parse_args(arguments[1:] if program == "iha" else arguments)
    elif program == "iha" and arguments[:2] == ["data", "to-messages"]:
        from iha.cli.data import make_parser

        make_parser().parse_args(arguments[1:])
    elif task:
        research_parser(task).parse_args(arguments[2:])
    elif program == "python" and arguments[:1] == ["benchmarks/bench_sft.py"]:
        spec = importlib.util.spec_from_file_location("bench_sft", REPO_ROOT / "benchmarks" / "bench_sft.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.make_parser().parse_args(arguments[1:])
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
        pytest.fail(f"no argument parser known for {program}: run the command or teach docs_commands.py its parser")


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


def not_run_reason(text: str, marker: str) -> str | None:
    """Why a command is parsed instead of run (None: it runs). A marked command must be listed in NOT_RUN."""
    if marker:
        reasons = [reason for key, reason in NOT_RUN.items() if key in text]
        assert len(reasons) == 1, f"a command marked 'needs {marker}' must be listed once in NOT_RUN: {text}"
        return reasons[0]
    return next((reason for key, reason in RUN_ELSEWHERE.items() if key in text), None)


def start_page_server(argv: list[str], scratch: Path, servers: dict) -> None:
    """`iha serve ...` in the background on a free port instead of the page's, until it answers /health."""
    port = free_port()
    argv = [str(port) if argument == PAGE_SERVER_PORT else argument for argument in argv]
    log = scratch / f"{SERVER_LOG_PREFIX}{port}.log"
    servers["processes"].append(
        start_server(
            [str(BIN / argv[0]), *argv[1:]], scratch, server_environment(scratch), log, port, SERVER_STARTUP_SECONDS
        )
    )
    servers["port"] = port


def check_page_command(command, scratch: Path, servers: dict) -> None:
    """Run, parse or check one command of a page (`command`: testing_utils.PageCommand), as the module docstring
    says."""
    if command.engine == "vllm":
        pytest.skip(
            "runs vLLM: `make vllm-test` runs it as written (tests/serving/vllm_plugin/test_vllm_docs_commands.py)"
        )
    environment, argv = command.environment, command.argv
    program, arguments = program_name(argv), argv[1:]
    if program in ("make", "pip"):
        check_without_running(program, arguments[1:] if program == "pip" else arguments)
        return
    if program == "curl":
        assert servers["port"], f"no server of the page runs for {command.text}"
        url = f"localhost:{PAGE_SERVER_PORT}"
        arguments = [argument.replace(url, f"127.0.0.1:{servers['port']}") for argument in arguments]
        result = subprocess.run(["curl", "--fail", "--max-time", "300", *arguments], capture_output=True, text=True)
        assert result.returncode == 0, f"{command.text}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert '"choices"' in result.stdout, result.stdout[-3000:]
        return
    if program not in PROGRAMS:
        pytest.fail(f"a command with a program this test does not know, {program!r}: {command.text}")
    arguments = substitute(arguments, program)
    task = research_task(program, arguments)
    if not_run_reason(command.text, command.marker) or (task in PRESET_TASKS and not tiny_preset(arguments)):
        parse_only(program, arguments)
        return
    if program == "iha" and arguments[:1] == ["serve"]:
        start_page_server([program, *arguments], scratch, servers)
        return
    line = shell_line(environment, [argv[0], *arguments, *tiny_settings(program, arguments)])
    if command.text.lstrip().startswith("nice "):
        line = "nice " + line
    result = run_shell(line, scratch)
    assert result.returncode == 0, f"{command.text}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def check_written_files_are_ignored(scratch: Path) -> None:
    """Every folder and file the commands wrote is in .gitignore: a user who runs them in the repository gets a
    clean `git status` and a passing `make lint`."""
    # A folder is named with its trailing slash: `/data/`-style patterns match folders only.
    written = sorted(
        entry.name + "/" * entry.is_dir()
        for entry in scratch.iterdir()
        if entry.name not in STAND_INS and not entry.name.startswith(SERVER_LOG_PREFIX)
    )
    assert written, "run with the page's commands first: they write the folders this test checks"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.split()
    assert sorted(ignored) == written, f"not in .gitignore: {sorted(set(written) - set(ignored))}"


def command_ids(commands) -> list[str]:
    return [command.text[:60] for command in commands]


# ---------------------------------------------------------------------------------------------------------------------
# The Python snippets
# ---------------------------------------------------------------------------------------------------------------------

SNIPPET_COPIES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "tiny-smollm2",
    "open-thoughts/OpenThoughts-114k": "gsm8k_openthoughts.jsonl",  # a local file in the same (OpenThoughts) format
    "openai/gsm8k": str(TEST_DATA / "gsm8k" / "train.jsonl"),
    "CONVERTED_DIR": "smollm2-iha",
}
# Snippets that cannot run alone: a distinctive part -> why.
SNIPPETS_NOT_RUN = {
    "open-thoughts/OpenThoughts3-1.2M": "reads OpenThoughts3 from the Hub; load_sft_dataset's schemas are tested in tests/data/",
    "exit_after_deepspeed_run(0)": "the last lines of a DeepSpeed run's script (tests/training/test_sft_deepspeed.py runs them)",
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
# What a user has on disk before the DPO snippet: TRL preference rows.
PREFERENCE_ROWS = [
    {
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "chosen": [{"role": "assistant", "content": f"{a + b}"}],
        "rejected": [{"role": "assistant", "content": f"{a + b + 1}"}],
    }
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
]
# The pages' server address in the client snippet; the test's server runs on a free port instead.
PAGE_SERVER_URL = f"http://localhost:{PAGE_SERVER_PORT}/v1"


def snippets_to_run(page: str) -> list[str]:
    return [snippet for snippet in page_snippets(page) if not any(key in snippet for key in SNIPPETS_NOT_RUN)]


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


def make_snippet_scratch(folder: Path) -> Path:
    """What the pages' commands write before their snippets: a converted `smollm2-iha`, OpenThoughts-format rows, an
    SFT output `out` (the converted folder stands in) and preference rows `pairs.jsonl`."""
    from iha.conversion import convert_checkpoint
    from iha.data.gsm8k import gsm8k_file_to_openthoughts
    from iha.data.messages import write_jsonl

    save_tiny_smollm2(folder / "tiny-smollm2")
    convert_checkpoint(folder / "tiny-smollm2", folder / "smollm2-iha", show_progress=False)
    shutil.copytree(folder / "smollm2-iha", folder / "out")
    write_jsonl(
        gsm8k_file_to_openthoughts(TEST_DATA / "gsm8k" / "train.jsonl", limit=8), folder / "gsm8k_openthoughts.jsonl"
    )
    write_jsonl(PREFERENCE_ROWS, folder / "pairs.jsonl")
    return folder


def start_snippet_server(scratch: Path) -> tuple[subprocess.Popen, str]:
    """`iha serve smollm2-iha` on a free port, for a client snippet: (the process, its /v1 URL)."""
    port = free_port()
    command = [str(BIN / "iha"), "serve", "smollm2-iha", "--port", str(port)]
    log = scratch / f"{SERVER_LOG_PREFIX}{port}.log"
    process = start_server(command, scratch, server_environment(scratch), log, port, SERVER_STARTUP_SECONDS)
    return process, f"http://127.0.0.1:{port}/v1"


def run_snippet(snippet: str, scratch: Path, server_url) -> None:
    """`server_url()` starts the snippet server on first use."""
    code = snippet
    for hub_id, local_copy in SNIPPET_COPIES.items():
        code = code.replace(f'"{hub_id}"', f'"{local_copy}"')
    if PAGE_SERVER_URL in code:
        code = code.replace(PAGE_SERVER_URL, server_url())
    code = snippet_prelude(code) + code
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=scratch,
        env=command_environment(scratch),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"{snippet}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def snippet_ids(snippets: list[str]) -> list[str]:
    return [snippet.splitlines()[0][:50] for snippet in snippets]


def stop_servers(servers: dict) -> None:
    for process in servers["processes"]:
        stop_server(process)


def page_fixtures(page: str, converted: bool):
    """The module-scoped fixtures of a page's test file: its scratch folder, its servers, its snippet folder and the
    snippet server (started on first use)."""

    @pytest.fixture(scope="module")
    def scratch(tmp_path_factory) -> Path:
        return make_scratch(tmp_path_factory.mktemp(re.sub(r"\W", "-", page)), converted)

    @pytest.fixture(scope="module")
    def servers():
        running = {"processes": [], "port": None}
        yield running
        stop_servers(running)

    @pytest.fixture(scope="module")
    def snippet_scratch(tmp_path_factory) -> Path:
        return make_snippet_scratch(tmp_path_factory.mktemp(re.sub(r"\W", "-", page) + "-snippets"))

    @pytest.fixture(scope="module")
    def snippet_server(snippet_scratch):
        running = {}

        def url() -> str:
            if not running:
                running["process"], running["url"] = start_snippet_server(snippet_scratch)
            return running["url"]

        yield url
        if running:
            stop_server(running["process"])

    return scratch, servers, snippet_scratch, snippet_server
