"""Two processes on CPU (gloo): `accelerate launch` of iha-sft trains one model, and both ranks end with it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from testing_utils import (
    TRAINING_MODEL,
    build_tiny_tokenizer,
    free_port,
    gsm8k_openthoughts_rows,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM

from iha.data.messages import write_jsonl


REPO_ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIG = REPO_ROOT / "examples" / "accelerate" / "multi_cpu.yaml"

# Runs iha-sft's own entry point in every process, then each rank saves what it ended with.
DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from iha.cli.sft import run_cli

    trainer = run_cli(sys.argv[1:])
    rank = trainer.args.process_index
    model = trainer.accelerator.unwrap_model(trainer.model)
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    report = {"state": state, "world_size": trainer.args.world_size, "global_step": trainer.state.global_step,
              "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}
    torch.save(report, Path(trainer.args.output_dir) / f"rank{rank}.pt")
    """
)


def launch(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_process_cpu_run_agrees_on_final_weights(tmp_path):
    tokenizer = build_tiny_tokenizer()
    model_dir = tmp_path / "model"
    initial = tiny_iha_model(seed=4, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    initial.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(gsm8k_openthoughts_rows(48), tmp_path / "train.jsonl")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    output_dir = tmp_path / "out"

    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ACCELERATE_CONFIG),
        "--num_processes", "2",
        "--main_process_port", str(free_port()),
        str(driver),
        "--use_cpu", "true",
        "--model_name_or_path", str(model_dir),
        "--dataset_name", str(data),
        "--output_dir", str(output_dir),
        "--max_steps", "6",
        "--per_device_train_batch_size", "2",
        "--learning_rate", "3e-3",
        "--mixing_learning_rate", "3e-2",
        "--max_length", "640",
        "--packing",
        "--bf16", "false",
        "--logging_steps", "1",
        "--report_to", "none",
        "--save_strategy", "no",
        "--disable_tqdm", "true",
        "--seed", "0",
    ]  # fmt: skip
    result = launch(command, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    reports = [torch.load(output_dir / f"rank{rank}.pt") for rank in (0, 1)]
    assert [report["world_size"] for report in reports] == [2, 2]
    assert [report["global_step"] for report in reports] == [6, 6]
    assert all(len(report["losses"]) == 6 for report in reports)
    rank0, rank1 = (report["state"] for report in reports)
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"

    # They agree on a trained model (not on the untouched start) and on what rank 0 saved.
    initial_state = initial.state_dict()
    assert max((rank0[name] - initial_state[name]).abs().max().item() for name in rank0) > 1e-3
    assert any(not torch.equal(rank0[name], initial_state[name]) for name in rank0 if ".head_mixing." in name)
    saved = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()
    for name in rank0:
        torch.testing.assert_close(saved[name], rank0[name], rtol=0, atol=0)
    # The final save went through one staging folder (both processes saved into the main one's), renamed into place.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["driver.py", "model", "out", "train.jsonl"]


@pytest.mark.slow
def test_processes_launched_apart_are_refused_with_the_fix(tmp_path):
    # `--multi_gpu` on a machine without GPUs starts 2 processes that accelerate would not connect: each would train
    # its own copy on the whole dataset. Every process refuses in one line that names the fix, and nothing is written.
    tokenizer = build_tiny_tokenizer()
    model_dir = tmp_path / "model"
    tiny_iha_model(seed=4, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer)).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(gsm8k_openthoughts_rows(8), tmp_path / "train.jsonl")
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
        "-m", "iha.cli", "sft",
        "--model_name_or_path", str(model_dir),
        "--dataset_name", str(data),
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1",
        "--bf16", "false",
        "--report_to", "none",
    ]  # fmt: skip
    result = launch(command, tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    refusal = (
        "iha sft: error: 2 processes were launched but training would run in 1: without a GPU, pass `--use_cpu true`"
    )
    assert output.count(refusal) == 2, output[-3000:]
    assert "ValueError" not in output
    assert not (tmp_path / "out").exists()
