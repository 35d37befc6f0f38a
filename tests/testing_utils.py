"""What the tests share but fixtures (those live in conftest.py): tiny IHA and Llama models and batches, the precision of
the model tests, greedy decoding without a cache (the ground truth of cached decoding), tiny source checkpoints to
convert, a command stopped mid-work to signal, the offline pieces of the SFT tests (a tiny ChatML tokenizer
trained on GSM8K text, the tiny training model's size), and servers in their own process on a fresh machine.

Test modules import it by name (`from testing_utils import tiny_iha_model`): tests/ is on the path of every test run.
"""

import copy
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import iha
from iha.data.gsm8k import gsm8k_file_to_openthoughts, read_gsm8k_rows
from iha.training.chat_template import SMOLLM2_CHAT_TEMPLATE


TESTS_DIR = Path(__file__).resolve().parent


REPO_ROOT = TESTS_DIR.parent


# A few hundred rows of GSM8K and MATH-500 inside the repository (tests/fixtures/data/README.md says which): the tests
# read nothing outside it.
TEST_DATA = TESTS_DIR / "fixtures" / "data"


TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny_iha_config(**overrides) -> iha.IHAConfig:
    return iha.IHAConfig(**{**TINY, **overrides})


def randomize_mixing(model, scale: float = 0.3, seed: int = 0):
    """Move every mixing coefficient and collapse weight away from identity, so tests see real mixing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".head_mixing." in name:
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_((scale * noise).to(parameter.dtype))
    return model


def tiny_iha_model(seed: int = 0, randomize: bool = True, **overrides):
    torch.manual_seed(seed)
    model = iha.IHAForCausalLM(tiny_iha_config(**overrides)).eval()
    if randomize:
        randomize_mixing(model, seed=seed)
    return model


def tokenizer_settings(tokenizer) -> dict:
    """The config fields that size a tiny model to `tokenizer`: its vocabulary and special token ids
    (`tiny_iha_model(**tokenizer_settings(tokenizer))`)."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_llama_for_tokenizer(tokenizer, seed: int = 0, **overrides):
    """A tiny random Llama (GQA, tied embeddings) sized to `tokenizer`, with its special token ids: a stand-in for a
    real checkpoint wherever a test needs real text (chat templates, generation, lm_eval) but not real weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        **tokenizer_settings(tokenizer),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def left_padded_batch(vocab_size: int = TINY["vocab_size"], seq_len: int = 9, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (3, seq_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :5] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def generation_position_ids(attention_mask):
    # What `generate` does for left padding: positions count real tokens only.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def run_without_the_project(code: str, *args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a fresh process without the project on its path (no PYTHONPATH), offline, with its own
    cache of remote-code modules under `cwd`: how a Hub user who never installed `iha` loads a folder. `code` blocks
    `import iha` itself, since the package may be installed in this environment."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "modules"), TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # a prompt (remote code, say) would read EOF at once instead of waiting
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# How far a model run in a narrower dtype may land from the float64 reference, or from another path run in that dtype,
# for values (logits) and for parameter gradients: elementwise, this fraction of the largest |expected| value (and as
# much relative error); over the whole tensor, ||actual - expected|| <= NORM_FRACTION * this * ||expected||. float32
# rounds at ~1e-7 per operation; bfloat16 at 2^-8 = 4e-3 (a real model's logits differ at ~1e-3 after conversion in
# bf16, iha-design.md section 3). Measured on the CPU over tests/models (every test the `precision` fixture runs):
# float32 logits within 6e-7 of the largest value; bfloat16 logits within 1.5e-2 (1e-2 in norm), and gradients within
# 1e-1 in norm, the worst those of the 2 x 2 x P key mixing of GQA models, sums of many products that cancel.
NARROW_DTYPE_TOLERANCES = {
    torch.float32: {"values": 2e-5, "gradients": 1e-4},
    torch.bfloat16: {"values": 4e-2, "gradients": 4e-1},
}


NORM_FRACTION = 0.5


@dataclass(frozen=True)
class Precision:
    """Where the model tests run: `device` and `dtype` (None: each test's own), from the command line.

    A test builds its models on the CPU as before, runs the reference there, and runs the model under test as
    `precision.model(model)` on `precision.to_device(inputs)`; `assert_close` compares on the CPU with the test's own
    tolerance, or with the dtype's when `--dtype` narrows the model. With the defaults nothing moves or changes.
    """

    device: torch.device
    dtype: torch.dtype | None
    compile_backend: str

    @property
    def narrowed(self) -> bool:
        """Whether `--dtype` sets the models' dtype (tolerances then follow it)."""
        return self.dtype is not None

    def tolerance(self, gradient: bool = False) -> float:
        if not self.narrowed:
            return 0.0
        return NARROW_DTYPE_TOLERANCES[self.dtype]["gradients" if gradient else "values"]

    def is_here(self, tensor: torch.Tensor) -> bool:
        device = tensor.device
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def model(self, model):
        """`model` on the test device in the test dtype: the same object where that changes nothing, else a copy (the
        original stays on the CPU in the test's own dtype, for the reference)."""
        parameter = next(model.parameters())
        dtype = self.dtype or parameter.dtype
        if self.is_here(parameter) and parameter.dtype == dtype:
            return model
        return copy.deepcopy(model).to(self.device, dtype)

    def to_device(self, *values):
        """Tensors (also inside dicts, lists and tuples) on the test device; one value in, one out."""

        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(self.device)
            if isinstance(value, dict):
                return {key: move(item) for key, item in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(move(item) for item in value)
            return value

        moved = tuple(move(value) for value in values)
        return moved[0] if len(moved) == 1 else moved

    def assert_close(self, actual, expected, *, rtol: float, atol: float, msg=None, gradient: bool = False):
        """`torch.testing.assert_close` on the CPU with the test's tolerance; with `--dtype`, with the dtype's (for a
        parameter gradient if `gradient`)."""
        actual, expected = actual.detach().cpu(), expected.detach().cpu()
        if not self.narrowed:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)
            return
        actual, expected = actual.double(), expected.double()
        tolerance = self.tolerance(gradient)
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(
            actual, expected, rtol=max(rtol, tolerance), atol=max(atol, tolerance * scale), msg=msg
        )
        error, size = (actual - expected).norm().item(), expected.norm().item()
        assert error <= NORM_FRACTION * tolerance * size + atol, (
            f"{msg or 'tensor'}: ||actual - expected|| = {error:.3g} is over {NORM_FRACTION * tolerance:.3g} of "
            f"||expected|| = {size:.3g} ({self.dtype})"
        )

    def assert_same_greedy(self, generated, expected, relative_gaps, prompt_length: int):
        """Greedy tokens equal the ground truth's. With `--dtype`, a row may part from it only at a step where the
        ground truth's best logit led the second by less than the dtype's rounding (a near tie that either side may
        break); `relative_gaps[step]` [batch] is that lead over the largest |logit| (`greedy_without_cache` records
        it)."""
        generated, expected = generated.cpu(), expected.cpu()
        if torch.equal(generated, expected):
            return
        assert self.narrowed, f"greedy tokens differ:\n{generated.tolist()}\n{expected.tolist()}"
        length = min(generated.shape[1], expected.shape[1])
        parted = False
        for row in range(expected.shape[0]):
            differs = (generated[row, prompt_length:length] != expected[row, prompt_length:length]).nonzero()
            if len(differs) == 0:
                continue
            step, parted = differs[0].item(), True
            gap, bound = relative_gaps[step][row].item(), 2 * self.tolerance()
            assert gap <= bound, (
                f"row {row} parts from the greedy ground truth at step {step}, where the best logit led by {gap:.3g} of "
                f"the largest: more than {self.dtype} rounding ({bound:.3g})"
            )
        assert parted, f"the generations differ in length only: {generated.shape[1]} and {expected.shape[1]} tokens"


def relative_top2_gap(last_logits: torch.Tensor) -> torch.Tensor:
    """[batch, vocab] -> [batch]: how far the best logit leads the second, as a fraction of the largest |logit| (what
    `Precision.assert_same_greedy` allows near ties by)."""
    best_two = last_logits.float().topk(2, dim=-1).values
    return ((best_two[:, 0] - best_two[:, 1]) / last_logits.float().abs().amax(-1)).cpu()


def greedy_without_cache(model, input_ids, attention_mask, steps, relative_gaps=None):
    """Greedy decoding by re-running the full forward each step: the ground truth for cached decoding.

    `relative_gaps`, a list, receives each step's `relative_top2_gap` (what `Precision.assert_same_greedy` allows near
    ties by)."""
    for _ in range(steps):
        with torch.no_grad():
            logits = model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=generation_position_ids(attention_mask),
                use_cache=False,  # no cache object at all: the ground truth must not share the cache code
            ).logits
        if relative_gaps is not None:
            relative_gaps.append(relative_top2_gap(logits[:, -1]))
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=-1)
    return input_ids


