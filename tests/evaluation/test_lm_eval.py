"""lm-evaluation-harness on a converted IHA folder, through `trust_remote_code`, with a task that needs no download.

The task is a local YAML (multiple choice over a few GSM8K test questions: the right number against two wrong ones)
found through `--include_path`. The `lm_eval` command runs in a fresh process that never imports `iha`, so the
folder's own code (auto_map + the copied modeling files) is what loads the model. An exact conversion must give
the same log-likelihoods, hence the same accuracy, as the source Llama.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testing_utils import tiny_llama_for_tokenizer, write_lm_eval_task
from transformers import AutoTokenizer

from iha.conversion import llama_to_iha
from iha.conversion.builtin import smollm2_dir
from iha.data.gsm8k import gsm8k_final_answer
from iha.data.messages import read_jsonl


TASK_NAME = "iha_local_gsm8k_mc"


def lm_eval_command() -> list[str]:
    executable = Path(sys.executable).with_name("lm_eval")
    if executable.exists():
        return [str(executable)]
    if shutil.which("lm_eval"):
        return [shutil.which("lm_eval")]
    pytest.skip("the lm_eval command is not installed (pip install iha-transformers[eval])")


def write_task(task_dir: Path, test_data: Path, num_questions: int = 6) -> None:
    rows = read_jsonl(test_data / "gsm8k" / "test.jsonl", limit=num_questions)
    questions = []
    for index, row in enumerate(rows):
        answer = int(gsm8k_final_answer(row["answer"]))
        choices = [str(answer), str(answer + 1), str(2 * answer + 3)]
        label = index % 3  # the right answer is not always first
        choices[0], choices[label] = choices[label], choices[0]
        questions.append({"question": row["question"], "choices": choices, "label": label})
    write_lm_eval_task(task_dir, TASK_NAME, questions, doc_to_text="Question: {{question}}\\nAnswer:")


def run_lm_eval(model_dir: Path, task_dir: Path, output_dir: Path) -> tuple[dict, list[dict]]:
    command = lm_eval_command() + [
        "--model", "hf",
        "--model_args", f"pretrained={model_dir},trust_remote_code=True,dtype=float32",
        "--tasks", TASK_NAME,
        "--include_path", str(task_dir),
        "--device", "cpu",
        "--batch_size", "4",
        "--output_path", str(output_dir),
        "--log_samples",
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Run outside the repository, so that `iha` cannot be imported from the working directory by accident.
    completed = subprocess.run(command, cwd=output_dir.parent, env=environment, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (results_file,) = glob.glob(str(output_dir / "**" / "results_*.json"), recursive=True)
    (samples_file,) = glob.glob(str(output_dir / "**" / f"samples_{TASK_NAME}_*.jsonl"), recursive=True)
    results = json.loads(Path(results_file).read_text())
    samples = read_jsonl(samples_file)
    return results, samples


@pytest.mark.slow
def test_lm_eval_runs_on_a_converted_iha_folder(tmp_path, test_data):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    llama = tiny_llama_for_tokenizer(tokenizer, max_position_embeddings=512, pad_token_id=None)
    converted = llama_to_iha(llama, num_pseudo_heads=2).eval()  # exact by default
    for name, model in (("llama", llama), ("iha", converted)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    saved_config = json.loads((tmp_path / "iha" / "config.json").read_text())
    assert saved_config["auto_map"]["AutoModelForCausalLM"] == "modeling_iha.IHAForCausalLM"
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    write_task(task_dir, test_data)

    iha_results, iha_samples = run_lm_eval(tmp_path / "iha", task_dir, tmp_path / "out_iha")
    llama_results, llama_samples = run_lm_eval(tmp_path / "llama", task_dir, tmp_path / "out_llama")

    assert iha_results["config"]["model_args"]["pretrained"] == str(tmp_path / "iha")
    # lm_eval really loaded the IHA model: its parameter count includes the head-mixing coefficients.
    mixing_parameters = sum(p.numel() for n, p in converted.named_parameters() if ".head_mixing." in n)
    assert mixing_parameters > 0
    assert iha_results["config"]["model_num_parameters"] == llama.num_parameters() + mixing_parameters
    accuracy = iha_results["results"][TASK_NAME]["acc,none"]
    assert 0.0 <= accuracy <= 1.0
    assert iha_results["results"][TASK_NAME]["sample_len"] == 6
    assert accuracy == llama_results["results"][TASK_NAME]["acc,none"]
    # Per choice: the same log-likelihood to fp32 precision.
    assert len(iha_samples) == len(llama_samples) == 6
    for ours, theirs in zip(
        sorted(iha_samples, key=lambda s: s["doc_id"]), sorted(llama_samples, key=lambda s: s["doc_id"])
    ):
        our_loglikelihoods = [float(response[0][0]) for response in ours["resps"]]
        their_loglikelihoods = [float(response[0][0]) for response in theirs["resps"]]
        assert len(our_loglikelihoods) == 3
        assert our_loglikelihoods == pytest.approx(their_loglikelihoods, abs=1e-4)
        assert all(value < 0 for value in our_loglikelihoods)
