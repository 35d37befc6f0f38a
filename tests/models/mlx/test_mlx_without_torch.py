"""An IHA folder on a machine with stock mlx-lm and no torch (a Mac's usual set-up), where `iha` is not installed.

The folders are built here, in the development environment (torch, `iha`, `iha export mlx`); then used in an
environment of their own holding only what `pip install "mlx[cpu]" mlx-lm` installs (mlx, mlx-lm, transformers and
their dependencies: no torch, no `iha`), at this environment's mlx and mlx-lm releases and the newest tested
transformers, built once into ~/.cache/iha/mlx-without-torch and reused. Every process there starts in an empty folder
with HOME and HF_HOME empty temporary folders, offline. There:

- `AutoConfig.from_pretrained(FOLDER, trust_remote_code=True)` loads an `iha` and an `iha_gemma3` folder (their
  configuration files import no torch) into the values the folder's config has here, and `AutoTokenizer` (with and
  without `trust_remote_code`) encodes as the folder's tokenizer does here;
- mlx-lm's own loader builds the model from the folder's MLX file and computes, bit for bit, the logits the same MLX
  file computes here, and its greedy tokens are transformers' greedy tokens on the folder (a tiny random P = 2 GQA
  folder, and one in the paper's hybrid layout, sliding IHA layers and a global MHA layer);
- `mlx_lm.generate --model FOLDER --trust-remote-code --prompt ... --max-tokens N` prints the completion transformers'
  greedy tokens decode to, for both folders;
- stock `mlx_lm.server --trust-remote-code` (127.0.0.1, a free port, stopped at the end) answers a greedy
  /v1/completions with transformers' greedy token ids, for both folders.

Cost, measured on this project's 2-core machines, shared with other work, pip's cache warm: the 10 tests took 118 s of
pytest with the environment built within them (about 62 s of it the build, 254 MB: mlx, mlx-cpu, mlx-lm,
transformers, tokenizers, numpy, ...) at a load average of 9, and 65 s with it built (building the folders and the
probe 25 s, two mlx_lm.generate commands and two servers 8 to 11 s each).
`make mlx-without-torch` runs this file alone.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch


pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from filelock import FileLock  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
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
from iha.models.iha.layer_iha import FIELD_DEFAULTS  # noqa: E402
from iha.models.iha.version_iha import newest_tested_line  # noqa: E402


pytestmark = pytest.mark.slow

CACHE_DIR = Path("~/.cache/iha/mlx-without-torch").expanduser()
# What a user installs (`pip install "mlx[cpu]" mlx-lm`; on a Mac, `mlx`), at the releases tested here, and the newest
# transformers release the version matrix runs.
MLX_RELEASE = importlib.metadata.version("mlx")
MLX_LM_RELEASE = importlib.metadata.version("mlx-lm")
TRANSFORMERS_RELEASE = f"{newest_tested_line()}.0"
REQUIREMENTS = [
    f"mlx[cpu]=={MLX_RELEASE}" if sys.platform.startswith("linux") else f"mlx=={MLX_RELEASE}",
    f"mlx-lm=={MLX_LM_RELEASE}",
    f"transformers=={TRANSFORMERS_RELEASE}",
]
STEPS = 16
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
STARTUP_SECONDS = 300
REQUEST_SECONDS = 120
COMMAND_SECONDS = 600


def no_torch_environment() -> Path:
    """The environment's interpreter: a virtual environment with REQUIREMENTS only, built once under a lock (two test
    sessions may start at the same time) and checked to hold no torch."""
    venv = CACHE_DIR / f"mlx-{MLX_RELEASE}-mlx-lm-{MLX_LM_RELEASE}-transformers-{TRANSFORMERS_RELEASE}"
    python = venv / "bin" / "python"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv.with_name(f".{venv.name}.lock"))):
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            # --no-compile: Python compiles the modules a process imports, once (byte-compiling all is most of pip's time).
            install = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *REQUIREMENTS]
            subprocess.run(install, check=True, timeout=COMMAND_SECONDS)
            (venv / ".complete").touch()
    return python


def environment_without_the_project(python: Path, folder: Path) -> dict:
    """A fresh machine's environment (HOME and HF_HOME empty folders under `folder`, offline) with `python`'s
    environment first on PATH, as once activated, and nothing that would put this checkout or this virtual environment
    on its path."""
    environment = fresh_machine_environment(folder)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        environment.pop(name, None)
    search_path = os.pathsep.join([str(python.parent), environment.get("PATH", os.defpath)])
    return {**environment, "PATH": search_path, "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_there(python: Path, command: list[str], scratch: Path) -> subprocess.CompletedProcess:
    """`command` (a program of `python`'s environment and its arguments) in that environment, from an empty folder."""
    scratch.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(python.parent / command[0]), *command[1:]],
        cwd=scratch,
        env=environment_without_the_project(python, scratch),
        stdin=subprocess.DEVNULL,  # transformers' remote-code question reads end-of-file at once
        capture_output=True,
        text=True,
        timeout=COMMAND_SECONDS,
    )


