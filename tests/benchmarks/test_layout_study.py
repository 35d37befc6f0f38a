"""The converted-layout quality study (benchmarks/layout_study.py): its units and their order, what makes a unit wait,
the locks two workers share, the refusal of a study folder made with other settings, and its report, computed from
result files only (here from small hand-made ones, and the committed report from the committed files)."""

import json
import os
import subprocess
import sys

import pytest
from testing_utils import REPO_ROOT

from research.statistics import mean_bootstrap, paired_over_seeds, token_loss_bootstrap


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import layout_study  # noqa: E402
from layout_study_report import (  # noqa: E402
    ARMS,
    BEFORE_MODELS,
    RULER_TASKS,
    healed_name,
    load_results,
    render_markdown,
    summarize,
)


COMMITTED = REPO_ROOT / "benchmarks" / "results" / "layout_study"


def test_units_give_the_discriminating_scores_first_and_the_multikey_tasks_of_healed_models_last():
    settings = layout_study.StudySettings(seeds=[0, 1])
    names = [unit.name for unit in layout_study.study_units(settings, set())]
    first, others = RULER_TASKS[0], RULER_TASKS[1:]
    assert names[0] == "build"
    # The first task over the four models first (the identity check and the first comparison come with it), then
    # their GSM8K scores.
    assert names[1:9] == [f"ruler:{m}:{first}" for m in BEFORE_MODELS] + [f"gsm8k:{m}" for m in BEFORE_MODELS]

    def healing(arms):
        return [
            name
            for seed in (0, 1)
            for arm in arms
            for name in (
                f"sft:{arm}:{seed}",
                f"ruler:{healed_name(arm, seed)}:{first}",
                f"gsm8k:{healed_name(arm, seed)}",
            )
        ]

    # Per seed, each healed arm's SFT run followed by the same two scores of its healed model; then the four models'
    # multi-key tasks; then the control arm the same way; last the healed models' multi-key tasks.
    arms = healing(["hybrid", "global_local"])
    before_multikey = [f"ruler:{model}:{task}" for model in BEFORE_MODELS for task in others]
    control = healing(["base"])
    start = 9
    for block in (arms, before_multikey, control):
        assert names[start : start + len(block)] == block
        start += len(block)
    assert {name.split(":")[2] for name in names[start:]} == set(others)
    assert len(names[start:]) == 2 * 3 * len(others)
    assert len(names) == len(set(names)) == 1 + 4 * 4 + 2 * 3 * 5


def test_the_filters_keep_the_build_and_the_sft_run_of_a_healed_model():
    settings = layout_study.StudySettings(seeds=[0])
    evaluations = layout_study.study_units(settings, {"eval"})
    assert {unit.kind for unit in evaluations} == {"build", "ruler", "gsm8k"}
    chosen = layout_study.study_units(settings, set(), {healed_name("hybrid", 0)})
    assert [unit.name for unit in chosen] == [
        "build",
        "sft:hybrid:0",
        f"ruler:hybrid-healed-seed0:{RULER_TASKS[0]}",
        "gsm8k:hybrid-healed-seed0",
        *[f"ruler:hybrid-healed-seed0:{task}" for task in RULER_TASKS[1:]],
    ]


def test_a_healed_models_scores_wait_for_its_sft_run(tmp_path):
    unit = layout_study.Unit("ruler", healed_name("global_local", 2), RULER_TASKS[0])
    assert not unit.ready(tmp_path)
    layout_study.Unit("build").result_path(tmp_path).write_text("{}")
    assert not unit.ready(tmp_path)
    assert layout_study.Unit("ruler", "hybrid", RULER_TASKS[0]).ready(tmp_path)
    sft = layout_study.Unit("sft", "global_local", seed=2).result_path(tmp_path)
    sft.parent.mkdir(parents=True)
    sft.write_text("{}")
    assert unit.ready(tmp_path)


def test_a_lock_is_held_by_a_live_process_and_taken_over_from_a_dead_one(tmp_path):
    lock = tmp_path / "locks" / "unit.lock"
    assert layout_study.take_lock(lock)
    assert not layout_study.take_lock(lock)  # this very process holds it
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    lock.write_text(str(finished.pid))  # a process that has ended
    assert layout_study.take_lock(lock)
    assert lock.read_text() == str(os.getpid())


