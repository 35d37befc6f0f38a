"""The report of `benchmarks/layout_study.py`: every figure computed from the study's result files, nothing else.

`summarize(load_results(folder))` gives the figures (`report.json`), `render_markdown` the page (`report.md`);
`write_report(folder)` writes both. The docs' decision table quotes `report.json`'s figures, and
`tests/benchmarks/test_layout_study.py` recomputes them from the committed result files.
"""

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from iha.utils.atomic_files import write_json_atomic, write_text_atomic  # noqa: E402
from research.statistics import (  # noqa: E402
    describe_paired,
    discordant_counts,
    mcnemar_exact,
    mean_bootstrap,
    paired_over_seeds,
    seed_spread,
    token_loss_bootstrap,
)


BEFORE_MODELS = ("base", "identity", "hybrid", "global_local")
ARMS = ("hybrid", "global_local", "base")  # trained by the same healing SFT; base is the control
CONTROL_ARM = "base"
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
LABELS = {
    "base": "base (every layer global)",
    "identity": "IHA every layer, P = 2, identity",
    "hybrid": "IHA hybrid (paper's layout)",
    "global_local": "Global+Local",
}
NUM_BOOTSTRAP = 10_000


def paper_window(settings: dict) -> int:
    """W in tokens: the paper's window for the study's training length, training_length / (2 P^2) (the converter's
    `--layers hybrid --training_length`), so that a sliding IHA layer costs what a global one does at that length."""
    return settings["training_length"] // (2 * settings["num_pseudo_heads"] ** 2)


def healed_name(arm: str, seed: int) -> str:
    return f"{arm}-healed-seed{seed}"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def load_results(results_dir: Path) -> dict:
    """Every result file of a study folder: settings, models, ruler[model][task], gsm8k[model], sft[name]."""
    results_dir = Path(results_dir)
    results = {"settings": None, "models": None, "ruler": {}, "gsm8k": {}, "sft": {}}
    if (results_dir / "settings.json").is_file():
        results["settings"] = _read(results_dir / "settings.json")
    if (results_dir / "models.json").is_file():
        results["models"] = _read(results_dir / "models.json")
    for path in sorted((results_dir / "ruler").glob("*/*.json")):
        results["ruler"].setdefault(path.parent.name, {})[path.stem] = _read(path)
    for path in sorted((results_dir / "gsm8k").glob("*.json")):
        results["gsm8k"][path.stem] = _read(path)
    for path in sorted((results_dir / "sft").glob("*.json")):
        results["sft"][path.stem] = _read(path)
    return results


# --------------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------------


def ruler_scores(results: dict, model: str) -> list[float] | None:
    """The model's per-sample scores over the three tasks in order (task by task, sample by sample), or None while
    a task is missing."""
    tasks = results["ruler"].get(model, {})
    if any(task not in tasks or not ruler_unit_complete(results, tasks[task]) for task in RULER_TASKS):
        return None
    return [sample["score"] for task in RULER_TASKS for sample in tasks[task]["samples"]]


def ruler_unit_complete(results: dict, record: dict) -> bool:
    """Whether a RULER unit holds the study's samples (not a unit cut short by `--ruler-sample-cap`)."""
    return len(record["samples"]) >= (results["settings"] or {}).get("ruler_samples", 0)


def ruler_task_scores(results: dict, model: str) -> dict:
    return {
        task: sum(sample["score"] for sample in record["samples"]) / len(record["samples"])
        for task, record in results["ruler"].get(model, {}).items()
    }


def wilson_interval(successes: float, trials: int, z: float = 1.959963984540054) -> list[float]:
    """The 95% Wilson score interval of a binomial proportion: unlike the normal one it stays inside [0, 1] and does
    not shrink to a point at 0 or `trials` successes, which ten samples often give."""
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * (share * (1 - share) / trials + z * z / (4 * trials * trials)) ** 0.5
    return [max(0.0, centre - half), min(1.0, centre + half)]


def ruler_task_details(results: dict, model: str) -> dict:
    """Per task measured: the samples, the sum of their scores (the samples answered right where every score is 0 or
    1, as in the single-needle tasks here) and its 95% Wilson interval."""
    details = {}
    for task, record in results["ruler"].get(model, {}).items():
        scores = [sample["score"] for sample in record["samples"]]
        details[task] = {
            "samples": len(scores),
            "samples_planned": (results["settings"] or {}).get("ruler_samples"),
            "score_sum": sum(scores),
            "binary": all(score in (0, 1) for score in scores),
            "wilson95": wilson_interval(sum(scores), len(scores)),
        }
    return details


