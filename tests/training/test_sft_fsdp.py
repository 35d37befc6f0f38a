"""FSDP2 in two CPU processes (gloo): iha-sft shards, checkpoints sharded, resumes, and saves the model a single
process trains.

How it runs: `accelerate launch --config_file examples/accelerate/fsdp.yaml` (the GPU configuration as shipped) with
`--num_processes 2 --mixed_precision no --main_process_port PORT` and iha-sft's `--use_cpu true --bf16 false`.
accelerate 1.15 does not refuse FSDP on CPU, it drops it without a word: `--use_cpu` makes its state `MULTI_CPU`
(gloo), and it switches to FSDP only from a GPU-family state, so the processes train plain data parallel. torchrun
with the Trainer's `fsdp` / `fsdp_config` goes through the same accelerate state and does the same. iha-sft switches
the state to FSDP there (`iha.training.trainer.enable_fsdp_on_cpu`), so both routes shard with torch's `fully_shard`; this test
checks that they do (the model is an `FSDPModule`, its parameters and checkpoint are split in two).

Same data, same global batch: 2 processes x 2 rows against 1 process x 2 rows x 2 accumulation steps, so each
micro-batch and its loss are the same, and only the order of the fp32 gradient reduction differs (gloo's reduce-scatter
against the sum of two backward passes). Measured on this model: the 6 logged losses (about 6.4-6.9) differ by at
most 9.5e-7 (two fp32 steps at that size), the final weights by at most 1.2e-7 and the logits by at most 6e-7. The run
resumed from the sharded checkpoint logs the uninterrupted run's losses and ends with its weights bit for bit.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from testing_utils import (
    TRAINING_MODEL,
    build_tiny_tokenizer,
    free_port,
    gsm8k_openthoughts_rows,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM

from iha.cli.sft import run_cli
from iha.data.messages import write_jsonl
from iha.training import is_mixing_parameter


REPO_ROOT = Path(__file__).resolve().parents[2]
FSDP_CONFIG = REPO_ROOT / "examples" / "accelerate" / "fsdp.yaml"
STEPS, CHECKPOINT_STEP = 6, 3
LEARNING_RATE, MIXING_LEARNING_RATE = 3e-3, 3e-2

# Runs iha-sft's own entry point in every process and reports what each one trained with.
DRIVER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from iha.cli.sft import run_cli

    trainer = run_cli(sys.argv[2:])
    names = {id(parameter): name for name, parameter in trainer.model.named_parameters()}
    groups = [
        {
            "name": group["iha_group"],
            "lr": group["initial_lr"],
            "parameters": [names[id(parameter)] for parameter in group["params"]],
            "sharded": all(
                isinstance(parameter, DTensor) and parameter.placements == (Shard(0),) for parameter in group["params"]
            ),
        }
        for group in trainer.optimizer.param_groups
    ]
    report = {
        "world_size": trainer.args.world_size,
        "fsdp2": trainer.accelerator.is_fsdp2,
        "fsdp_module": isinstance(trainer.model, FSDPModule),
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "groups": groups,
    }
    Path(f"{sys.argv[1]}{trainer.args.process_index}.json").write_text(json.dumps(report))
    """
)


def sft_flags(model_dir: Path, data: Path, output_dir: Path) -> list[str]:
    return [
        "--use_cpu", "true",
        "--model_name_or_path", str(model_dir),
        "--dataset_name", str(data),
        "--output_dir", str(output_dir),
        "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "2",
        "--learning_rate", str(LEARNING_RATE),
        "--mixing_learning_rate", str(MIXING_LEARNING_RATE),
        "--max_length", "640",
        "--packing",
        "--bf16", "false",
        "--logging_steps", "1",
        "--save_strategy", "steps",
        "--save_steps", str(CHECKPOINT_STEP),
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--seed", "0",
    ]  # fmt: skip