def test_a_study_folder_refuses_other_settings(tmp_path):
    layout_study.check_settings(layout_study.StudySettings(), tmp_path)
    layout_study.check_settings(layout_study.StudySettings(), tmp_path)  # the same: continues
    with pytest.raises(SystemExit, match="ruler_samples"):
        layout_study.check_settings(layout_study.StudySettings(ruler_samples=3), tmp_path)


def test_the_healing_settings_change_only_while_no_sft_run_has_finished(tmp_path):
    layout_study.check_settings(layout_study.StudySettings(), tmp_path)
    # No healing run has read them yet: the scores before healing stand, and the folder takes the new ones.
    layout_study.check_settings(layout_study.StudySettings(sft_steps=3, seeds=[0]), tmp_path)
    assert json.loads((tmp_path / "settings.json").read_text())["sft_steps"] == 3
    write(tmp_path / "sft" / f"{healed_name('hybrid', 0)}.json", {})
    with pytest.raises(SystemExit, match="sft_steps differ and 1 SFT runs finished with them"):
        layout_study.check_settings(layout_study.StudySettings(sft_steps=4, seeds=[0]), tmp_path)
    assert json.loads((tmp_path / "settings.json").read_text())["sft_steps"] == 3


def test_a_study_with_ruler_units_to_run_refuses_without_lm_evals_ruler_extra(tmp_path, monkeypatch):
    import importlib.util

    args, settings = layout_study.parse_args(["--results-dir", str(tmp_path), "--work-dir", str(tmp_path)])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wonderwords" else find_spec(name))
    with pytest.raises(SystemExit, match=r"RULER needs wonderwords .*pip install \"lm-eval\[ruler\]==0.4.13\""):
        layout_study.check_ruler_modules(settings, args)
    args.only = ["sft", "gsm8k"]
    layout_study.check_ruler_modules(settings, args)  # no RULER unit to run: no refusal


def test_the_command_line_defaults_are_the_committed_studys_settings():
    _, settings = layout_study.parse_args([])
    committed = json.loads((COMMITTED / "settings.json").read_text())
    assert json.loads(json.dumps(layout_study.dataclasses.asdict(settings))) == committed
    assert settings.window == 256 and settings.flop_matched_window == 1024


def test_the_sft_flags_are_the_same_for_every_arm_but_the_model(tmp_path):
    settings = layout_study.StudySettings()
    flags = {arm: layout_study.sft_argv(settings, tmp_path, arm, 1) for arm in ARMS}
    for arm, argv in flags.items():
        different = {argv[i] for i in range(len(argv)) if argv[i] != flags["hybrid"][i]}
        assert different <= {
            str(layout_study.model_dir(arm, tmp_path)),
            str(layout_study.model_dir(healed_name(arm, 1), tmp_path)),
        }
    argv = flags["hybrid"]
    assert not (tmp_path / "data").exists()  # the flags name the rows; only a run writes them
    assert argv[argv.index("--packing_strategy") + 1] == "wrapped"
    assert argv[argv.index("--max_length") + 1] == "2048"
    assert "--no_convert_to_iha" in argv


# --------------------------------------------------------------------------------------------------------------------
# The report, from hand-made result files
# --------------------------------------------------------------------------------------------------------------------


def write(path, record):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def unit_record(**fields):
    return {"seconds": {"wall": 2.0, "cpu": 1.0}, "load_average_start": [3.0], "load_average_end": [4.0], **fields}


def ruler_record(scores, responses=None, hashes=None):
    responses = responses or [f"answer {score}" for score in scores]
    hashes = hashes or [f"hash{index}" for index in range(len(scores))]
    samples = [
        {"doc_id": index, "doc_hash": hashes[index], "target": ["x"], "response": responses[index], "score": score}
        for index, score in enumerate(scores)
    ]
    return unit_record(samples=samples, lm_eval={"version": "0.4.13"})


def gsm8k_record(nll, correct):
    problems = [{"id": str(index), "correct": value, "finished": True} for index, value in enumerate(correct)]
    return unit_record(**{"reference": {"nll": nll, "tokens": [10] * len(nll)}, "pass": {"problems": problems}})