def save_with_tokenizer(model_class, config_class, folder: Path, **settings):
    """A tiny random model of `config_class` with the tiny GSM8K tokenizer, random mixing, saved to `folder`."""
    tokenizer = build_tiny_tokenizer(folder)
    config = config_class(
        **{**TINY, "num_key_value_heads": 2, "vocab_size": len(tokenizer), **settings},
        initializer_range=0.1,  # a wide init: greedy tokens decided by clear margins rather than rounding
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    randomize_mixing(model, scale=0.5, seed=0)
    model.save_pretrained(folder)
    return tokenizer


def paper_hybrid(**settings) -> iha.IHAConfig:
    """The paper's layout at training length 32 and P = 2: 4 sliding IHA layers (4 tokens, 8 virtual) : 1 global MHA."""
    return iha.IHAConfig.paper_hybrid(training_length=32, **settings)


MLX_FOLDERS = {
    "p2-gqa": dict(num_pseudo_heads=2),
    "paper-hybrid": dict(num_pseudo_heads=2, num_hidden_layers=5),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The folders, built here: the MLX ones exported with `iha export mlx`, with what transformers and the MLX file
    compute on them here (greedy tokens without an end-of-sequence stop, MLX logits), and a Gemma 3 one."""
    root = tmp_path_factory.mktemp("folders")
    built = {}
    for name, settings in MLX_FOLDERS.items():
        folder = root / name
        config_class = paper_hybrid if name == "paper-hybrid" else iha.IHAConfig
        tokenizer = save_with_tokenizer(iha.IHAForCausalLM, config_class, folder, **settings)
        assert run("export", ["mlx", str(folder)], prog="iha export") == 0
        model = iha.IHAForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompt_ids = tokenizer(PROMPT)["input_ids"]
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        mlx_model, _ = load_model(folder, trust_remote_code=True)
        built[name] = {
            "folder": folder,
            "tokenizer": tokenizer,
            "config": model.config,
            "prompt_ids": prompt_ids,
            "greedy": output[0, len(prompt_ids) :].tolist(),
            "mlx_logits": np.array(mlx_model(mx.array([prompt_ids]))[0]),
        }
    assert any(spec.is_sliding and spec.is_iha for spec in map(built["paper-hybrid"]["config"].layer_spec, range(5)))
    folder = root / "gemma3"
    tokenizer = save_with_tokenizer(
        iha.IHAGemma3ForCausalLM, iha.IHAGemma3Config, folder, num_pseudo_heads=2, sliding_window=3
    )
    built["gemma3"] = {"folder": folder, "tokenizer": tokenizer, "config": iha.IHAGemma3Config.from_pretrained(folder)}
    return built


@pytest.fixture(scope="module")
def python():
    return no_torch_environment()


# Run in the environment without torch: the configs and tokenizers of every folder, and mlx-lm's model on the MLX
# folders (its loader, `mlx_lm.load`, as `mlx_lm.generate` and `mlx_lm.server` call it).
PROBE = """
import importlib.util, json, sys
result = {"torch": importlib.util.find_spec("torch") is not None, "iha": importlib.util.find_spec("iha") is not None}
from transformers import AutoConfig, AutoTokenizer
fields, text, requests, out = sys.argv[1].split(","), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
for folder, request in requests.items():
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    found = {
        "config_module": type(config).__module__,
        "model_type": config.model_type,
        "fields": {name: getattr(config, name) for name in fields},
        "virtual_windows": [config.layer_spec(i).virtual_window for i in range(config.num_hidden_layers)],
        "tokens": AutoTokenizer.from_pretrained(folder)(text)["input_ids"],
        "tokens_trusted": AutoTokenizer.from_pretrained(folder, trust_remote_code=True)(text)["input_ids"],
    }
    if request is not None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step
        model, tokenizer = load(folder, trust_remote_code=True)
        prompt = tokenizer.encode(text)
        found["model_module"] = type(model).__module__
        found["mlx_tokens"] = prompt
        found["logits"] = model(mx.array([prompt]))[0].tolist()
        found["greedy"] = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=request["steps"])]
    result[folder] = found
