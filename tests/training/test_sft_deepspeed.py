"""DeepSpeed ZeRO-3 in two CPU processes (gloo), as TRL users launch it: `accelerate launch --config_file
examples/accelerate/deepspeed_zero3.yaml` (the GPU configuration as shipped) with `--num_processes 2` and the
trainer's `--use_cpu true`, running `iha sft` and, in a second run, TRL's `SFTTrainer` from Python
(`with_iha_mixing(SFTTrainer)`, a model loaded in bf16, bf16 mixed precision).

Unlike FSDP (test_sft_fsdp.py), nothing IHA-specific switches DeepSpeed on here: with `use_cpu` the Trainer's
accelerator still takes accelerate's DeepSpeed plugin, DeepSpeed picks its CPU accelerator (no GPU) and joins the
processes over gloo. Loading under the Trainer's config makes `from_pretrained` build the model inside ZeRO-3's
partitioned initialisation, so no process ever holds every weight; the driver records that at load time.

Same data, same global batch: 2 processes x 2 rows against 1 process x 2 rows x 2 accumulation steps, in fp32.
Measured here (deepspeed 0.19.8): the 4 logged losses (about 6.5-6.9) differ by at most 9.5e-7 from one process's,
the saved models' logits by 8.1e-6.
In the bf16 run DeepSpeed builds every parameter in bf16, the mixing too (its compute copy), and keeps an fp32
master copy of each partition for the optimizer: the mixing's own group is fp32 and its entries move by amounts that
bf16 cannot hold.

DeepSpeed compiles a small C++ operation (its CPU shared-memory communication) with the system's compiler the
first time a process group starts, into ~/.cache/torch_extensions, once; later runs load it. Measured on this busy
2-core machine (load average near 28): the module's runs took 476 s in a fresh clone with an empty extensions folder,
166 s with the operation compiled.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from testing_utils import (
    REPO_ROOT,
    TRAINING_MODEL,
    build_tiny_tokenizer,
    free_port,
    gsm8k_message_rows,
    gsm8k_openthoughts_rows,
    run_without_the_project,
    tiny_iha_model,
    tokenizer_settings,
)

from iha.cli.sft import run_cli
from iha.data.messages import write_jsonl
from iha.training import is_mixing_parameter


pytestmark = pytest.mark.deepspeed


pytest.importorskip("deepspeed")

ZERO3_CONFIG = REPO_ROOT / "examples" / "accelerate" / "deepspeed_zero3.yaml"
STEPS = 4
LEARNING_RATE, MIXING_LEARNING_RATE = 3e-3, 3e-2
NUM_MIXING_PARAMETERS = 8  # 2 IHA layers x alpha_q, alpha_k, alpha_v, collapse

# Runs in every process: `iha sft`'s own entry point (`cli`) or TRL's SFTTrainer from Python (`python`), and reports
# how the model was loaded, what the optimizer holds, the losses, and the trained model's logits on given ids.
DRIVER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import torch
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    report_prefix, route, ids_file, *argv = sys.argv[1:]
    loaded = {}
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def recording_from_pretrained(cls, *args, **kwargs):
        # What the model is right after loading: under ZeRO-3's partitioned initialisation each process holds only its
        # partition of each parameter (`ds_tensor`), and the parameter itself is empty.
        model = from_pretrained(cls, *args, **kwargs)
        loaded["zero3"] = is_deepspeed_zero3_enabled()
        loaded["parameters"] = {
            name: {
                "empty": parameter.data.numel() == 0,
                "numel": getattr(parameter, "ds_numel", parameter.numel()),
                "partition": parameter.ds_tensor.numel() if hasattr(parameter, "ds_tensor") else None,
                "dtype": str(parameter.dtype).removeprefix("torch."),
            }
            for name, parameter in model.named_parameters()
        }
        return model

    transformers.AutoModelForCausalLM.from_pretrained = classmethod(recording_from_pretrained)


    def train_with_sft_trainer(model_dir, data, output_dir, mixing_learning_rate):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        from iha.training import with_iha_mixing

        # The config first, as TRL's scripts do: it turns ZeRO-3's partitioned loading on for from_pretrained.
        args = SFTConfig(
            output_dir=output_dir, use_cpu=True, bf16=True, max_steps=4, per_device_train_batch_size=2,
            learning_rate=3e-3, max_length=640, packing=True, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=0,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
        trainer = with_iha_mixing(SFTTrainer)(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            mixing_learning_rate=float(mixing_learning_rate),
        )
        trainer.train()
        trainer.save_model()
        return trainer


    if route == "cli":
        from iha.cli.sft import run_cli

        trainer = run_cli(argv)  # it ends with trainer.end(): no collective call after it
    else:
        trainer = train_with_sft_trainer(*argv)

    model = trainer.model
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    zero3 = trainer.optimizer.optimizer  # DeepSpeed's ZeRO-3 optimizer, around the Trainer's own
    groups = [
        {
            "name": group["iha_group"],
            "lr": group["initial_lr"],
            "parameters": [names[id(parameter)] for parameter in zero3.fp16_groups[index]],
            "master_dtype": str(zero3.fp32_partitioned_groups_flat[index].dtype).removeprefix("torch."),
        }
        for index, group in enumerate(zero3.optimizer.param_groups)
    ]
    report = {
        "world_size": trainer.args.world_size,
        "deepspeed": trainer.is_deepspeed_enabled,
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "groups": groups,
        "loaded": loaded,
    }
    if route == "python":
        # Collective calls (`iha sft` ends its process group when it is done; this script ends it below): every
        # process gathers the mixing's fp32 master copy and runs the trained model, rank 0 writes its logits.
        report["mixing_master"] = {
            name: safe_get_full_fp32_param(parameter).tolist()
            for name, parameter in model.named_parameters()
            if ".head_mixing." in name
        }
        model.eval()
        with torch.no_grad():
            logits = model(torch.load(ids_file)).logits.float()
        if trainer.args.process_index == 0:
            torch.save(logits, f"{report_prefix}logits.pt")
        trainer.end()  # as a script ends: the trackers finished, the process group destroyed
    Path(f"{report_prefix}{trainer.args.process_index}.json").write_text(json.dumps(report))

    # The last line of a DeepSpeed run, as `iha sft` ends one (docs/training.md): no interpreter teardown, where gloo's
    # threads can abort a finished process. (The cli route calls run_cli, which returns the trainer this report needs;
    # that `iha sft`'s main makes this call after a DeepSpeed run is tests/training/test_process_exit.py's.)
    from iha.training import exit_after_deepspeed_run

    exit_after_deepspeed_run(0)
    """
)