def study_folder(tmp_path, seeds=(0, 1, 2)):
    settings = json.loads(
        json.dumps(layout_study.dataclasses.asdict(layout_study.StudySettings(seeds=list(seeds), ruler_samples=3)))
    )
    write(tmp_path / "settings.json", settings)
    spans = {"1-256": {"max_abs_logit_diff": 0.0, "top1_agreement": 1.0}}
    models = {name: {"command": f"build {name}", "against_base": spans} for name in BEFORE_MODELS[1:]}
    write(tmp_path / "models.json", unit_record(source="SMOLLM2", models=models))
    scores = {
        "base": [1.0, 1.0, 0.5],
        "identity": [1.0, 1.0, 0.5],
        "hybrid": [0.0, 1.0, 0.0],
        "global_local": [1, 0, 0],
    }
    for model, values in scores.items():
        for task in RULER_TASKS:
            write(tmp_path / "ruler" / model / f"{task}.json", ruler_record(values))
    for model in BEFORE_MODELS:
        write(tmp_path / "gsm8k" / f"{model}.json", gsm8k_record([10.0, 20.0, 30.0], [True, False, True]))
    healed = {"hybrid": [0.5, 0.6, 0.7], "global_local": [0.4, 0.4, 0.5], "base": [0.9, 0.8, 0.9]}
    for arm, values in healed.items():
        for seed, value in zip(seeds, values):
            for task in RULER_TASKS:
                write(tmp_path / "ruler" / healed_name(arm, seed) / f"{task}.json", ruler_record([value] * 3))
            trace = [{"step": 1, "digest": f"seed{seed}", "tokens": 2048, "loss_tokens": 900}]
            write(
                tmp_path / "sft" / f"{healed_name(arm, seed)}.json",
                unit_record(steps=1, trained_tokens=2048, loss_tokens=900, step_trace=trace, losses=[1.5]),
            )
    return healed


def test_the_report_computes_every_figure_from_the_files(tmp_path):
    healed = study_folder(tmp_path)
    report = summarize(load_results(tmp_path))
    assert report["identity_check"] == {
        "tasks": list(RULER_TASKS),
        "samples": 9,
        "equal_answers": 9,
        "equal_scores": 9,
        "base_score": 2.5 / 3,
        "identity_score": 2.5 / 3,
    }
    assert report["same_samples"] is True
    before = report["before"]
    assert before["hybrid"]["ruler"] == pytest.approx(1 / 3)
    assert before["hybrid"]["ruler_kept"] == pytest.approx((1 / 3) / (2.5 / 3))
    pooled = lambda values: values * 3  # noqa: E731  (the three tasks, one after the other)
    expected = mean_bootstrap(pooled([1.0, 1.0, 0.5]), pooled([0.0, 1.0, 0.0]), num_resamples=10_000)["difference"]
    assert before["hybrid"]["ruler_vs_base"] == expected
    loss = token_loss_bootstrap([10.0, 20.0, 30.0], [10.0, 20.0, 30.0], [10] * 3, num_resamples=10_000)
    assert before["global_local"]["reference_loss_vs_base"]["estimate"] == loss["difference"]["estimate"] == 0
    assert before["global_local"]["pass_vs_base"] == {"only_base": 0, "only_model": 0, "mcnemar_p": 1.0}
    after = report["after"]
    assert after["arms"]["hybrid"]["ruler"]["per_seed"] == pytest.approx(dict(zip([0, 1, 2], healed["hybrid"])))
    paired = after["paired"]["hybrid - global_local"]["ruler"]
    expected = paired_over_seeds(healed["global_local"], healed["hybrid"], [0, 1, 2])
    for key in ("mean", "ci", "t_p_value", "permutation_p_value", "differences"):
        assert paired[key] == pytest.approx(expected[key])
    healing = after["arms"]["hybrid"]["ruler"]["healing"]
    assert healing["differences"] == pytest.approx([value - 1 / 3 for value in healed["hybrid"]])
    task = f"ruler_{RULER_TASKS[0]}"
    assert after["arms"]["global_local"][task]["per_seed"] == pytest.approx(
        dict(zip([0, 1, 2], healed["global_local"]))
    )
    assert after["arms"]["global_local"][task]["healing"]["differences"] == pytest.approx(
        [value - 1 / 3 for value in healed["global_local"]]
    )
    assert after["paired"]["hybrid - global_local"][task]["mean"] == pytest.approx(expected["mean"])
    assert report["sft"]["same_data"] == {0: True, 1: True, 2: True}
    assert not report["complete"]  # no GSM8K scores of the healed models
    assert report["missing"] == [f"gsm8k/{healed_name(arm, seed)}" for seed in (0, 1, 2) for arm in ARMS]
    page = render_markdown(report)
    assert "**PARTIAL: 53 of 62 units done**" in page
    assert "9 of 9 RULER answers identical" in page
    row = f"| Global+Local | {RULER_TASKS[0]} | 33.3 | 43.3 ± 5.8 (40.0 / 40.0 / 50.0) | +10.0 ["
    assert row in page
    assert f"- hybrid - global_local, RULER {RULER_TASKS[0]}: +16.7 points [" in page
    assert "- hybrid - global_local, RULER mean: +16.7 points [" in page


