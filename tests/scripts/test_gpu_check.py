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
import gpu_check  # noqa: E402
from gpu_check_results import StepFailed, read_junit  # noqa: E402
from gpu_smollm2 import cut_gguf  # noqa: E402


STEPS = ["wheels", "environment", "smollm2", "tests_float32", "compile", "sft", "eval", "tests_bfloat16"]
STEPS += ["tests_training", "bench_perf", "bench_sft", "synthetic", "paper_regime"]


@pytest.mark.slow
def test_quick_cpu_run_passes_every_step_and_writes_the_summaries(shared_data, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick"]
    # Nothing carried: the wheels are the environment's own, SmolLM2 is cut here from the installed wheel.
    command += ["--carry_dir", str(tmp_path / "nothing-carried"), "--work_dir", str(work), "--budget", "1500", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    failed = {step["name"]: step["error"] for step in summary["steps"] if step["status"] != "passed"}
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
    markdown = (out / "summary.md").read_text()
    assert "every step passed" in markdown and all(f"| {name} | passed |" in markdown for name in STEPS)


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