# A process that never imports the package loads each saved folder through its remote code, as a Hub user would.
REMOTE_CODE_LOGITS = """
import sys
sys.modules["iha"] = None
import torch
from transformers import AutoModelForCausalLM
ids = torch.load(sys.argv[1])
for folder, dtype, output in zip(sys.argv[2::3], sys.argv[3::3], sys.argv[4::3]):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=getattr(torch, dtype)).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    mixing = [p.dtype for n, p in model.named_parameters() if ".head_mixing." in n]
    assert mixing and all(dtype == torch.float32 for dtype in mixing), mixing
    with torch.no_grad():
        torch.save(model(ids).logits.float(), output)
"""


def sft_flags(model_dir: Path, data: Path, output_dir: Path) -> list[str]:
    return [
        "--use_cpu", "true",
        "--bf16", "false",
        "--model_name_or_path", str(model_dir),
        "--dataset_name", str(data),
        "--output_dir", str(output_dir),
        "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "2",
        "--learning_rate", str(LEARNING_RATE),
        "--mixing_learning_rate", str(MIXING_LEARNING_RATE),
        "--max_length", "640",
        "--packing",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--seed", "0",
    ]  # fmt: skip


def launch_zero3(folder: Path, name: str, mixed_precision: str, route: str, arguments: list[str]) -> dict:
    """Two processes under examples/accelerate/deepspeed_zero3.yaml, on CPU; the report of each, rank 0's logits."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ZERO3_CONFIG),
        "--num_processes", "2",
        "--mixed_precision", mixed_precision,
        "--main_process_port", str(free_port()),
        str(folder / "driver.py"), str(folder / f"{name}-rank"), route, str(folder / "ids.pt"), *arguments,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    reports = [json.loads((folder / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]
    logits = folder / f"{name}-ranklogits.pt"
    return {"reports": reports, "logits": torch.load(logits) if logits.exists() else None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-3 `iha sft` in fp32; one process with gradient accumulation; ZeRO-3 SFTTrainer in bf16; the saved folders'
    logits through remote code."""
    folder = tmp_path_factory.mktemp("zero3")
    tokenizer = build_tiny_tokenizer()
    model_dir = folder / "model"
    # An IHA layer, a sliding IHA layer and a standard one.
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
    openthoughts = write_jsonl(gsm8k_openthoughts_rows(48), folder / "openthoughts.jsonl")
    messages = write_jsonl(gsm8k_message_rows(48), folder / "messages.jsonl")
    (folder / "driver.py").write_text(DRIVER, encoding="utf-8")
    ids = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    torch.save(ids, folder / "ids.pt")

    cli = launch_zero3(folder, "cli", "no", "cli", sft_flags(model_dir, openthoughts, folder / "cli"))
    python_arguments = [str(model_dir), str(messages), str(folder / "python"), str(MIXING_LEARNING_RATE)]
    python = launch_zero3(folder, "python", "bf16", "python", python_arguments)
    single = run_cli([*sft_flags(model_dir, openthoughts, folder / "single"), "--gradient_accumulation_steps", "2"])
    single_losses = {entry["step"]: entry["loss"] for entry in single.state.log_history if "loss" in entry}

    remote = [
        *(str(folder / "cli"), "float32", str(folder / "cli-remote.pt")),
        *(str(folder / "single"), "float32", str(folder / "single-remote.pt")),
        *(str(folder / "python"), "bfloat16", str(folder / "python-remote.pt")),
    ]
    result = run_without_the_project(REMOTE_CODE_LOGITS, str(folder / "ids.pt"), *remote, cwd=folder)
    assert result.returncode == 0, result.stderr[-5000:]
    remote_logits = {name: torch.load(folder / f"{name}-remote.pt") for name in ("cli", "single", "python")}
    initial = {name: value for name, value in model.state_dict().items() if is_mixing_parameter(name)}
    return {"cli": cli, "python": python, "single_losses": single_losses, "remote": remote_logits, "initial": initial}


