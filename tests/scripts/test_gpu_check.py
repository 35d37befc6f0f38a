"""The GPU check (scripts/gpu_check.py) run on the CPU with --quick, so that it never rots before a GPU runs it; what
it carries to the GPU machine (SmolLM2 cut to its first layers); and its rules: a CUDA test skipped on a CUDA run
fails the step, a step past its limit is stopped with everything it started."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from testing_utils import REPO_ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from iha.conversion import builtin


sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import bench_vllm  # noqa: E402
import gpu_check  # noqa: E402
import gpu_check_steps  # noqa: E402
from gpu_check_results import DetailedFailure, StepFailed, markdown_summary, one_line, read_junit  # noqa: E402
from gpu_smollm2 import cut_gguf  # noqa: E402


STEPS = ["wheels", "environment", "smollm2", "tests_float32", "compile", "sft", "eval", "tests_bfloat16"]
STEPS += ["tests_training", "bench_perf", "vllm", "bench_sft", "synthetic", "paper_regime"]


@pytest.mark.slow
def test_quick_cpu_run_passes_every_step_and_writes_the_summaries(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick"]
    # Nothing carried: the wheels are the environment's own, SmolLM2 is cut here from the installed wheel.
    command += ["--carry_dir", str(tmp_path / "nothing-carried"), "--work_dir", str(work), "--budget", "1500", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    failed = {step["name"]: step["error"] for step in summary["steps"] if step["status"] not in ("passed", "skipped")}
    assert result.returncode == 0 and not failed, failed or result.stdout[-3000:]

    assert [step["name"] for step in summary["steps"]] == STEPS
    assert sorted(path.name for path in out.iterdir()) == [
        "bench_perf.md",
        "bench_sft.md",
        "steps.log",
        "summary.json",
        "summary.md",
    ]
    steps = {step["name"]: step for step in summary["steps"]}
    for name in ("tests_float32", "tests_bfloat16", "compile", "tests_training"):
        assert steps[name]["details"]["failed"] == 0 and steps[name]["details"]["passed"] >= 1, name
    # The flex gradients need CUDA: skipped here, and said so.
    assert any("no backward on CPU" in skip["reason"] for skip in steps["tests_float32"]["details"]["skips"])
    assert steps["smollm2"]["details"]["layers"] == 1 and steps["smollm2"]["details"]["num_pseudo_heads"] == 2
    assert steps["sft"]["details"]["precision"] == "bf16 mixed"
    assert steps["eval"]["details"]["problems"] == 8
    assert set(steps["bench_sft"]["details"]["ratios"]) == {"global"}
    assert steps["synthetic"]["details"]["device"] == "cpu"
    paper_regime = steps["paper_regime"]["details"]
    assert paper_regime["device"] == "cpu" and len(paper_regime["seconds_per_epoch"]) == 12
    assert paper_regime["projected_grid_minutes"] == pytest.approx(
        sum(paper_regime["seconds_per_epoch"].values()) * 10 * 3 / 60
    )
    # vLLM's FlashAttention path needs CUDA: skipped, which fails nothing, saying how to run it.
    assert steps["vllm"]["status"] == "skipped" and "pip install -e .[vllm]" in steps["vllm"]["details"]["skipped"]
    markdown = (out / "summary.md").read_text()
    assert "every step passed or was skipped (vllm)" in markdown and "| vllm | skipped |" in markdown
    assert all(f"| {name} | passed |" in markdown for name in STEPS if name != "vllm")
    assert "cpu: 12 runs of one epoch; the whole grid (3 seeds, up to 10 epochs) projected at" in markdown


@pytest.fixture(scope="module")
def cut_smollm2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("carry")
    gguf = folder / "SmolLM2-135M-Instruct-1-layers.gguf"
    cut_gguf(builtin.smollm2_gguf_path(), gguf, 1)
    return gguf


@pytest.mark.slow
def test_cut_smollm2_is_the_real_model_up_to_its_first_layer(cut_smollm2, tmp_path):
    folder = builtin.smollm2_dir(cache_dir=tmp_path, gguf_path=cut_smollm2)
    cut = AutoModelForCausalLM.from_pretrained(folder)
    full = AutoModelForCausalLM.from_pretrained(builtin.smollm2_dir())
    assert cut.config.num_hidden_layers == 1 and full.config.num_hidden_layers == 30
    full_weights = full.state_dict()
    kept = {name for name in full_weights if not name.startswith("model.layers.") or name.startswith("model.layers.0.")}
    assert set(cut.state_dict()) == kept
    for name, tensor in cut.state_dict().items():
        assert torch.equal(tensor, full_weights[name]), name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(builtin.smollm2_dir()).chat_template
    with pytest.raises(ValueError, match=r"--layers must be in 1\.\.30"):
        cut_gguf(builtin.smollm2_gguf_path(), tmp_path / "none.gguf", 0)


def junit_report(path, skip_reason: str):
    path.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.models.test_packed" name="test_a" time="0.1"/>'
        f'<testcase classname="tests.models.test_packed" name="test_flex_b" time="0.1"><skipped type="pytest.skip" '
        f'message="{skip_reason}"/></testcase></testsuite></testsuites>'
    )
    return path


def test_a_cuda_test_skipped_on_a_cuda_run_fails_the_step(tmp_path):
    report = junit_report(
        tmp_path / "junit.xml", "torch's flex attention has no backward on CPU; runs with --device cuda"
    )
    on_cpu = read_junit(report, "cpu")
    assert (on_cpu["passed"], on_cpu["skipped"]) == (1, 1)
    assert on_cpu["flex"] == {"test_flex_b": "skipped"}
    with pytest.raises(StepFailed, match="1 CUDA test"):
        read_junit(report, "cuda")
    other = junit_report(tmp_path / "other.xml", "could not import 'flash_attn'")
    assert read_junit(other, "cuda")["skipped"] == 1  # a package the machine lacks is reported, not failed


def test_a_step_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert gpu_check.run_until([sys.executable, "-c", script], dict(os.environ), log, time.monotonic() + 3) is None
    assert time.monotonic() - started < 30
    child = Path(f"/proc/{pid_file.read_text()}")  # the process the step started was killed with it
    time.sleep(0.5)
    assert not child.exists() or (child / "stat").read_text().split()[2] == "Z"


def run_vllm_step(tmp_path, device: str, fake_vllm: str | None = None) -> dict:
    """The check with its vllm step only; `fake_vllm`: the body of a `vllm` package put where the steps import
    packages first (the folder the carried wheels go to), so that the probe sees vLLM importable or broken
    whatever this environment has."""
    work = tmp_path / "work"
    if fake_vllm is not None:
        package = work / "site" / "vllm"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(fake_vllm)
    arguments = [str(tmp_path / "out"), "--device", device, "--steps", "vllm", "--work_dir", str(work)]
    arguments += ["--carry_dir", str(tmp_path / "nothing-carried")]
    check = gpu_check.Check(gpu_check.parse_args(arguments))
    assert check.run() == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (step,) = summary["steps"]
    assert step["status"] == "skipped" and step["error"] is None
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "every step passed or was skipped (vllm)" in markdown
    assert f"| vllm | skipped | 0 | 0 | {step['details']['skipped']} |" in markdown
    return step


def test_vllm_step_is_skipped_on_the_cpu(tmp_path):
    reason = run_vllm_step(tmp_path, "cpu")["details"]["skipped"]
    assert reason.startswith("vLLM's FlashAttention path needs a CUDA device (this run: --device cpu)")
    assert "pip install -e .[vllm]" in reason


def test_vllm_step_is_skipped_on_cuda_where_vllm_does_not_import(tmp_path):
    broken = 'raise ImportError("libcudart.so.12: cannot open shared object file")'
    reason = run_vllm_step(tmp_path, "cuda", fake_vllm=broken)["details"]["skipped"]
    assert "vLLM is not importable here (ImportError: libcudart.so.12: cannot open shared object file)" in reason
    assert "pip install -e .[vllm]" in reason


def test_vllm_step_runs_on_cuda_where_vllm_imports(tmp_path, monkeypatch):
    args = gpu_check.parse_args([str(tmp_path / "out"), "--device", "cuda"])
    steps = gpu_check.Steps(args, tmp_path / "work")
    (tmp_path / "work" / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "work" / "site" / "vllm" / "__init__.py").write_text("")
    assert steps.vllm_skip_reason() is None
    # Where the model tests take 8 pytest-xdist workers, the plugin's tests stay in one process (its engines share
    # the GPU one at a time).
    monkeypatch.setattr(gpu_check_steps, "PYTEST_WORKERS", 8)
    steps.environment = {"packages": {"xdist": "3.8.0"}}
    by_name = {step.name: step for step in steps.in_order()}
    assert by_name["tests_float32"].commands()[0][-len(gpu_check_steps.MODEL_TEST_FILES) - 2 :][:2] == ["-n", "8"]
    tests, bench = by_name["vllm"].commands()
    assert "--junitxml=" + str(tmp_path / "work" / "junit-vllm.xml") in tests and "-n" not in tests
    assert "tests/serving/vllm_plugin/test_vllm_exactness.py" in tests
    assert bench[1:] == [
        str(REPO_ROOT / "benchmarks" / "bench_vllm.py"),
        "--quick",
        "--output-dir",
        str(tmp_path / "work" / "vllm-bench"),
        "--name",
        "bench_vllm",
    ]


def fake_bench_vllm_report(folder: Path) -> None:
    """bench_vllm.py's JSON for one workload of 4 requests, its ratios computed by the benchmark's own function."""

    def variant(wall_speed, cpu_speed, ttft_wall, decode_flops, same):
        return {
            "decode_tokens_per_second": {"wall": wall_speed, "cpu": cpu_speed},
            "ttft_seconds": {"wall": ttft_wall, "cpu": 2 * ttft_wall},
            "flops": {"decode_step": decode_flops, "prefill": 10 * decode_flops},
            "same_tokens_as_base": same,
        }

    row = {
        "requests": 4,
        "prompt_lengths": [40, 72, 40, 72],
        "variants": {
            "base": variant(100.0, 50.0, 0.1, 1000, True),
            "iha": variant(80.0, 30.0, 0.2, 2000, True),
            "iha_explicit": variant(40.0, 25.0, 0.3, 2500, False),
        },
    }
    row["ratios"] = {
        name: {clock: bench_vllm.ratios(row, name, clock) for clock in ("cpu", "wall")}
        for name in ("iha", "iha_explicit")
    }
    meta = {"vllm": "0.32.0", "torch": "2.11.0", "dtype": "bfloat16", "machine": "NVIDIA H200, 16 CPU cores"}
    payload = {"meta": meta, "kv_bytes_per_token": {"base": 512, "iha": 1024, "iha_explicit": 1024}, "rows": [row]}
    folder.mkdir(parents=True)
    (folder / "bench_vllm.json").write_text(json.dumps(payload))
    (folder / "bench_vllm.md").write_text("# vLLM: IHA (the plugin) vs the base Llama\n")


def vllm_junit_report(path: Path, failed: bool) -> None:
    failure = '<failure message="assert [3, 4] == [3, 5]">tokens</failure>' if failed else ""
    path.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.serving.vllm_plugin.test_vllm_exactness" name="test_prefix_caching_off"/>'
        '<testcase classname="tests.serving.vllm_plugin.test_vllm_exactness" '
        f'name="test_greedy_tokens_and_logprobs_equal_the_reference[gqa-shared-P2-folded]">{failure}</testcase>'
        "</testsuite></testsuites>"
    )


def test_vllm_reader_reports_the_tests_and_the_benchmark_ratios(tmp_path):
    args = gpu_check.parse_args([str(tmp_path / "out"), "--device", "cuda"])
    (tmp_path / "out").mkdir()
    steps = gpu_check.Steps(args, tmp_path / "work")
    fake_bench_vllm_report(tmp_path / "work" / "vllm-bench")
    vllm_junit_report(tmp_path / "work" / "junit-vllm.xml", failed=False)

    details = steps.read_vllm("")
    assert (details["passed"], details["failed"], details["skipped"]) == (2, 0, 0)
    folded, explicit = details["bench_rows"]
    assert folded["variant"] == "iha" and folded["requests"] == 4
    assert folded["decode_speed"] == pytest.approx({"wall": 0.8, "cpu": 0.6})
    assert folded["decode_flops"] == pytest.approx(2.0)
    assert folded["speed_over_inverse_flops"] == pytest.approx({"wall": 1.6, "cpu": 1.2})
    assert folded["ttft"] == pytest.approx({"wall": 2.0, "cpu": 2.0})
    assert explicit["decode_speed"]["wall"] == pytest.approx(0.4) and not explicit["same_tokens_as_base"]
    assert (tmp_path / "out" / "bench_vllm.md").is_file()

    outcome = gpu_check.Outcome("vllm", "the vLLM plugin", "passed", details=details)
    assert (
        one_line(outcome) == "2 passed, 0 failed, 0 skipped; bench_vllm IHA / base decode tok/s (wall): 4 requests 0.80"
    )
    summary = {"meta": {"started": "now", "device": "cuda", "quick": False, "wall_seconds": 1, "budget_seconds": 450}}
    markdown = markdown_summary({**summary, "environment": {}, "passed": True}, [outcome])
    assert "| 4 | folded | 0.80 (0.60) | 1.60 (1.20) | 2.00 (2.00) | yes |" in markdown
    assert "| 4 | explicit | 0.40 (0.50) |" in markdown

    vllm_junit_report(tmp_path / "work" / "junit-vllm.xml", failed=True)
    with pytest.raises(DetailedFailure, match=r"1 test\(s\) failed: .*gqa-shared-P2-folded") as failure:
        steps.read_vllm("")
    assert failure.value.details["failed"] == 1 and len(failure.value.details["bench_rows"]) == 2