def ruler_task_versus_base(results: dict, model: str) -> dict:
    """Per task measured for both: the samples only the base or only the model answered right (scores of 0 or 1),
    with the exact McNemar p."""
    base, mine = results["ruler"].get("base", {}), results["ruler"].get(model, {})
    versus = {}
    for task in RULER_TASKS:
        if task not in base or task not in mine:
            continue
        pairs = list(zip(base[task]["samples"], mine[task]["samples"]))
        if any(a["doc_hash"] != b["doc_hash"] for a, b in pairs):
            raise ValueError(f"{task}: {model} was not asked the base's samples")
        if not all(a["score"] in (0, 1) and b["score"] in (0, 1) for a, b in pairs):
            continue
        b, c = discordant_counts([a["score"] == 1 for a, _ in pairs], [b["score"] == 1 for _, b in pairs])
        versus[task] = {"samples": len(pairs), "only_base": b, "only_model": c, "mcnemar_p": mcnemar_exact(b, c)}
    return versus


def same_samples(results: dict) -> bool | None:
    """Whether every model was asked the very same RULER samples (lm-eval's hash of each document; a unit with
    fewer samples than the others must hold the first of theirs)."""
    hashes = {}
    for tasks in results["ruler"].values():
        for task, record in tasks.items():
            hashes.setdefault(task, []).append(tuple(sample["doc_hash"] for sample in record["samples"]))
    if not hashes:
        return None
    for runs in hashes.values():
        longest = max(runs, key=len)
        if any(run != longest[: len(run)] for run in runs):
            return False
    return True


def identity_check(results: dict) -> dict | None:
    """The identity arm against the base, sample by sample: equal answers and equal scores."""
    base, identity = results["ruler"].get("base", {}), results["ruler"].get("identity", {})
    tasks = [task for task in RULER_TASKS if task in base and task in identity]
    if not tasks:
        return None
    pairs = [(a, b) for task in tasks for a, b in zip(base[task]["samples"], identity[task]["samples"])]
    return {
        "tasks": tasks,
        "samples": len(pairs),
        "equal_answers": sum(a["response"] == b["response"] for a, b in pairs),
        "equal_scores": sum(a["score"] == b["score"] for a, b in pairs),
        "base_score": sum(a["score"] for a, _ in pairs) / len(pairs),
        "identity_score": sum(b["score"] for _, b in pairs) / len(pairs),
    }


def reference_loss(results: dict, model: str) -> float | None:
    record = results["gsm8k"].get(model)
    if record is None:
        return None
    return sum(record["reference"]["nll"]) / sum(record["reference"]["tokens"])


def pass_at_1(results: dict, model: str) -> float | None:
    record = results["gsm8k"].get(model)
    if record is None:
        return None
    problems = record["pass"]["problems"]
    return sum(problem["correct"] for problem in problems) / len(problems)


def ruler_task_metric(task: str):
    """The model's score on one RULER task (the mean over its samples), or None while the unit is missing or cut
    short: a metric of its own, so that a task measured for every model compares before the other tasks are."""

    def score(results: dict, model: str) -> float | None:
        record = results["ruler"].get(model, {}).get(task)
        if record is None or not ruler_unit_complete(results, record):
            return None
        return sum(sample["score"] for sample in record["samples"]) / len(record["samples"])

    score.__name__ = f"ruler_{task}"
    return score


TASK_METRICS = {f"ruler_{task}": ruler_task_metric(task) for task in RULER_TASKS}