def check_loaded_partitioned(report: dict, dtype: str):
    loaded = report["loaded"]
    assert loaded["zero3"]
    assert loaded["parameters"], "from_pretrained was not called in the process"
    for name, parameter in loaded["parameters"].items():
        # Each process holds half of every parameter (rounded up), none whole.
        assert parameter["empty"] and parameter["partition"] == -(-parameter["numel"] // 2), (name, parameter)
        assert parameter["dtype"] == dtype, (name, parameter)


def check_mixing_group(report: dict):
    groups = {group["name"]: group for group in report["groups"]}
    assert set(groups) == {"decay", "no_decay", "mixing"}
    assert groups["mixing"]["lr"] == MIXING_LEARNING_RATE
    assert groups["decay"]["lr"] == groups["no_decay"]["lr"] == LEARNING_RATE
    assert len(groups["mixing"]["parameters"]) == NUM_MIXING_PARAMETERS
    assert all(is_mixing_parameter(name) for name in groups["mixing"]["parameters"])
    others = groups["decay"]["parameters"] + groups["no_decay"]["parameters"]
    assert others and not any(is_mixing_parameter(name) for name in others)
    # The optimizer steps fp32 master partitions, whatever dtype the model computes in.
    assert all(group["master_dtype"] == "float32" for group in groups.values())


@pytest.mark.slow
def test_iha_sft_under_zero3_loads_partitioned_and_keeps_the_mixing_group(runs):
    for report in runs["cli"]["reports"]:
        assert report["world_size"] == 2 and report["deepspeed"] and report["zero_stage"] == 3
        check_loaded_partitioned(report, "float32")
        check_mixing_group(report)


@pytest.mark.slow
def test_iha_sft_under_zero3_logs_the_losses_of_one_process(runs):
    single = [runs["single_losses"][step] for step in range(1, STEPS + 1)]
    for report in runs["cli"]["reports"]:
        losses = [report["losses"][str(step)] for step in range(1, STEPS + 1)]
        # fp32; only how the gradients are reduced differs. Measured at most 9.5e-7 apart.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-6, atol=1e-6)
    assert single[-1] < single[0] - 0.2  # it trained


@pytest.mark.slow
def test_iha_sft_under_zero3_saves_the_trained_model_for_remote_code(runs):
    # The saved folder, loaded through its own code, computes what the model one process trains computes (whose
    # losses the partitioned model's matched step by step, above). Measured: logits (at most 1.3) 8.1e-6 apart, the
    # weights 2.3e-6 (FSDP's: 1.2e-7): in Adam's first steps an update is about lr * g / (|g| + eps), so the rounding
    # of a near-zero gradient, which the two reductions order differently, moves its weight by up to lr's scale.
    torch.testing.assert_close(runs["remote"]["cli"], runs["remote"]["single"], rtol=0, atol=5e-5)


@pytest.mark.slow
def test_sft_trainer_from_python_under_zero3_in_bf16(runs):
    for report in runs["python"]["reports"]:
        assert report["world_size"] == 2 and report["deepspeed"] and report["zero_stage"] == 3
        check_loaded_partitioned(report, "bfloat16")
        check_mixing_group(report)
        for name, master in report["mixing_master"].items():
            master, initial = torch.tensor(master), runs["initial"][name]
            # Every coefficient learned, and the master copy holds values that bf16 cannot: the mixing trains in fp32.
            assert (master != initial).all(), name
            assert (master != master.bfloat16().float()).any(), name
        losses = [report["losses"][str(step)] for step in range(1, STEPS + 1)]
        assert losses[-1] < losses[0] - 0.2
    # The saved bf16 folder through remote code (its mixing loaded in fp32, cast to bf16 in the forward, as the trained
    # model's compute copy was): the trained model's logits, measured equal.
    torch.testing.assert_close(runs["remote"]["python"], runs["python"]["logits"], rtol=0, atol=1e-6)
