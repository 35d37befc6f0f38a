"""The runs of `python -m research.ab`: SFT of a Llama-style model as it is (arm A, "base") or of its IHA conversion (arm B, "iha")
with one seed under one `ABConfig` (`train_run`), then its answers to the test problems (`evaluate_run`) and its
loss on their reference solutions (`score_reference`); what they measure is `research.ab.measures`', the rows they read
`research.ab.data`'s.

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
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoConfig
from transformers.trainer_utils import get_last_checkpoint

from iha import IHA_MODEL_TYPES
from iha.conversion.builtin import smollm2_dir
from iha.conversion.verify import release_memory
from iha.data.messages import BOXED_INSTRUCTION, OPENTHOUGHTS_SYSTEM_PROMPT
from iha.evaluation.math_eval import (
    build_prompt,
    generate_completions,
    load_model_and_tokenizer,
    score_completions,
)
from iha.training.config import IHAModelConfig, IHAScriptArguments, IHASFTConfig
from iha.training.train import train_sft
from iha.utils.atomic_files import write_json_atomic

from .config import ARM_A, ARM_B, ABConfig
from .measures import StepTrace, completion_finished, find_step_trace, mixing_drift, validation_losses


CONFIG_NAME = "ab_config.json"


class ABConfigMismatch(ValueError):
    """OUTPUT_DIR holds the runs of an A/B comparison made with other settings."""


def log(message: str) -> None:
    print(f"[research.ab] {message}", flush=True)


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
    return str(smollm2_dir())


def check_source_is_not_iha(source: str) -> None:
    if AutoConfig.from_pretrained(source).model_type in IHA_MODEL_TYPES:
        raise ValueError(
            f"{source} is already an IHA model: the A/B compares a Llama-style model with its IHA conversion. "
            "Pass the model it was converted from as --model"
        )


# ---------------------------------------------------------------------------------------------------------------------
# One run: training, then evaluation
# ---------------------------------------------------------------------------------------------------------------------


def sft_config(config: ABConfig, output_dir: Path, seed: int, mixing_learning_rate: float | None, settings: dict):
    """The one training configuration both arms use; only the mixing learning rate is arm B's own."""
    return IHASFTConfig(
        output_dir=str(output_dir),
        seed=seed,
        mixing_learning_rate=mixing_learning_rate,
        **dataclasses.asdict(config.training),
        packing=True,
        assistant_only_loss=True,
        bf16=settings["bf16"],
        use_cpu=settings["device"] == "cpu",
        logging_steps=1,
        save_strategy="steps",
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
    result_path = run_dir / "train.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    training_dir = run_dir / "training"
    checkpoint = get_last_checkpoint(str(training_dir)) if training_dir.is_dir() else None
    if checkpoint is not None:
        log(f"{run_dir.name}: resuming from {Path(checkpoint).name}")
    args = sft_config(config, training_dir, seed, mixing_learning_rate, settings)
    args.resume_from_checkpoint = checkpoint
    model_args = IHAModelConfig(
        model_name_or_path=source,
        convert_to_iha=arm == ARM_B,
        iha_options={"num_pseudo_heads": config.num_pseudo_heads} if arm == ARM_B else None,
    )
    started = time.perf_counter()
    # The rows are the harness's own split (data/train.jsonl), given as they are.
    trainer = train_sft(IHAScriptArguments(), args, model_args, train_dataset=train_rows, callbacks=[StepTrace()])
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


def evaluate_run(
    run_dir: Path, problems, benchmark: str, config: ABConfig, settings: dict, sampled: bool = False
) -> dict:
    """Answer the test problems with a run's trained model (greedy, or sampled with `config.sampling`), score
    them per problem and write `eval-<benchmark>[-sampled].json`. An existing file is returned as is."""
    result_path = run_dir / f"eval-{benchmark}{'-sampled' if sampled else ''}.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    # Every run is answered greedily; the sampled pass draws `config.sampling`.
    sampling = config.sampling if sampled else replace(config.sampling, temperature=0.0, top_p=1.0, num_samples=1)
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
    """A run's trained model scored teacher-forced on the reference solutions `rows` (`research.ab.data.prepare_reference_rows`):
    per problem the summed negative log-likelihood of the solution's tokens and their number, as the training loss
    counts them, in float32 (bf16 autocast where training used it). Writes `reference-gsm8k.json`; an existing file
    is returned as is."""
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


__all__ = [
    "ABConfigMismatch",
    "check_source_is_not_iha",
    "discard_unstarted_run",
    "evaluate_run",
    "prepare_output_dir",
    "run_name",
    "score_reference",
    "sft_config",
    "source_model",
    "train_run",
]
