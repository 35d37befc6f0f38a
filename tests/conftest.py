"""Shared fixtures: tiny IHA / Llama models, the tiny synthetic comparison, the offline environment, and the device
the model tests run on.

The model tests that take the `precision` fixture (the model against the reference, caches and generation, packed
rows, torch.compile) run on `--device` (default cpu) in `--dtype` (default: each test's own dtype, mostly float64
against a float64 reference); `pytest --device cuda --dtype bfloat16 tests/models` runs them on a GPU in bf16, with
tolerances that follow the dtype. `scripts/gpu_check.py` runs them that way.
"""

import copy
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
# The benchmark data beside the checkout (../shared/data), or where IHA_SHARED_DATA points (the GPU check carries a
# copy of the rows the tests read to a machine that has the checkout alone).
SHARED_DATA = Path(os.environ.get("IHA_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
sys.path.insert(0, str(TESTS_DIR))

# Under pytest-xdist (`make test`) the workers share the cores: torch threads per worker, not per core each, so
# that they do not oversubscribe them. The processes the tests start (commands, notebook kernels, remote-code loads)
# inherit the same share through OMP_NUM_THREADS: a child with a thread per core beside a busy worker leaves its
# OpenMP threads spin-waiting for a core (a 2-worker run here: the remote-code SmolLM2 test 30 s -> 19 s, flex
# attention 36 s -> 19 s, the run's CPU time 119 s -> 93 s). A share set by the caller is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    if not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import iha  # noqa: E402  (registers the Auto classes)
from iha.arguments import option_spellings  # noqa: E402


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


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A folder with a tiny random Llama, the real SmolLM2 tokenizer and its chat template."""
    from transformers import AutoTokenizer

    from iha.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_for_tokenizer(tokenizer, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_results():
    """The tiny relation-composition comparison (`iha synthetic --preset tiny`), trained once per test module that reads
    it (tests/experiments/test_synthetic_training.py and test_synthetic_report.py)."""
    from iha.synthetic import TINY, run_comparison

    torch.manual_seed(0)
    return run_comparison(TINY, progress=False)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def paused_command():
    """paused_command(ready, target, nth, argv): `iha ARGV` in a subprocess stopped before the nth call of target
    (see fault_utils.start_process), for tests that signal a command mid-work; killed after the test if still alive."""
    from fault_utils import start_process

    processes = []

    def start(*args, **kwargs):
        process = start_process(*args, **kwargs)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()


# --- the device and dtype of the model tests ------------------------------------------------------------------------

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


def pytest_addoption(parser):
    group = parser.getgroup("iha", "where the model tests run (tests that take the `precision` fixture)")
    group.addoption("--device", default="cpu", help="torch device of the model tests: cpu (default), cuda, cuda:1, ...")
    group.addoption(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="dtype of the models under test (default: each test's own); the reference stays float64 on the CPU and "
        "tolerances follow the dtype",
    )
    group.addoption(
        *option_spellings("--compile_backend"),
        default="aot_eager",
        choices=["aot_eager", "inductor"],
        help="torch.compile backend of tests/models/test_compile.py (default aot_eager: inductor's C++ code "
        "generation takes minutes per graph on a small CPU)",
    )


def pytest_configure(config):
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device here; run on a CUDA machine or with "
            "--device cpu."
        )
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {device}: the model tests run on cpu or cuda devices.")


def pytest_report_header(config):
    device = torch.device(config.getoption("--device"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtype = config.getoption("--dtype") or "each test's own"
    return f"iha model tests: device {device} ({name}), dtype {dtype}, compile backend " + config.getoption(
        "--compile_backend"
    )


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


@pytest.fixture
def precision(request) -> Precision:
    config = request.config
    dtype = config.getoption("--dtype")
    return Precision(
        device=torch.device(config.getoption("--device")),
        dtype=None if dtype is None else getattr(torch, dtype),
        compile_backend=config.getoption("--compile_backend"),
    )