def sharpen_attention(model, scale: float = 8.0):
    """Scale q/k projections so attention is far from uniform: randomly initialised tiny models attend almost
    uniformly, which would hide a key in the wrong place from token-level comparisons."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


def record_sdpa_calls(monkeypatch) -> list[dict]:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        calls.append({"queries": query.shape[-2], "keys": key.shape[-2], "mask": attn_mask, "is_causal": is_causal})
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    return calls


# Three layers so that a layer list like "0,2" leaves one in the middle; GQA with 2 KV heads for 4 query heads.
CONVERSION_TINY = {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 2}


TINY_SOURCES = {
    # Llama 3: GQA, llama3 rope scaling (the scaling bends the low frequencies), tied embeddings.
    "llama3": lambda: LlamaForCausalLM(
        LlamaConfig(
            **CONVERSION_TINY,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    # Llama 2 style with biases everywhere, plain MHA, untied head.
    "llama_bias": lambda: LlamaForCausalLM(
        LlamaConfig(**{**CONVERSION_TINY, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True)
    ),
    "mistral_sliding": lambda: MistralForCausalLM(MistralConfig(**CONVERSION_TINY, sliding_window=8)),
    "mistral_full": lambda: MistralForCausalLM(MistralConfig(**CONVERSION_TINY, sliding_window=None)),
    # Qwen2: q/k/v bias without o bias, untied head, sliding window on the layers from max_window_layers on.
    "qwen2_sliding": lambda: Qwen2ForCausalLM(
        Qwen2Config(**CONVERSION_TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    ),
}


def make_source(kind: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    """A random tiny checkpoint whose every weight (biases and norms included) is away from its init value."""
    torch.manual_seed(seed)
    model = TINY_SOURCES[kind]().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(folder, **save_kwargs)
    return folder


def folder_listing(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# argv: READY TARGET NTH ENTRY ARGS...; TARGET is "module:attribute.path", ENTRY "module:function", the command line's
# main (`iha.cli.main:main`, or a research task's `research.synthetic.cli:main`), called with ARGS. Before the NTH call
# of TARGET the process writes READY and sleeps, so the test knows exactly where it is when it sends a signal.
PAUSING_COMMAND = """
import functools, importlib, signal, sys, time
from pathlib import Path

