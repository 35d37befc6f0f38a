# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The two arms of `iha ab`: SFT of a Llama-style model as it is (arm A, "base") and of its IHA conversion (arm B,
"iha"), under one `ABConfig`, and what each run measures (validation loss per row, test accuracy per problem, the
drift of the mixing coefficients from identity, the tokens of every training step).

Everything is written into OUTPUT_DIR, one folder per run, each result file atomically:

    ab_config.json                 the settings; a later call with other settings is refused
    data/{train,validation}.jsonl  the rows each arm trains and validates on, and data/split.json (the indices)
    conversion.json                arm B's model before training against arm A's: max |logit difference|
    selection.json                 arm B's mixing learning rate, chosen on validation loss (seed 0's candidates;
                                   never on the test problems)
    base-seed0/train.json          a run's training curve, step trace, validation losses (and drift for iha-...)
    base-seed0/eval-gsm8k.json     its test answers, per problem
    base-seed0/reference-gsm8k.json  its loss on the test problems' reference solutions, per problem
    base-seed0/training/           the trained model (its checkpoints only while training: they are deleted after)

A later call reuses every result file it finds and resumes an interrupted training from its last checkpoint.
"""

import dataclasses
import gc
import hashlib
import json
import logging
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from .. import IHA_MODEL_TYPES
from ..atomic_files import write_json_atomic, write_jsonl_atomic
from ..data import BOXED_INSTRUCTION, OPENTHOUGHTS_SYSTEM_PROMPT, load_sft_dataset
from ..gsm8k import gsm8k_file_to_openthoughts, gsm8k_to_openthoughts, read_gsm8k_rows
from .config import ABConfig


logger = logging.getLogger(__name__)

ARM_A = "base"  # the source model, trained as it is
ARM_B = "iha"  # its IHA conversion (identity mixing: the same function before training)
CONFIG_NAME = "ab_config.json"


class ABConfigMismatch(ValueError):
    """OUTPUT_DIR holds the runs of an A/B comparison made with other settings."""


def log(message: str) -> None:
    print(f"[iha ab] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Output folder and settings
# ---------------------------------------------------------------------------------------------------------------------


def prepare_output_dir(output_dir: Path, config: ABConfig, fresh: bool = False) -> bool:
    """Record the settings in a new OUTPUT_DIR, or check that an existing one was made with the same settings.
    Returns True when this call recorded them (a new run), False when it continues an earlier one.

    `fresh` removes an earlier A/B output folder (one holding `ab_config.json`) and starts over; a folder that holds
    other files is never removed.
    """
    record = output_dir / CONFIG_NAME
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"{output_dir} is a file: give a folder as --output-dir")
    if fresh and record.is_file():
        shutil.rmtree(output_dir)
    elif output_dir.is_dir() and any(output_dir.iterdir()) and not record.is_file():
        raise FileExistsError(
            f"{output_dir} is not empty and holds no A/B run ({CONFIG_NAME}): choose a new --output-dir"
        )
    if record.is_file():
        earlier = json.loads(record.read_text(encoding="utf-8"))
        now = json.loads(json.dumps(config.to_dict()))  # the form it has once written (tuples -> lists)
        changed = [name for name in sorted(set(earlier) | set(now)) if earlier.get(name) != now.get(name)]
        if changed:
            details = ", ".join(f"{name}: {earlier.get(name)!r} there, {now.get(name)!r} now" for name in changed[:3])
            raise ABConfigMismatch(
                f"{output_dir} holds an A/B run made with other settings ({details}): pass a new --output-dir, "
                "or --fresh to start over there"
            )
        return False
    write_json_atomic(config.to_dict(), record)
    return True


def discard_unstarted_run(output_dir: Path, keep_folder: bool) -> None:
    """Remove what a new run wrote before its first training (the settings, the data split): a run that never
    started leaves no state, so the corrected command is not refused as "a run made with other settings". The
    folder was empty or absent when the run began (`prepare_output_dir`), so everything in it is the run's."""
    for entry in output_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not keep_folder:
        output_dir.rmdir()


def run_name(arm: str, seed: int, mixing_learning_rate: float | None = None) -> str:
    """`base-seed0`, or `iha-seed0-mixlr0.005` (arm B's runs differ by their mixing learning rate too)."""
    if arm == ARM_A:
        return f"{ARM_A}-seed{seed}"
    return f"{ARM_B}-seed{seed}-mixlr{mixing_learning_rate:g}"


