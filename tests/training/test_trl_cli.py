"""TRL's own `trl sft` command trains a saved IHA folder through `auto_map` + `--trust_remote_code`, in a process
where `import iha` fails."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testing_utils import (
    TRAINING_MODEL,
    build_tiny_tokenizer,
    gsm8k_openthoughts_rows,
    identity_mixing,
    mixing_parameters,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM

from iha.cli.main import main as iha_main
from iha.data.messages import load_sft_dataset, write_jsonl
from iha.hub.model_card import read_model_card
from iha.training.chat_template import SMOLLM2_TRAINING_CHAT_TEMPLATE, write_chat_template


@pytest.mark.slow
def test_trl_sft_cli_trains_a_converted_folder_without_the_iha_package(tmp_path):
    # The `trl` console script of this interpreter's environment (CI runs `.venv/bin/python -m pytest` off PATH).
    trl = Path(sys.executable).with_name("trl")
    if not trl.is_file():
        trl = shutil.which("trl") or pytest.fail("the `trl` command is not installed (pip install trl)")
    model_dir = tmp_path / "iha-model"
    tokenizer = build_tiny_tokenizer(model_dir)
    initial = tiny_iha_model(seed=5, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    initial.save_pretrained(model_dir)
    assert "auto_map" in json.loads((model_dir / "config.json").read_text())

    # TRL's own conversion would drop the system prompt of OpenThoughts rows: hand it `messages` rows instead.
    data_dir = tmp_path / "data"
    messages = load_sft_dataset(gsm8k_openthoughts_rows(48))
    write_jsonl(({"messages": row["messages"]} for row in messages), data_dir / "train.jsonl")
    template = write_chat_template(SMOLLM2_TRAINING_CHAT_TEMPLATE, tmp_path / "smollm2_training.jinja")

    # A package named `iha` that refuses to import, ahead of the installed one on the path.
    blocker = tmp_path / "blocker" / "iha"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("trl sft must reach IHA through auto_map")\n')
    workdir = tmp_path / "work"
    workdir.mkdir()
    environment = {
        **os.environ,
        "PYTHONPATH": str(blocker.parent),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
    }
    probe = subprocess.run([sys.executable, "-c", "import iha"], cwd=workdir, env=environment, capture_output=True)
    assert probe.returncode != 0 and b"auto_map" in probe.stderr

    output_dir = tmp_path / "trl-out"
    command = [
        str(trl), "sft",
        "--model_name_or_path", str(model_dir),
        "--trust_remote_code",
        "--dataset_name", str(data_dir),
        "--output_dir", str(output_dir),
        "--max_steps", "6",
        "--per_device_train_batch_size", "2",
        "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant",
        "--max_length", "640",
        "--packing",
        "--assistant_only_loss",
        "--chat_template_path", str(template),
        "--bf16", "false",
        "--logging_steps", "1",
        "--save_strategy", "steps",
        "--save_steps", "6",
        "--report_to", "none",
        "--seed", "0",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    state = json.loads((output_dir / "checkpoint-6" / "trainer_state.json").read_text())
    history = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(history) == 6 and all(math.isfinite(loss) for loss in history)
    assert sum(history[-2:]) < sum(history[:2]), history

    # The output is again a Hub-ready IHA folder (code files and auto_map travel along) with trained weights.
    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "iha" and "AutoModelForCausalLM" in config["auto_map"]
    assert (output_dir / "modeling_iha.py").is_file() and (output_dir / "configuration_iha.py").is_file()
    trained = AutoModelForCausalLM.from_pretrained(output_dir)
    identity = identity_mixing(trained)
    for name, value in mixing_parameters(trained).items():
        assert (value - identity[name]).abs().max() > 1e-4, name
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)

    # TRL's card names no local base ("fine-tuned version of [None]"), loads without remote code and links to TRL;
    # `iha card` makes it the IHA card and keeps TRL's own sections, with nothing pointing outside the folder.
    assert "[None]" in (output_dir / "README.md").read_text() and "://" in (output_dir / "README.md").read_text()
    assert iha_main(["card", str(output_dir), "--base-model", str(model_dir)]) == 0
    card = read_model_card(output_dir)
    assert "None" not in (output_dir / "README.md").read_text() and "://" not in (output_dir / "README.md").read_text()
    assert "Citations" in card.sections and "Framework versions" in card.sections["Training procedure"]
    assert "trust_remote_code=True" in card.sections["How to load"] and "Quick start" not in card.sections
    assert "Training procedure" in card.sections and "base_model" not in card.metadata
    assert f"`{model_dir.name}`" in card.intro and "iha" in card.metadata["tags"]
    assert (output_dir / "LICENSE").is_file() and card.metadata["license"] and "License" in card.sections