# As in an interactive shell, even when the tests run as a background job (which starts with Ctrl-C ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
ready, target, nth = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
module_name, _, attribute_path = target.partition(":")
owner = importlib.import_module(module_name)
*owners, name = attribute_path.split(".")
for part in owners:
    owner = getattr(owner, part)
real, calls = getattr(owner, name), []

@functools.wraps(real)
def pause_before_nth_call(*args, **kwargs):
    calls.append(1)
    if len(calls) == nth:
        ready.write_text("paused")
        time.sleep(600)
    return real(*args, **kwargs)

setattr(owner, name, pause_before_nth_call)
entry_module, _, entry_function = sys.argv[4].partition(":")
main = getattr(importlib.import_module(entry_module), entry_function)
sys.exit(main(sys.argv[5:]))
"""
# Generous: the subprocess imports torch and transformers on a shared machine. Only a hang reaches it.
LIMIT_S = 300


def subprocess_env() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_process(
    ready: Path, target: str, nth: int, argv: list[str], cwd: Path | None = None, entry: str = "iha.cli.main:main"
) -> subprocess.Popen:
    """`iha ARGV` (or the command line whose main is `entry`) in a subprocess that has stopped before the `nth` call of
    `target` (fails the test if it never gets there)."""
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSING_COMMAND, str(ready), target, str(nth), entry, *argv],
        env=subprocess_env(),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + LIMIT_S
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"`{entry} {' '.join(argv)}` never reached {target}:\n{out}\n{err}")
        time.sleep(0.05)
    return process


def finish(process: subprocess.Popen) -> tuple[str, str]:
    return process.communicate(timeout=LIMIT_S)


GSM8K_TRAIN = TEST_DATA / "gsm8k" / "train.jsonl"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# `iha-sft` flags of a short test run: a loss every step, no trackers, checkpoints or progress bars.
QUIET_RUN_FLAGS = ["--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def free_port() -> int:
    """A TCP port free now: for a test's server, or `accelerate launch --main_process_port` (the default 29500 is
    shared by every run)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def gsm8k_openthoughts_rows(limit: int = 64) -> list[dict]:
    return gsm8k_file_to_openthoughts(GSM8K_TRAIN, limit=limit)