def source_model(config: ABConfig) -> str:
    """The model both arms start from: `config.model`, or the built-in SmolLM2-135M-Instruct folder."""
    if config.model is not None:
        return config.model
    from ..builtin import smollm2_dir

    return str(smollm2_dir())


def check_source_is_not_iha(source: str) -> None:
    if AutoConfig.from_pretrained(source).model_type in IHA_MODEL_TYPES:
        raise ValueError(
            f"{source} is already an IHA model: the A/B compares a Llama-style model with its IHA conversion. "
            "Pass the model it was converted from as --model"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Data: training rows, a fixed validation split, test problems
# ---------------------------------------------------------------------------------------------------------------------


def without_system_prompt(row: dict) -> dict:
    """The row without its system prompt (a `system` column, or a leading system turn); the chat template's own
    default system prompt, if it has one, takes its place."""
    row = {key: value for key, value in row.items() if key != "system"}
    for column, role_key in (("conversations", "from"), ("messages", "role")):
        turns = row.get(column)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and turns[0].get(role_key) == "system":
            row[column] = turns[1:]
    return row


def read_training_rows(source: str) -> list[dict]:
    """Rows of a Hub dataset or .jsonl file: GSM8K-style rows (question, answer) in the OpenThoughts format,
    rows of any other schema that `iha.data` reads as they are."""
    rows = read_gsm8k_rows(source, split="train")
    if rows and {"question", "answer"} <= set(rows[0]):
        return [gsm8k_to_openthoughts(row, index) for index, row in enumerate(rows)]
    return rows


def prepare_data(config: ABConfig, output_dir: Path) -> tuple[list[dict], list[dict]]:
    """The training and validation rows, carved once (seeded shuffle) and kept in OUTPUT_DIR/data."""
    data_dir = output_dir / "data"
    train_path, validation_path = data_dir / "train.jsonl", data_dir / "validation.jsonl"
    split_path = data_dir / "split.json"
    if not split_path.is_file():
        rows = read_training_rows(config.train_data)
        num_validation = config.num_validation_rows
        num_train = len(rows) - num_validation if config.num_train_rows is None else config.num_train_rows
        if num_validation + num_train > len(rows) or num_train < 1:
            raise ValueError(
                f"{config.train_data} has {len(rows)} rows: too few for {num_validation} validation rows and "
                f"{num_train} training rows. Lower --num-validation-rows or --num-train-rows"
            )
        order = list(range(len(rows)))
        random.Random(config.split_seed).shuffle(order)
        validation_indices, train_indices = order[:num_validation], order[num_validation : num_validation + num_train]
        if not config.keep_system_prompt:
            rows = [without_system_prompt(row) for row in rows]
        write_jsonl_atomic((rows[i] for i in train_indices), train_path)
        write_jsonl_atomic((rows[i] for i in validation_indices), validation_path)
        split = {
            "source": config.train_data,
            "num_source_rows": len(rows),
            "split_seed": config.split_seed,
            "train_indices": train_indices,
            "validation_indices": validation_indices,
        }
        write_json_atomic(split, split_path)  # last: its presence means both files are complete
    from ..data import read_jsonl

    return read_jsonl(train_path), read_jsonl(validation_path)


def prepare_reference_rows(config: ABConfig) -> list[dict]:
    """The GSM8K test problems with their reference solutions, in the training rows' format (the OpenThoughts
    conversation, without its system prompt where the training rows have none): what `score_reference` scores
    teacher-forced. Problem i is the same row for both arms, so their losses pair per problem."""
    rows = gsm8k_file_to_openthoughts(config.test_data, limit=config.num_reference_problems, split="test")
    return rows if config.keep_system_prompt else [without_system_prompt(row) for row in rows]


def load_test_problems(source: str, benchmark: str, limit: int | None):
    from ..evaluation.math_eval import load_problems

    return load_problems(source, benchmark=benchmark, limit=limit)


# ---------------------------------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------------------------------


def machine_settings() -> dict:
    """Device and precision from the machine: a CUDA device with bf16 mixed precision where it has bf16, else the
    CPU in float32."""
    if torch.cuda.is_available():
        return {"device": "cuda", "bf16": torch.cuda.is_bf16_supported(), "eval_dtype": "bfloat16"}
    return {"device": "cpu", "bf16": False, "eval_dtype": "float32"}


def autocast(settings: dict):
    if settings["bf16"]:
        return torch.autocast(settings["device"], dtype=torch.bfloat16)
    return torch.autocast(settings["device"], enabled=False)


# ---------------------------------------------------------------------------------------------------------------------
# What a run measures
# ---------------------------------------------------------------------------------------------------------------------


class StepTrace(TrainerCallback, ExportableState):
    """The tokens of every micro-batch the model trains on: a digest of the input ids, their count and the count of
    tokens in the loss. Two runs saw the same data in the same order exactly when their traces are equal.

    It is saved with every checkpoint (`ExportableState`), so a resumed run's trace is complete.
    """

    def __init__(self, steps: list | None = None):
        self.steps = list(steps or [])
        self._hook = None

    def state(self) -> dict:
        return {"args": {"steps": self.steps}, "attributes": {}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A resumed run continues the trace of its checkpoint, cut to the steps the checkpoint had finished.
        self.steps = [step for step in self.steps if step["step"] <= state.global_step]
        self._step = state.global_step

        def record(module, positional, keyword):
            if not module.training:
                return
            input_ids = keyword.get("input_ids", positional[0] if positional else None)
            labels = keyword.get("labels")
            ids = input_ids.detach().to("cpu", torch.int64).contiguous()
            entry = {
                "step": self._step + 1,
                "digest": hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16],
                "tokens": int(ids.numel()),
            }
            if labels is not None:
                entry["loss_tokens"] = int((labels[..., 1:] != -100).sum())
            self.steps.append(entry)

        self._hook = model.register_forward_pre_hook(record, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def find_step_trace(trainer) -> StepTrace:
    # A resumed trainer replaces the callback object with one rebuilt from the checkpoint: look it up by type.
    return next(callback for callback in trainer.callback_handler.callbacks if isinstance(callback, StepTrace))


def loss_token_batch(tokenizer, conversations: list[list[dict]]):
    """Right-padded input ids, attention mask and the mask of the tokens in the loss (assistant turns), as training
    computes them (the chat template's `{% generation %}` markers)."""
    encoded = [
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors=None
        )
        for messages in conversations
    ]
    length = max(len(item["input_ids"]) for item in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(encoded), length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    loss_mask = torch.zeros((len(encoded), length), dtype=torch.bool)
    for row, item in enumerate(encoded):
        n = len(item["input_ids"])
        input_ids[row, :n] = torch.tensor(item["input_ids"])
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(item["assistant_masks"], dtype=torch.bool)
    return input_ids, attention_mask, loss_mask


@torch.no_grad()
def validation_losses(model, tokenizer, rows: list[dict], batch_size: int, settings: dict) -> dict:
    """Per row: the summed negative log-likelihood of its assistant tokens and their number (the training loss's
    tokens), so that per-token losses of any set of rows can be formed (`stats.token_loss_bootstrap`)."""
    from ..sft import prepare_tokenizer

    tokenizer = prepare_tokenizer(tokenizer, assistant_only_loss=True)
    conversations = load_sft_dataset(rows)["messages"]
    model.eval()
    device = next(model.parameters()).device
    nll, tokens = [], []
    for start in range(0, len(conversations), batch_size):
        input_ids, attention_mask, loss_mask = loss_token_batch(tokenizer, conversations[start : start + batch_size])
        input_ids, attention_mask, loss_mask = input_ids.to(device), attention_mask.to(device), loss_mask.to(device)
        with autocast(settings):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # Position t predicts token t + 1: a token is in the loss when its own position is an assistant token.
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target_log_probs = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        in_loss = loss_mask[:, 1:]
        nll += (-(target_log_probs * in_loss).sum(dim=1)).tolist()
        tokens += in_loss.sum(dim=1).tolist()
        del logits, log_probs
    total = sum(tokens)
    return {"nll": nll, "tokens": tokens, "loss": sum(nll) / total if total else float("nan")}


def mixing_drift(model) -> list[dict]:
    """Per IHA layer: the Frobenius norm of alpha_q, alpha_k, alpha_v and collapse minus their identity init, and
    relative to the identity's own norm."""
    import iha

    drift = []
    for name, module in model.named_modules():
        if not isinstance(module, iha.IHAHeadMixing):
            continue
        layer = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else len(drift)
        entry = {"layer": layer}
        for parameter_name, identity in module.identity_tensors().items():
            value = getattr(module, parameter_name).detach().float().cpu()
            difference = torch.linalg.vector_norm(value - identity.float()).item()
            entry[parameter_name] = difference
            entry[f"{parameter_name}_relative"] = difference / max(torch.linalg.vector_norm(identity).item(), 1e-12)
        drift.append(entry)
    return sorted(drift, key=lambda entry: entry["layer"])


# ---------------------------------------------------------------------------------------------------------------------
# One run: training, then evaluation
# ---------------------------------------------------------------------------------------------------------------------


def sft_config(config: ABConfig, output_dir: Path, seed: int, mixing_learning_rate: float | None, settings: dict):
    """The one training configuration both arms use; only the mixing learning rate is arm B's own."""
    from ..sft import IHASFTConfig

    # transformers 5.x renamed `gradient_checkpointing` (now a deprecated alias) to `activation_checkpointing`.
    names = {field.name for field in dataclasses.fields(IHASFTConfig)}
    checkpointing_field = (
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    )
    return IHASFTConfig(
        output_dir=str(output_dir),
        seed=seed,
        learning_rate=config.learning_rate,
        mixing_learning_rate=mixing_learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_length=config.max_length,
        packing=True,
        assistant_only_loss=True,
        **{checkpointing_field: config.gradient_checkpointing},
        bf16=settings["bf16"],
        use_cpu=settings["device"] == "cpu",
        logging_steps=1,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=1,
        restore_callback_states_from_checkpoint=True,  # the step trace of a resumed run starts with its checkpoint's
        report_to="none",
        dataloader_num_workers=0,
    )


def train_run(
    run_dir: Path,
    arm: str,
    seed: int,
    mixing_learning_rate: float | None,
    source: str,
    train_rows: list[dict],
    validation_rows: list[dict],
    config: ABConfig,
    settings: dict,
) -> dict:
    """Train one arm with one seed (resuming from the run's last checkpoint if there is one), measure it on the
    validation rows, write `train.json`, and delete the checkpoints. An existing `train.json` is returned as is."""
    from ..sft import train_sft

    result_path = run_dir / "train.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    training_dir = run_dir / "training"
    checkpoint = get_last_checkpoint(str(training_dir)) if training_dir.is_dir() else None
    if checkpoint is not None:
        log(f"{run_dir.name}: resuming from {Path(checkpoint).name}")
    args = sft_config(config, training_dir, seed, mixing_learning_rate, settings)
    started = time.perf_counter()
    trainer = train_sft(
        source,
        train_rows,
        args,
        convert_to_iha=arm == ARM_B,
        iha_options={"num_pseudo_heads": config.num_pseudo_heads} if arm == ARM_B else None,
        callbacks=[StepTrace()],
        resume_from_checkpoint=checkpoint,
    )
    train_seconds = time.perf_counter() - started
    trace = find_step_trace(trainer).steps
    started = time.perf_counter()
    validation = validation_losses(
        trainer.model, trainer.processing_class, validation_rows, config.validation_batch_size, settings
    )
    result = {
        "run": run_dir.name,
        "arm": arm,
        "seed": seed,
        "mixing_learning_rate": mixing_learning_rate,
        "steps": trainer.state.global_step,
        "num_train_rows": trainer.card_details["num_rows"],
        "trained_tokens": sum(step["tokens"] for step in trace),
        "loss_tokens": sum(step.get("loss_tokens", 0) for step in trace),
        "log_history": trainer.state.log_history,
        "step_trace": trace,
        "validation": validation,
        "mixing_drift": mixing_drift(trainer.model) if arm == ARM_B else None,
        "seconds": {"train": train_seconds, "validation": time.perf_counter() - started},
        "resumed_from": Path(checkpoint).name if checkpoint else None,
    }
    write_json_atomic(result, result_path)
    for folder in training_dir.glob("checkpoint-*"):
        shutil.rmtree(folder, ignore_errors=True)  # only needed to resume; the final model stays
    del trainer
    release_memory()
    return result


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def completion_finished(tokenizer, completion: str, max_new_tokens: int) -> bool:
    """Whether a completion ended before the generation limit (re-tokenized length below it: an approximation that
    can count a completion cut exactly at the limit as finished only if re-tokenizing shortens it)."""
    return len(tokenizer(completion, add_special_tokens=False)["input_ids"]) < max_new_tokens


def evaluate_run(
    run_dir: Path, problems, benchmark: str, config: ABConfig, settings: dict, sampled: bool = False
) -> dict:
    """Answer the test problems with a run's trained model (greedy, or sampled with `config.num_samples`), score
    them per problem and write `eval-<benchmark>[-sampled].json`. An existing file is returned as is."""
    from ..evaluation.math_eval import (
        SamplingConfig,
        build_prompt,
        generate_completions,
        load_model_and_tokenizer,
        score_completions,
    )

    result_path = run_dir / f"eval-{benchmark}{'-sampled' if sampled else ''}.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    if sampled:
        sampling = SamplingConfig(
            temperature=config.temperature,
            top_p=config.top_p,
            num_samples=config.num_samples,
            max_new_tokens=config.max_new_tokens,
        )
    else:
        sampling = SamplingConfig(temperature=0.0, num_samples=1, max_new_tokens=config.max_new_tokens)
    model, tokenizer = load_model_and_tokenizer(
        str(run_dir / "training"), dtype=settings["eval_dtype"], device=settings["device"]
    )
    system_prompt = OPENTHOUGHTS_SYSTEM_PROMPT if config.keep_system_prompt else None
    # The training rows' user turn: the boxed-answer instruction, then the question.
    prompts = [build_prompt(tokenizer, BOXED_INSTRUCTION + p.question, "", system_prompt) for p in problems]
    started = time.perf_counter()
    completions = generate_completions(
        model,
        tokenizer,
        prompts,
        sampling,
        batch_size=config.eval_batch_size,
        description=f"{run_dir.name} / {benchmark}{' sampled' if sampled else ''}",
    )
    seconds = time.perf_counter() - started
    scored = score_completions(problems, completions)
    finished = [
        [completion_finished(tokenizer, text, sampling.max_new_tokens) for text in samples] for samples in completions
    ]
    result = {
        "run": run_dir.name,
        "benchmark": benchmark,
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "num_samples": sampling.num_samples,
            "max_new_tokens": sampling.max_new_tokens,
        },
        "metrics": {**scored["metrics"], "finish_rate": sum(map(sum, finished)) / sum(map(len, finished))},
        "num_problems": scored["num_problems"],
        "problems": [
            {
                "id": record["id"],
                "correct_fraction": sum(sample["correct"] for sample in record["samples"]) / len(record["samples"]),
                "majority_correct": bool(record["majority"]["correct"]),
                "finished": done,
                "samples": record["samples"],
                "gold": record["gold"],
            }
            for record, done in zip(scored["problems"], finished)
        ],
        "seconds": seconds,
    }
    write_json_atomic(result, result_path)
    del model
    release_memory()
    return result


def score_reference(run_dir: Path, rows: list[dict], config: ABConfig, settings: dict) -> dict:
    """A run's trained model scored teacher-forced on the reference solutions `rows` (`prepare_reference_rows`):
    per problem the summed negative log-likelihood of the solution's tokens and their number, as the training loss
    counts them, in float32 (bf16 autocast where training used it). Writes `reference-gsm8k.json`; an existing file
    is returned as is."""
    from ..evaluation.math_eval import load_model_and_tokenizer

    result_path = run_dir / "reference-gsm8k.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    model, tokenizer = load_model_and_tokenizer(str(run_dir / "training"), dtype="float32", device=settings["device"])
    started = time.perf_counter()
    losses = validation_losses(model, tokenizer, rows, config.validation_batch_size, settings)
    result = {"run": run_dir.name, "num_problems": len(rows), **losses, "seconds": time.perf_counter() - started}
    write_json_atomic(result, result_path)
    del model
    release_memory()
    return result


@torch.no_grad()
def check_conversion(source: str, validation_rows: list[dict], config: ABConfig, settings: dict, num_rows: int = 4):
    """Arm B's model before training against arm A's on the first validation rows: the largest |logit difference|
    over the rows' real tokens, and both validation losses (equal up to rounding for an exact conversion)."""
    from ..sft import load_model_for_sft

    tokenizer = AutoTokenizer.from_pretrained(source)
    rows = validation_rows[:num_rows]
    results = {}
    logits = {}
    for arm in (ARM_A, ARM_B):
        model, _ = load_model_for_sft(
            source, convert_to_iha=arm == ARM_B, iha_options={"num_pseudo_heads": config.num_pseudo_heads}
        )
        model.to(settings["device"]).eval()
        from ..sft import prepare_tokenizer

        marked = prepare_tokenizer(tokenizer, assistant_only_loss=True)
        input_ids, attention_mask, _ = loss_token_batch(marked, load_sft_dataset(rows)["messages"])
        output = model(input_ids=input_ids.to(settings["device"]), attention_mask=attention_mask.to(settings["device"]))
        logits[arm] = output.logits.float().cpu()[attention_mask.bool()]
        results[arm] = validation_losses(model, tokenizer, rows, config.validation_batch_size, settings)["loss"]
        del model
        release_memory()
    return {
        "num_rows": len(rows),
        "max_abs_logit_diff": (logits[ARM_A] - logits[ARM_B]).abs().max().item(),
        "validation_loss": results,
    }