def test_a_task_measured_after_healing_compares_before_the_other_tasks_are(tmp_path):
    study_folder(tmp_path, seeds=(0, 1))
    for arm in ARMS:
        for seed in (0, 1):
            for task in RULER_TASKS[1:]:
                (tmp_path / "ruler" / healed_name(arm, seed) / f"{task}.json").unlink()
    after = summarize(load_results(tmp_path))["after"]
    assert after["arms"]["hybrid"]["ruler"]["spread"] is None  # no three-task mean yet
    assert after["arms"]["hybrid"][f"ruler_{RULER_TASKS[0]}"]["per_seed"] == pytest.approx({0: 0.5, 1: 0.6})
    assert after["arms"]["hybrid"][f"ruler_{RULER_TASKS[1]}"]["spread"] is None
    assert "ruler" not in after["paired"]["hybrid - global_local"]
    assert f"ruler_{RULER_TASKS[0]}" in after["paired"]["hybrid - global_local"]


def test_the_report_says_when_the_identity_arm_or_the_data_differ(tmp_path):
    study_folder(tmp_path, seeds=(0,))
    answers = ["answer 1.0", "something else", "answer 0.5"]
    write(tmp_path / "ruler" / "identity" / f"{RULER_TASKS[0]}.json", ruler_record([1.0, 1.0, 0.5], answers))
    trace = [{"step": 1, "digest": "other", "tokens": 2048, "loss_tokens": 900}]
    record = json.loads((tmp_path / "sft" / f"{healed_name('base', 0)}.json").read_text())
    write(tmp_path / "sft" / f"{healed_name('base', 0)}.json", {**record, "step_trace": trace})
    report = summarize(load_results(tmp_path))
    assert report["identity_check"]["equal_answers"] == 8
    assert report["sft"]["same_data"] == {0: False}
    page = render_markdown(report)
    assert "8 of 9 RULER answers identical, 9 of 9 scores equal" in page and "NOT equal" in page
    assert "seed 0: NO" in page


def test_a_partial_study_reports_each_task_measured_with_its_interval(tmp_path):
    settings = layout_study.dataclasses.asdict(layout_study.StudySettings())
    write(tmp_path / "settings.json", settings)
    base, hybrid = [1] * 10, [1, 1, 1, 1, 1, 0, 0, 0, 0, 1]
    write(tmp_path / "ruler" / "base" / f"{RULER_TASKS[0]}.json", ruler_record(base))
    write(tmp_path / "ruler" / "hybrid" / f"{RULER_TASKS[0]}.json", ruler_record(hybrid))
    report = summarize(load_results(tmp_path))
    before = report["before"]
    assert before["hybrid"]["ruler"] is None  # no mean while two tasks are missing
    detail = before["hybrid"]["ruler_task_details"][RULER_TASKS[0]]
    assert detail["samples"] == 10 and detail["score_sum"] == 6 and detail["binary"]
    # The Wilson interval by hand: 6 of 10 gives 0.3127 to 0.8318; 10 of 10 gives 0.7225 to 1.
    assert detail["wilson95"] == pytest.approx([0.3127, 0.8318], abs=1e-4)
    assert before["base"]["ruler_task_details"][RULER_TASKS[0]]["wilson95"] == pytest.approx([0.7225, 1.0], abs=1e-4)
    versus = before["hybrid"]["ruler_tasks_vs_base"][RULER_TASKS[0]]
    assert (versus["only_base"], versus["only_model"]) == (4, 0)
    assert versus["mcnemar_p"] == pytest.approx(2 * 0.5**4)
    page = render_markdown(report)
    assert f"| {RULER_TASKS[0]} | IHA hybrid (paper's layout) | 10 | 60 [31, 83] | 4 / 0 (0.12) |" in page
    write(tmp_path / "ruler" / "identity" / f"{RULER_TASKS[0]}.json", ruler_record(base, hashes=["other"] * 10))
    with pytest.raises(ValueError, match="was not asked the base's samples"):
        summarize(load_results(tmp_path))