def launch_fsdp(driver: Path, report_prefix: Path, flags: list[str], cwd: Path) -> list[dict]:
    """Two processes under examples/accelerate/fsdp.yaml, on CPU; the report of each."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(FSDP_CONFIG),
        "--num_processes", "2",
        "--mixed_precision", "no",
        "--main_process_port", str(free_port()),
        str(driver), str(report_prefix), *flags,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads(Path(f"{report_prefix}{rank}.json").read_text()) for rank in (0, 1)]


def logged_losses(report: dict, first_step: int = 1) -> list[float]:
    return [loss for step, loss in sorted((int(step), loss) for step, loss in report.items()) if step >= first_step]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with gradient accumulation; FSDP in two processes; FSDP resumed from its step-3 checkpoint."""
    folder = tmp_path_factory.mktemp("fsdp")
    tokenizer = build_tiny_tokenizer()
    model_dir = folder / "model"
    # An IHA layer, a sliding IHA layer and a standard one: every kind of layer is sharded.
    model = tiny_iha_model(
        seed=4,
        randomize=False,
        **TRAINING_MODEL,
        **tokenizer_settings(tokenizer),
        num_hidden_layers=3,
        attention_types=["iha_full_attention", "iha_sliding_attention", "full_attention"],
        sliding_window=64,
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(gsm8k_openthoughts_rows(48), folder / "train.jsonl")
    driver = folder / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")

    fsdp = launch_fsdp(driver, folder / "fsdp-rank", sft_flags(model_dir, data, folder / "fsdp"), folder)
    resume_flags = ["--resume_from_checkpoint", str(folder / "fsdp" / f"checkpoint-{CHECKPOINT_STEP}")]
    resumed_flags = [*sft_flags(model_dir, data, folder / "resumed"), *resume_flags]
    resumed = launch_fsdp(driver, folder / "resumed-rank", resumed_flags, folder)
    single = run_cli([*sft_flags(model_dir, data, folder / "single"), "--gradient_accumulation_steps", "2"])
    single_losses = {entry["step"]: entry["loss"] for entry in single.state.log_history if "loss" in entry}
    return {"folder": folder, "single_losses": single_losses, "fsdp": fsdp, "resumed": resumed}


@pytest.mark.slow
def test_two_processes_shard_the_model_and_the_mixing_parameters_keep_their_learning_rate(runs):
    for report in runs["fsdp"]:
        assert report["world_size"] == 2 and report["fsdp2"] and report["fsdp_module"]
        groups = {group["name"]: group for group in report["groups"]}
        assert set(groups) == {"decay", "no_decay", "mixing"}
        assert all(group["sharded"] for group in groups.values())
        assert groups["mixing"]["lr"] == MIXING_LEARNING_RATE
        assert groups["decay"]["lr"] == groups["no_decay"]["lr"] == LEARNING_RATE
        # Every mixing parameter (2 IHA layers x alpha_q, alpha_k, alpha_v, collapse) is in its group, none elsewhere.
        assert len(groups["mixing"]["parameters"]) == 8
        assert all(is_mixing_parameter(name) for name in groups["mixing"]["parameters"])
        others = groups["decay"]["parameters"] + groups["no_decay"]["parameters"]
        assert not any(is_mixing_parameter(name) for name in others)


def test_loss_curve_matches_one_process(runs):
    single = [runs["single_losses"][step] for step in range(1, STEPS + 1)]
    for report in runs["fsdp"]:
        losses = logged_losses(report["losses"])
        assert len(losses) == STEPS
        # fp32, only the gradient reduction order differs; measured at most 9.5e-7 apart.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-6, atol=1e-6)
    assert single[-1] < single[0] - 0.2  # it trained


def test_checkpoint_is_sharded(runs):
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = runs["folder"] / "fsdp" / f"checkpoint-{CHECKPOINT_STEP}"
    # A distributed checkpoint: one file per process for the model and the optimizer, no full model folder.
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        files = sorted(path.name for path in (checkpoint / part).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], part
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    # Each weight is stored as two halves along its first dimension, one written by each process.
    metadata = FileSystemReader(checkpoint / "pytorch_model_fsdp_0").read_metadata().state_dict_metadata
    for suffix in ("model.embed_tokens.weight", "layers.1.self_attn.q_proj.weight", "head_mixing.alpha_q"):
        name = next(name for name in metadata if name.endswith(suffix))  # accelerate prefixes the keys
        rows = metadata[name].size[0]
        assert sorted(chunk.offsets[0] for chunk in metadata[name].chunks) == [0, rows // 2], name


def test_resumed_run_continues_the_uninterrupted_one(runs):
    uninterrupted = logged_losses(runs["fsdp"][0]["losses"], first_step=CHECKPOINT_STEP + 1)
    for report in runs["resumed"]:
        assert report["fsdp_module"]
        resumed = logged_losses(report["losses"], first_step=CHECKPOINT_STEP + 1)
        assert len(resumed) == STEPS - CHECKPOINT_STEP
        # Same processes, same reduction order: measured equal to the last bit.
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-6, atol=1e-6)
    resumed_model = AutoModelForCausalLM.from_pretrained(runs["folder"] / "resumed").state_dict()
    uninterrupted_model = AutoModelForCausalLM.from_pretrained(runs["folder"] / "fsdp").state_dict()
    for name, value in uninterrupted_model.items():
        torch.testing.assert_close(resumed_model[name], value, rtol=0, atol=1e-6, msg=name)


def test_final_model_is_the_one_process_model(runs):
    folder = runs["folder"]
    sharded, single = folder / "fsdp", folder / "single"
    # A whole Hub-ready model, with the IHA code files (not torch's FSDP sources) and auto_map.
    assert sorted(path.name for path in sharded.glob("*.py")) == sorted(path.name for path in single.glob("*.py"))
    auto_map = [json.loads((path / "config.json").read_text())["auto_map"] for path in (sharded, single)]
    assert auto_map[0] == auto_map[1]
    # The same tensors: the tied lm_head is not written a second time from FSDP's gathered (unshared) copies.
    with safe_open(sharded / "model.safetensors", "pt") as saved, safe_open(single / "model.safetensors", "pt") as one:
        assert sorted(saved.keys()) == sorted(one.keys())
        assert "lm_head.weight" not in saved.keys()
    trained = AutoModelForCausalLM.from_pretrained(sharded).eval()
    reference = AutoModelForCausalLM.from_pretrained(single).eval()
    initial = AutoModelForCausalLM.from_pretrained(folder / "model")
    for name, value in reference.state_dict().items():
        # Measured: at most 1.2e-7 apart after 6 Adam steps; the mixing weights moved from their start.
        torch.testing.assert_close(trained.state_dict()[name], value, rtol=0, atol=1e-5, msg=name)
        if is_mixing_parameter(name):
            assert not torch.allclose(value, initial.state_dict()[name], atol=1e-3), name
    input_ids = torch.randint(0, trained.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(trained(input_ids).logits, reference(input_ids).logits, rtol=0, atol=1e-5)