def gsm8k_message_rows(limit: int = 16) -> list[dict]:
    """GSM8K question -> worked solution as `messages` rows: a few hundred tokens each, no system prompt, for the
    shortest runs."""

    return [
        {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}
        for row in read_gsm8k_rows(GSM8K_TRAIN, limit=limit)
    ]


def build_tiny_tokenizer(save_dir: str | Path | None = None, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on 300 GSM8K rows in OpenThoughts format, SmolLM2's ChatML template and specials."""
    rows = gsm8k_openthoughts_rows(300)
    texts = [row["system"] for row in rows] + [turn["value"] for row in rows for turn in row["conversations"]]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


# The tiny IHA model of the training tests (GQA, tied embeddings), on top of `TINY` and sized to the
# tokenizer: `tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))`.
TRAINING_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_key_value_heads=2,
    num_pseudo_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def mixing_parameters(model) -> dict[str, torch.Tensor]:
    """name -> value of every mixing coefficient / collapse weight, names without PEFT's wrapper parts (on the CPU,
    like `identity_mixing`'s, wherever the model is)."""
    found = {}
    for name, parameter in model.named_parameters():
        if ".head_mixing." in name and "original_module" not in name:
            found[name.replace("modules_to_save.default.", "").replace("base_model.model.", "")] = (
                parameter.detach().cpu().clone()
            )
    return found


def identity_mixing(model) -> dict[str, torch.Tensor]:
    """The identity value of every mixing parameter of `model`, keyed like `mixing_parameters`."""
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, iha.IHAHeadMixing) and "original_module" not in module_name:
            prefix = module_name.replace("modules_to_save.default", "").replace("base_model.model.", "").rstrip(".")
            for name, value in module.identity_tensors().items():
                found[f"{prefix}.{name}"] = value
    return found


# Servers of the package (`iha serve`) in their own process: on a free port, waited for until they answer /health,
# stopped with SIGTERM (killed if they linger); the environment of a fresh machine; faults a test can set off inside
# the server; plain HTTP requests.


def fresh_machine_environment(folder: Path, **variables: str) -> dict:
    """The environment of a machine that never used Hugging Face: HOME and HF_HOME empty folders under `folder`,
    offline (and `variables` on top)."""
    home, hf_home = folder / "home", folder / "hf_home"
    home.mkdir(parents=True, exist_ok=True)
    hf_home.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "HOME": str(home), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    # VLLM_LOGGING_LEVEL too: importing TRL (this test tree imports iha.training) sets it to ERROR in this process,
    # which would silence the INFO lines the vLLM tests read from a child's log; a user's shell has no such value.
    for name in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "TRANSFORMERS_CACHE",
        "XDG_CACHE_HOME",
        "IHA_API_KEY",
        "VLLM_LOGGING_LEVEL",
    ):
        environment.pop(name, None)
    return {**environment, **variables}


def health_says_ok(response) -> bool:
    """`iha serve`'s /health: {"status": "ok"} (503 with another status while its engine is down)."""
    return json.load(response).get("status") == "ok"


def start_server(
    command: list[str], cwd: Path, env: dict, log: Path, port: int, seconds: float, healthy=health_says_ok, **popen
) -> subprocess.Popen:
    """Start `command` (output to `log`) and wait until http://127.0.0.1:PORT/health is `healthy` (a response's
    predicate); AssertionError with the log's end if it exits or does not answer within `seconds` (the process is
    stopped then)."""
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
                if healthy(response):
                    return process
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise AssertionError(f"{command} did not answer /health within {seconds} s:\n{log.read_text()[-3000:]}")


def stop_server(
    process: subprocess.Popen, seconds: float = 30, signum: int = signal.SIGTERM, process_group: bool = False
) -> bool:
    """`signum` (SIGTERM), then kill after `seconds`; whether it stopped on the signal (True also if it had already
    exited). With `process_group`, both go to the process group of a server started in a session of its own
    (`start_new_session=True`), so that its worker processes stop with it."""
    if process.poll() is not None:
        return True

    def send(signal_number: int) -> None:
        if process_group:
            os.killpg(process.pid, signal_number)
        else:
            process.send_signal(signal_number)

    send(signum)
    try:
        process.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
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
from iha.cli.main import main
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