def test_a_ruler_unit_cut_short_by_the_cap_is_done_only_for_that_cap(tmp_path):
    settings = layout_study.StudySettings()
    unit = layout_study.Unit("ruler", "identity", RULER_TASKS[0])
    assert not layout_study.unit_done(unit, settings, tmp_path, cap=2)
    write(unit.result_path(tmp_path), ruler_record([1, 1]))
    assert layout_study.unit_done(unit, settings, tmp_path, cap=2)
    assert not layout_study.unit_done(unit, settings, tmp_path)  # the study's 10 samples: extend it
    assert layout_study.ruler_limit(settings, 50) == settings.ruler_samples
    assert "--limit 2 " in layout_study.ruler_command(settings, "MODEL", RULER_TASKS[0], 2)
    # The report counts it as missing, says how many samples it holds, and takes no three-task mean from it.
    write(tmp_path / "settings.json", layout_study.dataclasses.asdict(settings))
    write(tmp_path / "ruler" / "base" / f"{RULER_TASKS[0]}.json", ruler_record([1] * 10))
    report = summarize(load_results(tmp_path))
    assert f"ruler/identity/{RULER_TASKS[0]}" in report["missing"]
    assert f"ruler/base/{RULER_TASKS[0]}" not in report["missing"]
    assert report["same_samples"] is True  # the first two of the base's ten
    assert report["identity_check"]["samples"] == 2
    assert "| 2 of 10 (partial) | 100 [34, 100] |" in render_markdown(report)


def test_the_committed_report_is_what_its_files_say():
    report = summarize(load_results(COMMITTED))
    assert json.loads(json.dumps(report)) == json.loads((COMMITTED / "report.json").read_text())
    assert render_markdown(report) == (COMMITTED / "report.md").read_text()


def test_the_committed_identity_arm_answers_as_the_base_does():
    check = summarize(load_results(COMMITTED))["identity_check"]
    if check is None:
        pytest.skip("the committed study has no RULER answers of the identity arm yet")
    assert check["equal_answers"] == check["equal_scores"] == check["samples"]


@pytest.mark.slow  # a process that imports torch and transformers (the package's `__init__`)
def test_help_runs_without_the_models():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "layout_study.py"), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "--ruler-samples" in result.stdout and "--only" in result.stdout


def test_the_report_gives_a_difference_every_seed_shares_without_a_zero_width_interval():
    from layout_study_report import _healing_cell, describe_over_seeds

    same = paired_over_seeds([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0, 1, 2])
    text = describe_over_seeds(same, 100, 1, " points")
    assert text.startswith("-100.0 points in each of the 3 seeds (no spread over seeds: no t interval;")
    assert "p = 0.25, the smallest possible" in text and "paired t p" not in text
    assert _healing_cell({"healing": same}, 100, 1) == "-100.0 in every seed"
    unchanged = paired_over_seeds([0.4, 0.4], [0.4, 0.4], [0, 1])
    assert "smallest" not in describe_over_seeds(unchanged, 100, 1)
    varied = paired_over_seeds([0.8, 0.82, 0.81], [0.84, 0.85, 0.83], [0, 1, 2])
    assert "95% t interval" in describe_over_seeds(varied, 1, 3)


def test_the_healing_rows_are_what_iha_data_writes_without_the_system_prompt(test_data, tmp_path, monkeypatch):
    """The docs give `iha data gsm8k-to-openthoughts ... --without_system_prompt` for the healing run's rows."""
    from iha.cli.data import main as iha_data
    from iha.data.messages import read_jsonl

    monkeypatch.setattr(layout_study, "GSM8K", str(test_data / "gsm8k"))
    settings = layout_study.StudySettings(train_rows=4)
    written = layout_study.write_training_rows(settings, tmp_path / "work")
    source, by_cli = str(test_data / "gsm8k" / "train.jsonl"), tmp_path / "cli.jsonl"
    assert iha_data(["gsm8k-to-openthoughts", source, str(by_cli), "--limit", "4", "--without_system_prompt"]) == 0
    assert read_jsonl(written) == read_jsonl(by_cli) and len(read_jsonl(written)) == 4
