"""Shared fixtures: tiny IHA / Llama models, the tiny synthetic comparison, the offline environment, and the device
the model tests run on.

The model tests that take the `precision` fixture (the model against the reference, caches and generation, packed
rows, torch.compile) run on `--device` (default cpu) in `--dtype` (default: each test's own dtype, mostly float64
against a float64 reference); `pytest --device cuda --dtype bfloat16 tests/models` runs them on a GPU in bf16, with
tolerances that follow the dtype. `scripts/gpu_check.py` runs them that way.
"""

import os
import sys
from pathlib import Path

import pytest
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Test modules import the shared helpers by name (`from testing_utils import ...`).
TESTS_DIR = Path(__file__).resolve().parent
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

from testing_utils import TEST_DATA, Precision, start_process, tiny_llama_for_tokenizer  # noqa: E402

from iha.cli.arguments import option_spellings  # noqa: E402


# The slowest folders run first (the README's and notebooks' commands, the GPU check's CPU run, the demo): under
# xdist's file-by-file distribution (`make test`) a slow file started last would leave the other worker idle.
SLOW_FOLDERS_FIRST = ("docs", "scripts", "demo")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        folder = Path(str(item.fspath)).resolve().relative_to(TESTS_DIR).parts[0]
        return SLOW_FOLDERS_FIRST.index(folder) if folder in SLOW_FOLDERS_FIRST else len(SLOW_FOLDERS_FIRST)

    items.sort(key=rank)  # stable: in their collected order within each rank


@pytest.fixture
def one_torch_thread():
    """One torch thread for a test of tiny layers, so that a busy machine's other threads do not slow every step
    down; the previous count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A folder with a tiny random Llama, the real SmolLM2 tokenizer and its chat template."""
    from transformers import AutoTokenizer

    from iha.conversion.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_for_tokenizer(tokenizer, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_results():
    """The tiny relation-composition comparison (`python -m research.synthetic --preset tiny`), trained once per test
    module that reads it (tests/research/synthetic/test_synthetic_training.py and test_synthetic_report.py)."""
    from research.synthetic import run_comparison
    from research.synthetic.config import TINY

    torch.manual_seed(0)
    return run_comparison(TINY, progress=False)


@pytest.fixture
def test_data() -> Path:
    """The repository's GSM8K and MATH-500 rows (tests/fixtures/data)."""
    return TEST_DATA


@pytest.fixture
def paused_command():
    """paused_command(ready, target, nth, argv, entry=...): `iha ARGV` (or the command line whose main is `entry`) in a
    subprocess stopped before the nth call of target (see testing_utils.start_process), for tests that signal a command
    mid-work; killed after the test if still alive."""
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


@pytest.fixture
def precision(request) -> Precision:
    config = request.config
    dtype = config.getoption("--dtype")
    return Precision(
        device=torch.device(config.getoption("--device")),
        dtype=None if dtype is None else getattr(torch, dtype),
        compile_backend=config.getoption("--compile_backend"),
    )