# An lm-eval multiple-choice task over a local JSONL file of {"question", "choices", "label"} rows; `doc_to_text` is
# the prompt as lm-eval's Jinja template reads it.
LM_EVAL_MULTIPLE_CHOICE_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: "{doc_to_text}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_lm_eval_task(task_dir: Path, name: str, questions: list[dict], doc_to_text: str) -> None:
    """`questions` as lm-eval task `name` in `task_dir` (pass `--include_path task_dir --tasks name`)."""
    from iha.utils.atomic_files import write_jsonl_atomic

    data_file = write_jsonl_atomic(questions, task_dir / "questions.jsonl")
    task = LM_EVAL_MULTIPLE_CHOICE_TASK.format(name=name, data_file=data_file, doc_to_text=doc_to_text)
    (task_dir / f"{name}.yaml").write_text(task)


# ---------------------------------------------------------------------------------------------------------------------
# The shell commands of the README and the docs pages (tests/docs/ runs them as written; the vLLM ones run in
# `make vllm-test`, tests/serving/vllm_plugin/test_vllm_docs_commands.py)
# ---------------------------------------------------------------------------------------------------------------------

# The pages whose shell blocks a user copies, and the fences that mark a shell block.
DOC_PAGES = ["README.md", *sorted(f"docs/{page.name}" for page in (REPO_ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("```bash", "```shell", "```sh", "```console")
# "# needs the Hub" / "# needs GPUs" in a command's comment: what cannot run on an offline CPU-only machine.
NEEDS_MARKER = re.compile(r"#.*needs (the Hub|GPUs)")
ENVIRONMENT_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SERVER_PROGRAMS = {"vllm": "serve", "iha": "serve", "mlx_lm.server": None}


@dataclass
class PageCommand:
    """One command of a page's shell blocks, as one line (continuation lines joined), with what it needs."""

    text: str
    marker: str  # "the Hub", "GPUs" or ""
    engine: str  # "vllm" for what runs in .venv-vllm (vLLM itself, or a client of a vLLM server), else ""

    @property
    def environment(self) -> dict:
        return split_command(self.text)[0]

    @property
    def argv(self) -> list[str]:
        return split_command(self.text)[1]


def split_command(text: str) -> tuple[dict, list[str]]:
    """A command's leading `NAME=value` assignments, and its words (`nice` and its flags dropped: what runs)."""
    words = shlex.split(text, comments=True)
    environment = {}
    while words and ENVIRONMENT_ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        environment[name] = value
    if words[:1] == ["nice"]:
        words = words[3:] if words[1:2] == ["-n"] else words[1:]
    return environment, words


def program_name(argv: list[str]) -> str:
    """The program a command runs, without its folder (`.venv-vllm/bin/vllm` is `vllm`)."""
    return Path(argv[0]).name


def starts_server(argv: list[str]) -> bool:
    name = program_name(argv)
    return name in SERVER_PROGRAMS and (SERVER_PROGRAMS[name] is None or argv[1:2] == [SERVER_PROGRAMS[name]])


def runs_vllm(argv: list[str]) -> bool:
    """vLLM itself (`vllm ...`), lm-eval's vLLM backend, or Python importing vLLM."""
    name = program_name(argv)
    if name == "vllm":
        return True
    if name == "lm_eval" and "--model" in argv[:-1]:
        return argv[argv.index("--model") + 1] == "vllm"
    return name.startswith("python") and any("from vllm" in word or "import vllm" in word for word in argv)


def page_commands(page: str) -> list[PageCommand]:
    """Every command of the page's shell blocks, in order. A `curl` belongs to the engine of the server started last
    on the page before it."""
    commands, in_block, pending, server_engine = [], False, "", ""
    for line in (REPO_ROOT / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_block = line.strip() in SHELL_FENCES if not in_block else False
            continue
        if not in_block or (not pending and (not line.strip() or line.lstrip().startswith("#"))):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = pending + line.strip()
        pending = ""
        marker = NEEDS_MARKER.search(text)
        argv = split_command(text)[1]
        engine = "vllm" if runs_vllm(argv) else ""
        if starts_server(argv):
            server_engine = engine
        elif program_name(argv) == "curl":
            engine = server_engine
        commands.append(PageCommand(text, marker.group(1) if marker else "", engine))
    return commands


def page_snippets(page: str) -> list[str]:
    """The page's ```python blocks."""
    return re.findall(r"^```python\n(.*?)^```", (REPO_ROOT / page).read_text(encoding="utf-8"), re.S | re.M)