def before_healing(results: dict) -> dict:
    """Each of the four models against the base: RULER (paired per sample) and GSM8K (paired per problem)."""
    figures = {}
    base_ruler = ruler_scores(results, "base")
    base_gsm8k = results["gsm8k"].get("base")
    for model in BEFORE_MODELS:
        scores = ruler_scores(results, model)
        entry = {
            "ruler_tasks": ruler_task_scores(results, model),
            "ruler_task_details": ruler_task_details(results, model),
            "ruler": sum(scores) / len(scores) if scores else None,
            "reference_loss": reference_loss(results, model),
            "pass_at_1": pass_at_1(results, model),
            **{metric: function(results, model) for metric, function in TASK_METRICS.items()},
        }
        if model != "base":
            entry["ruler_tasks_vs_base"] = ruler_task_versus_base(results, model)
        if scores and base_ruler and model != "base":
            paired = mean_bootstrap(base_ruler, scores, num_resamples=NUM_BOOTSTRAP)
            entry["ruler_vs_base"] = paired["difference"]
            entry["ruler_kept"] = entry["ruler"] / figures["base"]["ruler"] if figures["base"]["ruler"] else None
        gsm8k = results["gsm8k"].get(model)
        if gsm8k and base_gsm8k and model != "base":
            loss = token_loss_bootstrap(
                base_gsm8k["reference"]["nll"],
                gsm8k["reference"]["nll"],
                gsm8k["reference"]["tokens"],
                num_resamples=NUM_BOOTSTRAP,
            )
            entry["reference_loss_vs_base"] = loss["difference"]
            b, c = discordant_counts(
                [p["correct"] for p in base_gsm8k["pass"]["problems"]],
                [p["correct"] for p in gsm8k["pass"]["problems"]],
            )
            entry["pass_vs_base"] = {"only_base": b, "only_model": c, "mcnemar_p": mcnemar_exact(b, c)}
        figures[model] = entry
    return figures


def healed_values(results: dict, arm: str, seeds: list[int], metric) -> dict[int, float]:
    values = {}
    for seed in seeds:
        value = metric(results, healed_name(arm, seed))
        if value is not None:
            values[seed] = value
    return values


def _ruler_mean(results: dict, model: str) -> float | None:
    scores = ruler_scores(results, model)
    return sum(scores) / len(scores) if scores else None


METRICS = {"ruler": _ruler_mean, **TASK_METRICS, "reference_loss": reference_loss, "pass_at_1": pass_at_1}


def after_healing(results: dict, before: dict) -> dict:
    """Per arm and seed after the healing SFT, and the paired comparisons over seeds (the arms of a seed share
    data, order, steps and learning rate)."""
    seeds = (results["settings"] or {}).get("seeds", [])
    figures = {"seeds": seeds, "arms": {}, "paired": {}}
    per_metric = {}
    for metric, function in METRICS.items():
        per_arm = {arm: healed_values(results, arm, seeds, function) for arm in ARMS}
        per_metric[metric] = per_arm
        for arm, values in per_arm.items():
            entry = figures["arms"].setdefault(arm, {})
            entry[metric] = {"per_seed": values, "spread": seed_spread(list(values.values())) if values else None}
            start = before.get(arm, {}).get(metric)
            if values and start is not None:
                entry[metric]["healing"] = paired_over_seeds([start] * len(values), list(values.values()), list(values))
                base_before = before["base"][metric]
                entry[metric]["kept_vs_base"] = entry[metric]["spread"]["mean"] / base_before if base_before else None
        comparisons = {
            "hybrid - global_local": ("global_local", "hybrid"),
            "hybrid - base": ("base", "hybrid"),
            "global_local - base": ("base", "global_local"),
        }
        for label, (arm_a, arm_b) in comparisons.items():
            common = [seed for seed in seeds if seed in per_arm[arm_a] and seed in per_arm[arm_b]]
            if common:
                figures["paired"].setdefault(label, {})[metric] = paired_over_seeds(
                    [per_arm[arm_a][seed] for seed in common], [per_arm[arm_b][seed] for seed in common], common
                )
    return figures


def sft_summary(results: dict) -> dict:
    """Per run: steps, tokens, first and last loss, seconds; per seed: whether the arms trained on the same tokens."""
    runs = {}
    for name, record in results["sft"].items():
        runs[name] = {
            "steps": record["steps"],
            "trained_tokens": record["trained_tokens"],
            "loss_tokens": record["loss_tokens"],
            "first_loss": record["losses"][0] if record["losses"] else None,
            "last_loss": record["losses"][-1] if record["losses"] else None,
            "seconds": record["seconds"],
            "load_average": [record["load_average_start"][0], record["load_average_end"][0]],
        }
    same_data = {}
    for seed in (results["settings"] or {}).get("seeds", []):
        traces = [
            [step["digest"] for step in results["sft"][healed_name(arm, seed)]["step_trace"]]
            for arm in ARMS
            if healed_name(arm, seed) in results["sft"]
        ]
        if len(traces) > 1:
            same_data[seed] = all(trace == traces[0] for trace in traces)
    return {"runs": runs, "same_data": same_data}


