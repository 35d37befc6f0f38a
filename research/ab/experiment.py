"""The whole A/B comparison, in order:

1. the data: training rows and a fixed validation split (OUTPUT_DIR/data), the test problems;
2. arm B's model before training against arm A's (the conversion is exact: same logits);
3. arm B with the first seed once per candidate mixing learning rate; the lowest validation loss wins, and that run
   is arm B's first seed (the test problems play no part in the choice);
4. arm A with every seed, arm B with the other seeds and the chosen mixing learning rate;
5. every final run scores the test problems' reference solutions teacher-forced (the headline: per-token loss,
   paired per problem, on a split the choice of step 3 never saw);
6. every final run answers the test problems (greedy; sampled too when `num_samples` > 1);
7. the report: report.json, report.md, curves.png, drift.png.

Each step reuses what an earlier call of the same command wrote (see `research.ab.runs`).
"""

import json
import time
from pathlib import Path

from iha.utils.atomic_files import write_json_atomic, write_text_atomic

from . import report as reporting
from .config import ARM_A, ARM_B, ABConfig
from .data import load_test_problems, prepare_data, prepare_reference_rows
from .measures import check_conversion, machine_settings
from .runs import (
    check_source_is_not_iha,
    discard_unstarted_run,
    evaluate_run,
    log,
    prepare_output_dir,
    run_name,
    score_reference,
    source_model,
    train_run,
)
from .summary import summarize


def choose_mixing_learning_rate(candidates: list[dict]) -> float:
    """The candidate with the lowest validation loss (ties: the first listed)."""
    return min(candidates, key=lambda run: run["validation"]["loss"])["mixing_learning_rate"]


def describe_source(config: ABConfig, source: str) -> str:
    if config.model is None:
        return "SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct, the package's built-in offline copy)"
    return f"`{config.model}`"


def run_ab(
    config: ABConfig, output_dir: str | Path, fresh: bool = False, command: str = "python -m research.ab"
) -> dict:
    """Run (or finish) the A/B comparison in `output_dir`; returns the report (also in report.json)."""
    output_dir = Path(output_dir)
    started = time.perf_counter()
    folder_existed = output_dir.is_dir()
    new_run = prepare_output_dir(output_dir, config, fresh)
    try:  # until the first training starts, a failure (offline data, a wrong --model) leaves nothing behind
        settings = machine_settings()
        source = source_model(config)
        check_source_is_not_iha(source)
        train_rows, validation_rows = prepare_data(config, output_dir)
        benchmarks = {"gsm8k": load_test_problems(config.test_data, "gsm8k", config.num_test_problems)}
        reference_rows = prepare_reference_rows(config)
        if config.math500_data is not None:
            benchmarks["math500"] = load_test_problems(config.math500_data, "math500", config.num_test_problems)
    except BaseException:
        if new_run:
            discard_unstarted_run(output_dir, keep_folder=folder_existed)
        raise
    first_seed, other_seeds = config.seeds[0], config.seeds[1:]
    num_trainings = len(config.mixing_learning_rates) + len(config.seeds) + len(other_seeds)
    log(
        f"{len(train_rows)} training rows, {len(validation_rows)} validation rows, "
        + ", ".join(f"{len(problems)} {name} test problems" for name, problems in benchmarks.items())
        + f", {len(reference_rows)} reference solutions; {num_trainings} trainings ({len(config.mixing_learning_rates)} mixing-lr candidates), "
        f"{2 * len(config.seeds)} evaluations on {settings['device']}"
    )

    conversion_path = output_dir / "conversion.json"
    if not conversion_path.is_file():
        log("checking that arm B's model before training computes arm A's logits")
        write_json_atomic(check_conversion(source, validation_rows, config, settings), conversion_path)
    conversion = json.loads(conversion_path.read_text(encoding="utf-8"))

    done = 0

    def train(arm: str, seed: int, mixing_learning_rate: float | None = None) -> dict:
        nonlocal done
        done += 1
        name = run_name(arm, seed, mixing_learning_rate)
        finished_earlier = (output_dir / name / "train.json").is_file()
        log(f"training {done}/{num_trainings}: {name}{' (finished earlier: reused)' if finished_earlier else ''}")
        result = train_run(
            output_dir / name, arm, seed, mixing_learning_rate, source, train_rows, validation_rows, config, settings
        )
        log(f"{name}: {result['steps']} steps, validation loss {result['validation']['loss']:.4f}")
        return result

    candidates = [train(ARM_B, first_seed, lr) for lr in config.mixing_learning_rates]
    chosen = choose_mixing_learning_rate(candidates)
    write_json_atomic(
        {
            "seed": first_seed,
            "candidates": {str(run["mixing_learning_rate"]): run["validation"]["loss"] for run in candidates},
            "chosen": chosen,
        },
        output_dir / "selection.json",
    )
    log(f"arm B's mixing learning rate: {chosen:g} (lowest validation loss of {len(candidates)} candidates)")
    runs_a = [train(ARM_A, seed) for seed in config.seeds]
    runs_b = [next(run for run in candidates if run["mixing_learning_rate"] == chosen)]
    runs_b += [train(ARM_B, seed, chosen) for seed in other_seeds]

    references = []
    for runs in (runs_a, runs_b):
        scored = []
        for run in runs:
            log(f"scoring {run['run']} on {len(reference_rows)} reference solutions (teacher-forced)")
            result = score_reference(output_dir / run["run"], reference_rows, config, settings)
            log(f"{run['run']}: reference loss {result['loss']:.4f} nats/token")
            scored.append(result)
        references.append(scored)

    evaluations, eval_seconds = {}, {}
    modes = [False, True] if config.sampling.num_samples > 1 else [False]
    for name, problems in benchmarks.items():
        for sampled in modes:
            key = f"{name}-sampled" if sampled else name
            per_arm = []
            for runs in (runs_a, runs_b):
                evals = []
                for run in runs:
                    log(f"evaluating {run['run']} on {len(problems)} {key} problems")
                    result = evaluate_run(output_dir / run["run"], problems, name, config, settings, sampled)
                    log(
                        f"{run['run']} {key}: pass@1 {100 * result['metrics']['pass@1']:.1f}%, finished "
                        f"{100 * result['metrics']['finish_rate']:.0f}% within {config.sampling.max_new_tokens} tokens"
                    )
                    eval_seconds[f"{run['run']} {key}"] = result["seconds"]
                    evals.append(result)
                per_arm.append(evals)
            evaluations[key] = tuple(per_arm)

    extra = {
        "command": command,
        "source_model": describe_source(config, source),
        "machine": settings,
        "conversion": conversion,
        "data": {"num_train_rows": len(train_rows), "num_validation_rows": len(validation_rows)},
        "eval_seconds": eval_seconds,
    }
    report = summarize(config, runs_a, runs_b, candidates, evaluations, extra, references=tuple(references))
    report["seconds_this_call"] = time.perf_counter() - started
    reporting.plot_curves(report, output_dir / "curves.png")
    reporting.plot_drift(report, runs_b, output_dir / "drift.png")
    write_json_atomic(report, output_dir / "report.json")
    write_text_atomic(reporting.render_markdown(report), output_dir / "report.md")
    log(f"report: {output_dir / 'report.md'}")
    return report


__all__ = ["choose_mixing_learning_rate", "run_ab"]
