"""docs/serving.md's "Choosing a layout": its tables are what `benchmarks/layout_decision.py` computes from the
committed results (the layout study's result files and the vLLM layouts benchmark's JSON), and its prose quotes no
figure those tables do not hold."""

import re
import sys

from testing_utils import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from layout_decision import DOCS_PATH, END_MARKER, START_MARKER, decision_tables, docs_tables, load_inputs  # noqa: E402


SECTION_TITLE = "## 8. Choosing a layout"
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def section_text() -> str:
    text = DOCS_PATH.read_text(encoding="utf-8")
    section = text.split(SECTION_TITLE, 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_docs_hold_the_tables_the_committed_results_give():
    study, served = load_inputs()
    assert docs_tables(DOCS_PATH.read_text(encoding="utf-8")) == decision_tables(study, served)


def test_the_prose_beside_the_tables_quotes_only_their_figures():
    section = section_text()
    tables = section.split(START_MARKER, 1)[1].split(END_MARKER, 1)[0]
    prose = section.replace(tables, "")
    prose = re.sub(r"```.*?```", "", prose, flags=re.DOTALL)  # the commands: settings, not measurements
    prose = re.sub(r"`[^`]*`", "", prose)  # file names and flags
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # links' addresses
    allowed = set(NUMBER.findall(tables)) | {
        "8",
        "4",
        "1",
        "2",
    }  # the section number; "4 sliding ... : 1 global", P = 2
    quoted = set(NUMBER.findall(prose))
    assert quoted <= allowed, f"figures in the prose that the tables do not hold: {sorted(quoted - allowed)}"


def test_a_ruler_cell_names_the_tasks_measured_and_the_ones_not_yet():
    from layout_decision import PENDING, ruler_tasks_cell

    before = {
        "ruler_task_details": {
            "niah_single_1": {"samples": 10, "samples_planned": 10, "score_sum": 6, "binary": True,
                              "wilson95": [0.3127, 0.8318]},
            "niah_multikey_2": {"samples": 3, "samples_planned": 10, "score_sum": 3, "binary": True,
                                "wilson95": [0.4385, 1.0]},
        },
        "ruler_tasks_vs_base": {"niah_single_1": {"only_base": 4, "only_model": 0}},
    }  # fmt: skip
    assert ruler_tasks_cell(before) == (
        "niah_single_1 60 [31, 83] (10 samples; right only in the base / only here: 4 / 0); "
        "niah_multikey_2 100 [44, 100] (partial: 3 of 10 samples); "
        f"niah_multikey_3: {PENDING}"
    )
    assert ruler_tasks_cell({}) == PENDING


def test_a_ruler_cell_after_healing_gives_each_task_beside_its_score_before_then_the_mean():
    from layout_decision import PENDING, ruler_after_cell

    spread = {"mean": 0.2, "std": 0.1, "values": [0.1, 0.2, 0.3]}
    study = {
        "before": {"hybrid": {"ruler_niah_single_1": 0.0, "ruler": None}, "base": {"ruler": 0.5}},
        "after": {"arms": {"hybrid": {"ruler_niah_single_1": {"spread": spread}, "ruler": {"spread": None}}}},
    }
    assert ruler_after_cell(study, "hybrid") == (
        f"niah_single_1 20 ± 10 (3 seeds), before 0; niah_multikey_2, niah_multikey_3: {PENDING}"
    )
    assert ruler_after_cell(study, "global_local") == PENDING
    arms = study["after"]["arms"]["hybrid"]
    arms["ruler_niah_multikey_2"] = arms["ruler_niah_multikey_3"] = {"spread": spread}
    arms["ruler"]["spread"] = {"mean": 0.25, "std": 0.05, "values": [0.2, 0.3]}
    assert ruler_after_cell(study, "hybrid") == (
        "niah_single_1 20 ± 10 (3 seeds), before 0; niah_multikey_2 20 ± 10 (3 seeds); "
        "niah_multikey_3 20 ± 10 (3 seeds); mean 25.0 ± 5.0 (2 seeds), 0.50x of the base as it is"
    )


def test_the_readme_line_on_layouts_quotes_only_the_tables_figures():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    (line,) = [row for row in readme.splitlines() if row.startswith("| which layout for which context length")]
    tables = docs_tables(DOCS_PATH.read_text(encoding="utf-8"))
    text = re.sub(r"\]\([^)]*\)", "]", line)  # the link's address
    quoted = set(NUMBER.findall(text))
    assert quoted <= set(NUMBER.findall(tables)), (
        f"README figures the tables do not hold: {quoted - set(NUMBER.findall(tables))}"
    )


def test_a_layout_after_healing_is_set_against_the_control_seed_by_seed():
    from layout_decision import versus_control

    from research.statistics import paired_over_seeds

    paired = paired_over_seeds([0.80, 0.82], [0.84, 0.85], [0, 1])  # the control's losses, then the hybrid's
    study = {"after": {"paired": {"hybrid - base": {"reference_loss": paired}}}}
    low, high = paired["ci"]
    assert versus_control(study, "hybrid", "reference_loss", 1, 3) == (
        f"+0.035 [{low:+.3f}, {high:+.3f}] against the control (95% t interval over 2 seeds, paired; 2 of 2 seeds "
        "above zero)"
    )
    one = {"after": {"paired": {"hybrid - base": {"reference_loss": paired_over_seeds([0.8], [0.9], [0])}}}}
    assert versus_control(one, "hybrid", "reference_loss", 1, 3) == "+0.100 against the control (1 seed)"
    assert versus_control(study, "base", "reference_loss", 1, 3) is None
    assert versus_control(study, "global_local", "reference_loss", 1, 3) is None


def test_a_difference_every_seed_shares_is_given_as_such_not_as_an_interval_of_zero_width():
    """The same difference in every seed has no spread: a t interval would be a point and its p-value no evidence."""
    from layout_decision import versus_control

    from research.statistics import paired_over_seeds

    same = paired_over_seeds([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0, 1, 2])  # the control finds it, the layout never
    study = {"after": {"paired": {"hybrid - base": {"ruler_niah_single_1": same}}}}
    text = versus_control(study, "hybrid", "ruler_niah_single_1", 100, 0)
    assert text == "-100 against the control in each of the 3 seeds (paired)"
    assert "[" not in text


def test_the_gsm8k_loss_after_healing_leads_with_the_control():
    from layout_decision import PENDING, loss_after_cell, loss_before_cell

    from research.statistics import paired_over_seeds

    spread = {"mean": 0.9, "std": 0.01, "values": [0.89, 0.9, 0.91]}
    study = {
        "before": {"base": {"reference_loss": 1.4}, "hybrid": {"reference_loss": 1.45, "reference_loss_vs_base": {
            "ci": [0.03, 0.07]}}},
        "after": {
            "arms": {"base": {"reference_loss": {"spread": spread}}},
            "paired": {"hybrid - base": {"reference_loss": paired_over_seeds([0.9, 0.9], [0.92, 0.93], [0, 1])}},
        },
    }  # fmt: skip
    assert loss_before_cell(study, "base") == "1.400"
    assert loss_before_cell(study, "hybrid") == "+0.050 [+0.030, +0.070]"
    assert loss_after_cell(study, "base") == "the control: -0.500 ± 0.010 (3 seeds) against the base as it is"
    assert loss_after_cell(study, "hybrid").startswith("+0.025 [")
    assert loss_after_cell(study, "global_local") == PENDING


def test_a_decode_cell_gives_the_range_of_its_rounds_beside_their_median():
    from layout_decision import _decode_text

    def model(*decode_seconds):
        rounds = [
            {"cpu": {"ttft": 1.0, "first_token_cached": 1.0, "full_cached": 1.0 + seconds}, "kv_bytes_per_token": 1.0,
             "cached_fraction": 0.5}
            for seconds in decode_seconds
        ]  # fmt: skip
        return {"requests": 8, "decode_tokens": 32, "rounds": rounds, "flops": {"decode_step": 1, "prefill": 1}}

    workload = {"models": {"base": model(4.0, 2.0), "hybrid": model(2.0, 1.25)}}
    # Per round the hybrid decodes 2.00x and 1.60x as fast; the medians (3.0 s against 1.625 s) give 1.85x.
    assert _decode_text(workload, "hybrid") == "1.85 (1.60-2.00)"
    assert _decode_text(workload, "base") == "1.00"
    one = {"models": {"base": model(4.0), "hybrid": model(2.0)}}
    assert _decode_text(one, "hybrid") == "2.00"