def expected_units(settings: dict) -> list[str]:
    names = ["models"]
    models = list(BEFORE_MODELS) + [healed_name(arm, seed) for seed in settings["seeds"] for arm in ARMS]
    for model in models:
        names += [f"ruler/{model}/{task}" for task in RULER_TASKS] + [f"gsm8k/{model}"]
    names += [f"sft/{healed_name(arm, seed)}" for seed in settings["seeds"] for arm in ARMS]
    return names


def done_units(results: dict) -> set[str]:
    done = {"models"} if results["models"] else set()
    done |= {
        f"ruler/{model}/{task}"
        for model, tasks in results["ruler"].items()
        for task, record in tasks.items()
        if ruler_unit_complete(results, record)
    }
    done |= {f"gsm8k/{model}" for model in results["gsm8k"]}
    done |= {f"sft/{name}" for name in results["sft"]}
    return done


def regime(results: dict) -> dict:
    """Load averages and CPU seconds of every unit that ran, by kind, and the versions."""
    records = [("ruler", record) for tasks in results["ruler"].values() for record in tasks.values()]
    records += [("gsm8k", record) for record in results["gsm8k"].values()]
    records += [("sft", record) for record in results["sft"].values()]
    by_kind = {}
    loads = []
    for kind, record in records:
        entry = by_kind.setdefault(kind, {"units": 0, "cpu_seconds": 0.0, "wall_seconds": 0.0})
        entry["units"] += 1
        entry["cpu_seconds"] += record["seconds"]["cpu"]
        entry["wall_seconds"] += record["seconds"]["wall"]
        loads += [record["load_average_start"][0], record["load_average_end"][0]]
    machine = next((record.get("machine") for _, record in records if record.get("machine")), None)
    lm_eval = next((record["lm_eval"]["version"] for kind, record in records if kind == "ruler"), None)
    return {
        "by_kind": by_kind,
        "load_average": [min(loads), max(loads)] if loads else None,
        "machine": machine,
        "lm_eval": lm_eval,
        "finished": sorted(record["finished"] for _, record in records if "finished" in record),
    }


def summarize(results: dict) -> dict:
    settings = results["settings"]
    if settings is None:
        return {"settings": None}
    expected = expected_units(settings)
    done = done_units(results)
    before = before_healing(results)
    return {
        "settings": settings,
        "complete": all(name in done for name in expected),
        "units_done": sum(name in done for name in expected),
        "units_expected": len(expected),
        "missing": [name for name in expected if name not in done],
        "models": results["models"],
        "same_samples": same_samples(results),
        "identity_check": identity_check(results),
        "before": before,
        "after": after_healing(results, before),
        "sft": sft_summary(results),
        "regime": regime(results),
    }


# --------------------------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------------------------