result["torch_imported"] = "torch" in sys.modules
json.dump(result, open(out, "w"))
"""


@pytest.fixture(scope="module")
def probed(python, folders, tmp_path_factory):
    requests = {
        str(built["folder"]): ({"steps": STEPS} if name in MLX_FOLDERS else None) for name, built in folders.items()
    }
    scratch = tmp_path_factory.mktemp("probe")
    out = scratch / "probed.json"  # not stdout: transformers' remote-code question is printed there
    completed = run_there(
        python, ["python", "-c", PROBE, ",".join(FIELD_DEFAULTS), PROMPT, json.dumps(requests), str(out)], scratch
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_environment_has_no_torch_and_no_iha(probed):
    assert not probed["torch"] and not probed["torch_imported"]
    assert not probed["iha"]


@pytest.mark.parametrize("name", [*MLX_FOLDERS, "gemma3"])
def test_configs_and_tokenizers_load_without_torch(probed, folders, name):
    built = folders[name]
    found = probed[str(built["folder"])]
    config = built["config"]
    assert found["config_module"].startswith("transformers_modules.")  # the folder's own configuration file
    assert found["model_type"] == config.model_type
    assert found["fields"] == {name: getattr(config, name) for name in FIELD_DEFAULTS}
    assert found["virtual_windows"] == [config.layer_spec(i).virtual_window for i in range(config.num_hidden_layers)]
    expected = built["tokenizer"](PROMPT)["input_ids"]
    assert found["tokens"] == expected and found["tokens_trusted"] == expected


@pytest.mark.parametrize("name", MLX_FOLDERS)
def test_mlx_lm_computes_the_dev_environments_logits_and_transformers_greedy_tokens(probed, folders, name):
    built = folders[name]
    found = probed[str(built["folder"])]
    assert found["model_module"] == "custom_model"  # mlx-lm built it from the folder's MLX file
    assert found["mlx_tokens"] == built["prompt_ids"]
    # The same MLX file on the same mlx release: the same float32 logits, bit for bit, with or without torch around.
    np.testing.assert_array_equal(np.array(found["logits"], dtype=np.float32), built["mlx_logits"])
    assert found["greedy"] == built["greedy"]


def until_end_of_turn(tokens: list[int], eos_token_id: int, keep_eos: bool) -> list[int]:
    """The greedy tokens a command that stops at the end-of-turn token gives (with it, or without)."""
    if eos_token_id not in tokens:
        return tokens
    return tokens[: tokens.index(eos_token_id) + keep_eos]


@pytest.mark.parametrize("name", MLX_FOLDERS)
def test_mlx_lm_generate_command_prints_transformers_greedy_completion(python, folders, name, tmp_path):
    built = folders[name]
    tokenizer = built["tokenizer"]
    # The command puts the prompt in the folder's chat template; the greedy tokens of that prompt, computed here.
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    model = iha.IHAForCausalLM.from_pretrained(built["folder"], dtype=torch.float32).eval()
    with torch.no_grad():
        output = model.generate(
            torch.tensor([chat_ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    generated = until_end_of_turn(output[0, len(chat_ids) :].tolist(), tokenizer.eos_token_id, keep_eos=True)

    command = ["mlx_lm.generate", "--model", str(built["folder"]), "--trust-remote-code"]
    command += ["--prompt", PROMPT, "--max-tokens", str(STEPS)]
    completed = run_there(python, command, tmp_path)
    assert completed.returncode == 0, completed.stderr[-4000:]
    # mlx_lm.generate prints the completion on lines of its own between two lines of "=" (its streaming detokenizer
    # drops the completion's leading space, as a sentencepiece one would), then the prompt's and the completion's
    # lengths in tokens (an end-of-turn token counted, not shown).
    _, completion, summary = completed.stdout.split("=" * 10)
    text = tokenizer.decode([token for token in generated if token != tokenizer.eos_token_id])
    assert completion == f"\n{text.removeprefix(' ')}\n"
    assert f"Prompt: {len(chat_ids)} tokens," in summary
    assert f"Generation: {len(generated)} tokens," in summary


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
        return json.load(response)


@pytest.mark.parametrize("name", MLX_FOLDERS)
def test_mlx_lm_server_answers_transformers_greedy_tokens(python, folders, name, tmp_path):
    built = folders[name]
    port = free_port()
    command = [str(python.parent / "mlx_lm.server"), "--model", str(built["folder"]), "--trust-remote-code"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    environment = environment_without_the_project(python, tmp_path)
    log = tmp_path / "server.log"
    process = start_server(command, cwd=tmp_path, env=environment, log=log, port=port, seconds=STARTUP_SECONDS)
    try:
        body = {"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "logprobs": True}
        completion = post(f"http://127.0.0.1:{port}/v1/completions", body)
    finally:
        assert stop_server(process), "mlx_lm.server did not stop within 30 s of SIGTERM"
    assert completion["usage"]["prompt_tokens"] == len(built["prompt_ids"]), log.read_text()[-3000:]
    # With "logprobs": true the server lists each answer token as {"id": ..., "logprob": ...}, the end-of-turn token
    # included when it comes.
    tokens = [entry["id"] for entry in completion["choices"][0]["logprobs"]["content"]]
    assert tokens == until_end_of_turn(built["greedy"], built["tokenizer"].eos_token_id, keep_eos=True)