def percent(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def signed_interval(difference: dict, scale: float = 100.0, digits: int = 1) -> str:
    low, high = difference["ci"]
    return f"{scale * difference['estimate']:+.{digits}f} [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"


def number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _seed_cell(metric_entry: dict | None, scale: float, digits: int) -> str:
    if not metric_entry or not metric_entry["spread"]:
        return "-"
    spread = metric_entry["spread"]
    values = " / ".join(f"{scale * value:.{digits}f}" for value in spread["values"])
    if len(spread["values"]) == 1:
        return f"{values} (1 seed)"
    return f"{scale * spread['mean']:.{digits}f} ± {scale * spread['std']:.{digits}f} ({values})"


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    if settings is None:
        return "# The paper's layout on SmolLM2-135M-Instruct\n\nNo results yet.\n"
    window, p = paper_window(settings), settings["num_pseudo_heads"]
    gl_window = settings["global_local_window"] or p * p * window
    status = (
        "**Complete.**"
        if report["complete"]
        else f"**PARTIAL: {report['units_done']} of {report['units_expected']} units done** (the study is still "
        f"running or was stopped; missing: {', '.join(report['missing'][:12])}"
        f"{', ...' if len(report['missing']) > 12 else ''}). Every figure below is from the units done."
    )
    lines = [
        "# What the paper's layout costs and what healing gives back: SmolLM2-135M-Instruct",
        "",
        status,
        "",
        "Command: `python benchmarks/layout_study.py` (resumable; `--report` re-renders this page from the result "
        "files in this folder). Models, all from the same weights (the built-in SmolLM2-135M-Instruct, 30 layers, "
        "9 heads, 3 KV heads, context 8,192):",
        "",
        f"- **base**: every layer global; **identity**: IHA in every layer, P = {p}, identity mixing (the same "
        "function: the harness's sanity arm);",
        f"- **hybrid**: the paper's layout for a training length of {settings['training_length']:,}: 4 sliding IHA "
        f"layers with the flat window of W * P = {window * p} virtual tokens (W = {window}), then 1 standard global "
        "layer (layers 4, 9, ..., 29 global);",
        f"- **global_local**: the same pattern with standard sliding layers and the FLOP-matched window P^2 * W = "
        f"{gl_window} tokens.",
        "",
        f"RULER: lm-eval {report['regime']['lm_eval'] or '0.4.13'}'s niah_single_1, niah_multikey_2, "
        f"niah_multikey_3 at {settings['ruler_length']:,} tokens, the first {settings['ruler_samples']} samples of "
        "each (the same samples for every model: "
        f"{'checked, equal document hashes' if report['same_samples'] else 'NOT the same' if report['same_samples'] is False else 'not yet checked'}"
        "), `--model hf`, float32, greedy, the tasks' 128 new tokens, no chat template; score = lm-eval's (the share "
        "of the expected values in the answer). GSM8K: the reference solutions of the first "
        f"{settings['reference_problems']} test problems teacher-forced (loss per solution token, in the training "
        f"rows' chat format), and greedy pass@1 on the first {settings['pass_problems']} (up to "
        f"{settings['max_new_tokens']} new tokens).",
        "",
        f"Healing: the same `iha sft` run for hybrid, global_local and base (the control) per seed "
        f"({', '.join(map(str, settings['seeds']))}): {settings['sft_steps']} steps of one row of "
        f"{settings['training_length']:,} tokens (the first {settings['train_rows']} GSM8K train rows in the "
        "OpenThoughts format without its system prompt, packed across row boundaries: `--packing_strategy "
        f"wrapped`), learning rate {settings['learning_rate']:g} for every weight (the mixing's too), cosine, 10% "
        "warm-up, assistant-only loss, float32.",
        "",
    ]
    lines += render_models(report)
    lines += render_before(report)
    lines += render_after(report)
    lines += render_sft(report)
    lines += render_regime(report)
    return "\n".join(lines) + "\n"


def render_models(report: dict) -> list[str]:
    models = report["models"]
    if not models:
        return []
    lines = ["## The models against the base before any training", ""]
    lines += [
        "One GSM8K test text, float32, max |logit difference| and top-1 agreement with the base per span of positions:",
        "",
        "| model | "
        + " | ".join(f"tokens {span}" for span in next(iter(models["models"].values()))["against_base"])
        + " |",
        "|---|" + "---|" * len(next(iter(models["models"].values()))["against_base"]),
    ]
    for name, entry in models["models"].items():
        cells = [
            f"{span['max_abs_logit_diff']:.2g}, {100 * span['top1_agreement']:.1f}%"
            for span in entry["against_base"].values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Commands: " + "; ".join(f"{name}: `{entry['command']}`" for name, entry in models["models"].items()),
        "",
    ]
    return lines


def render_before(report: dict) -> list[str]:
    before = report["before"]
    lines = ["## Before healing", ""]
    check = report["identity_check"]
    if check:
        verdict = "equal" if check["equal_answers"] == check["samples"] else "NOT equal"
        lines += [
            f"**Sanity check** (identity against base): {check['equal_answers']} of {check['samples']} RULER answers "
            f"identical, {check['equal_scores']} of {check['samples']} scores equal ({', '.join(check['tasks'])}): "
            f"{verdict}.",
            "",
        ]
    lines += [
        "| model | " + " | ".join(RULER_TASKS) + " | RULER mean | vs base, points [95% bootstrap] | kept | GSM8K "
        "loss | vs base [95%] | pass@1 | only base / only model right (McNemar p) |",
        "|---|" + "---|" * (len(RULER_TASKS) + 7),
    ]
    for model in BEFORE_MODELS:
        entry = before[model]
        tasks = " | ".join(percent(entry["ruler_tasks"].get(task)) for task in RULER_TASKS)
        versus = signed_interval(entry["ruler_vs_base"]) if "ruler_vs_base" in entry else "-"
        kept = percent(entry.get("ruler_kept"), 0) + "%" if entry.get("ruler_kept") is not None else "-"
        loss_versus = (
            signed_interval(entry["reference_loss_vs_base"], 1.0, 4) if "reference_loss_vs_base" in entry else "-"
        )
        discord = entry.get("pass_vs_base")
        discord_text = (
            f"{discord['only_base']} / {discord['only_model']} ({discord['mcnemar_p']:.2g})" if discord else "-"
        )
        lines.append(
            f"| {LABELS[model]} | {tasks} | {percent(entry['ruler'])} | {versus} | {kept} | "
            f"{number(entry['reference_loss'])} | {loss_versus} | {percent(entry['pass_at_1'])} | {discord_text} |"
        )
    lines += [
        "",
        "RULER and pass@1 in percent; GSM8K loss in nats per reference-solution token; intervals are paired "
        "bootstrap intervals over the samples (RULER, all three tasks pooled) or problems (GSM8K). A RULER mean "
        "needs all three tasks: '-' while one is missing.",
        "",
    ]
    lines += render_ruler_tasks(report)
    return lines


def render_ruler_tasks(report: dict) -> list[str]:
    """Each RULER task measured, per model: the score with its 95% Wilson interval over the samples, and the samples
    only the base or only the model answered right."""
    rows = []
    for task in RULER_TASKS:
        for model in BEFORE_MODELS:
            entry = report["before"][model]
            detail = entry.get("ruler_task_details", {}).get(task)
            if detail is None:
                continue
            low, high = detail["wilson95"]
            share = detail["score_sum"] / detail["samples"]
            interval = f" [{100 * low:.0f}, {100 * high:.0f}]" if detail["binary"] else ""
            versus = entry.get("ruler_tasks_vs_base", {}).get(task)
            versus_text = (
                f"{versus['only_base']} / {versus['only_model']} ({versus['mcnemar_p']:.2g})" if versus else "-"
            )
            samples = f"{detail['samples']}" + (
                f" of {detail['samples_planned']} (partial)" if detail["samples"] < detail["samples_planned"] else ""
            )
            rows.append(f"| {task} | {LABELS[model]} | {samples} | {100 * share:.0f}{interval} | {versus_text} |")
    if not rows:
        return []
    return [
        "Per RULER task measured: the score in percent, with its 95% Wilson interval over the samples where every "
        "sample scores 0 or 1; the samples only the base or only the model answered right, with the exact McNemar p:",
        "",
        "| task | model | samples | score [95% Wilson] | only base / only model right (McNemar p) |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def same_in_every_seed(paired: dict) -> bool:
    """Two seeds or more whose differences are all equal: no spread, so a t interval would be a point and its p-value
    no evidence (the sign-flip test's smallest p is what the seeds can show)."""
    differences = paired["differences"]
    # Equal scores reach here through sums of floats: a difference of 1e-17 between seeds is no spread.
    return paired["n"] > 1 and max(differences) - min(differences) <= 1e-12


def describe_over_seeds(paired: dict, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """`describe_paired`, except where every seed gives the same difference: then that difference, said so."""
    if not same_in_every_seed(paired):
        return describe_paired(paired, scale, digits, unit)
    floor = ", the smallest possible" if paired["mean"] != 0 else ""
    return (
        f"{scale * paired['mean']:+.{digits}f}{unit} in each of the {paired['n']} seeds (no spread over seeds: no t "
        f"interval; sign-flip permutation p = {paired['permutation_p_value']:.3g}{floor})"
    )


def _healing_cell(metric_entry: dict | None, scale: float, digits: int) -> str:
    value = (metric_entry or {}).get("healing")
    if not value:
        return "-"
    if same_in_every_seed(value):
        return f"{scale * value['mean']:+.{digits}f} in every seed"
    if value["ci"]:
        return describe_paired(value, scale, digits).split(" (")[0]
    return f"{scale * value['mean']:+.{digits}f}"


def render_after(report: dict) -> list[str]:
    after = report["after"]
    lines = ["## After the same healing SFT", ""]
    if not any(metric["spread"] for arm in after["arms"].values() for metric in arm.values()):
        return lines + ["No healed model measured yet.", ""]
    lines += [
        "Per arm: mean ± standard deviation over seeds (the seeds' values); healing = after - before, seed by seed "
        "(t interval over seeds). RULER per task first (a task compares as soon as it is measured for a model), then "
        "the mean over the three tasks and GSM8K:",
        "",
        "| arm | RULER task | before | after | healing, points |",
        "|---|---|---|---|---|",
    ]
    for arm in ARMS:
        entry = after["arms"][arm]
        for task in RULER_TASKS:
            metric = f"ruler_{task}"
            lines.append(
                f"| {LABELS[arm]} | {task} | {percent(report['before'][arm].get(metric))} | "
                f"{_seed_cell(entry[metric], 100, 1)} | {_healing_cell(entry[metric], 100, 1)} |"
            )
    lines += [
        "",
        "| arm | RULER mean | healing, points | GSM8K loss | healing | pass@1 | healing, points |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        entry = after["arms"][arm]
        lines.append(
            f"| {LABELS[arm]} | {_seed_cell(entry['ruler'], 100, 1)} | {_healing_cell(entry['ruler'], 100, 1)} | "
            f"{_seed_cell(entry['reference_loss'], 1, 4)} | {_healing_cell(entry['reference_loss'], 1, 4)} | "
            f"{_seed_cell(entry['pass_at_1'], 100, 1)} | {_healing_cell(entry['pass_at_1'], 100, 1)} |"
        )
    lines += ["", "Paired over seeds (B - A; the arms of a seed trained on the same tokens in the same order):", ""]
    for label, metrics in after["paired"].items():
        for metric, paired in metrics.items():
            scale, digits, unit = (1, 4, " nats/token") if metric == "reference_loss" else (100, 1, " points")
            name = {"ruler": "RULER mean"}.get(metric) or (
                metric.replace("ruler_", "RULER ", 1) if metric.startswith("ruler_") else metric.replace("_", " ")
            )
            lines.append(f"- {label}, {name}: {describe_over_seeds(paired, scale, digits, unit)}")
    lines.append("")
    return lines


def render_sft(report: dict) -> list[str]:
    sft = report["sft"]
    if not sft["runs"]:
        return []
    lines = [
        "## The healing runs",
        "",
        "| run | steps | tokens | loss tokens | first / last loss | CPU s | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in sft["runs"].items():
        lines.append(
            f"| {name} | {run['steps']} | {run['trained_tokens']:,} | {run['loss_tokens']:,} | "
            f"{number(run['first_loss'], 3)} / {number(run['last_loss'], 3)} | {run['seconds']['cpu']:.0f} | "
            f"{run['load_average'][0]:.1f}-{run['load_average'][1]:.1f} |"
        )
    same = ", ".join(f"seed {seed}: {'yes' if value else 'NO'}" for seed, value in sft["same_data"].items())
    lines += [
        "",
        f"Same tokens in the same order for every arm of a seed (digests of every step's input ids): "
        f"{same or 'not yet two arms of a seed'}.",
        "",
    ]
    return lines


def render_regime(report: dict) -> list[str]:
    regime_ = report["regime"]
    lines = ["## Regime", ""]
    if regime_["machine"]:
        machine = regime_["machine"]
        lines.append(
            f"Machine: {machine['machine']}, torch {machine['torch']} ({machine['torch_threads']} thread), "
            f"transformers {machine['transformers']}; shared with other engineers' work."
        )
    if regime_["load_average"]:
        lines.append(
            f"Load average (1 min) at the units' starts and ends: {regime_['load_average'][0]:.1f} to "
            f"{regime_['load_average'][1]:.1f} on the 2 cores."
        )
    for kind, entry in regime_["by_kind"].items():
        lines.append(
            f"- {kind}: {entry['units']} units, {entry['cpu_seconds']:,.0f} CPU s, {entry['wall_seconds']:,.0f} s wall"
        )
    if regime_["finished"]:
        lines.append(f"\nUnits finished from {regime_['finished'][0]} to {regime_['finished'][-1]} (UTC).")
    return lines + [""]


def write_report(results_dir: Path) -> dict:
    report = summarize(load_results(results_dir))
    write_json_atomic(report, Path(results_dir) / "report.json")
    write_text_atomic(render_markdown(report), Path(results_dir) / "report.md")
    return report


__all__ = [
    "ARMS",
    "BEFORE_MODELS",
    "CONTROL_ARM",
    "RULER_TASKS",
    "healed_name",
    "load_results",
    "render_markdown",
    "summarize",
    "write_report",
]
