"""`python -m research.ab`: the two arms train on the same tokens in the same order, the converted arm starts as the
source model, finished runs are reused and interrupted ones resume, and the paired statistics give the known answers."""

import json
import math
import random
import shlex

import pytest
import torch
from testing_utils import REPO_ROOT, build_tiny_tokenizer, tiny_llama_for_tokenizer

from iha.data.messages import read_jsonl
from iha.training import load_model_for_sft
from research import statistics as stats
from research.ab.cli import main, make_parser
from research.ab.config import preset_config
from research.ab.data import prepare_data, prepare_reference_rows
from research.ab.measures import StepTrace
from research.ab.runs import prepare_output_dir, run_name, train_run


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    """A tiny random Llama with a 1k-token GSM8K tokenizer and SmolLM2's chat template: the source model."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tiny_tokenizer(folder)
    tiny_llama_for_tokenizer(tokenizer, max_position_embeddings=1024).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    from testing_utils import TEST_DATA

    return TEST_DATA / "gsm8k" / "train.jsonl", TEST_DATA / "gsm8k" / "test.jsonl"


def tiny_argv(tiny_source, data_files, output_dir, *extra) -> list[str]:
    train, test = data_files
    return [
        "--preset", "tiny", "--model", str(tiny_source), "--train-data", str(train), "--test-data", str(test),
        "--output-dir", str(output_dir), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tiny_source, data_files, tmp_path_factory):
    """The tiny preset run end to end once: (output folder, report)."""
    output_dir = tmp_path_factory.mktemp("ab") / "out"
    assert main(tiny_argv(tiny_source, data_files, output_dir)) == 0
    return output_dir, json.loads((output_dir / "report.json").read_text())


def read_run(output_dir, name) -> dict:
    return json.loads((output_dir / name / "train.json").read_text())


def test_arms_train_on_the_same_tokens_in_the_same_order(finished):
    output_dir, report = finished
    config = preset_config("tiny")
    chosen = report["chosen_mixing_learning_rate"]
    traces = {}
    for seed in config.seeds:
        base = read_run(output_dir, run_name("base", seed))
        converted = read_run(output_dir, run_name("iha", seed, chosen))
        assert base["steps"] == converted["steps"] == config.training.max_steps
        assert (
            base["trained_tokens"] == converted["trained_tokens"] > base["loss_tokens"] == converted["loss_tokens"] > 0
        )
        assert len(base["step_trace"]) == config.training.max_steps * config.training.gradient_accumulation_steps
        assert all(step["loss_tokens"] > 0 for step in base["step_trace"])
        assert base["step_trace"] == converted["step_trace"]
        traces[seed] = base["step_trace"]
    # The trace tells data orders apart: the seeds shuffle the rows differently.
    assert traces[config.seeds[0]] != traces[config.seeds[1]]
    # Every mixing-lr candidate trained on the same tokens too.
    for lr in config.mixing_learning_rates:
        assert read_run(output_dir, run_name("iha", config.seeds[0], lr))["step_trace"] == traces[config.seeds[0]]
    assert all(entry["same_data"] for entry in report["same_data"])


def test_converted_arm_starts_as_the_source_model(finished, tiny_source):
    output_dir, report = finished
    assert report["conversion"]["max_abs_logit_diff"] < 1e-4
    losses = report["conversion"]["validation_loss"]
    assert losses["base"] == pytest.approx(losses["iha"], abs=1e-5)
    source, converted_flag = load_model_for_sft(str(tiny_source), convert_to_iha=False)
    converted, converted_flag = load_model_for_sft(str(tiny_source), iha_options={"num_pseudo_heads": 2})
    assert converted_flag and converted.config.model_type == "iha" and source.config.model_type == "llama"
    input_ids = torch.randint(3, source.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids).logits, source(input_ids).logits, atol=1e-5, rtol=1e-5)


def test_report_holds_every_arm_seed_and_plot(finished):
    output_dir, report = finished
    config = preset_config("tiny")
    for name in ("report.md", "curves.png", "drift.png", "data/train.jsonl", "data/validation.jsonl"):
        assert (output_dir / name).is_file(), name
    assert len((output_dir / "data" / "train.jsonl").read_text().splitlines()) == config.num_train_rows
    split = json.loads((output_dir / "data" / "split.json").read_text())
    assert not set(split["train_indices"]) & set(split["validation_indices"])
    losses = [read_run(output_dir, run)["validation"]["loss"] for run in report["arms"]["a"]["runs"]]
    assert report["validation_loss"]["a"]["values"] == pytest.approx(losses)
    selection = {e["mixing_learning_rate"]: e["validation_loss"] for e in report["mixing_learning_rate_selection"]}
    assert report["chosen_mixing_learning_rate"] == min(selection, key=selection.get)
    assert len(report["mixing_drift"]) == 2  # one row per IHA layer
    assert all(report["mixing_drift"][0][name] > 0 for name in ("alpha_q", "alpha_k", "alpha_v", "collapse"))
    gsm8k = report["benchmarks"]["gsm8k"]
    assert gsm8k["num_problems"] == config.num_test_problems
    assert len(gsm8k["mcnemar"]["per_seed"]) == len(config.seeds)
    markdown = (output_dir / "report.md").read_text()
    assert "exact McNemar" in markdown and "What it cannot show" in markdown and "![drift](drift.png)" in markdown


def test_second_call_reuses_every_finished_run(finished, tiny_source, data_files, monkeypatch):
    output_dir, _ = finished
    results = sorted(output_dir.glob("*/train.json")) + sorted(output_dir.glob("*/eval-*.json"))
    before = {path: path.stat().st_mtime_ns for path in results}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run was trained or evaluated again")

    monkeypatch.setattr("research.ab.runs.train_sft", must_not_run)
    monkeypatch.setattr("research.ab.runs.generate_completions", must_not_run)
    assert main(tiny_argv(tiny_source, data_files, output_dir)) == 0
    assert {path: path.stat().st_mtime_ns for path in results} == before


def test_other_settings_in_the_same_folder_are_one_line_error(finished, tiny_source, data_files, capsys):
    output_dir, _ = finished
    assert main(tiny_argv(tiny_source, data_files, output_dir, "--learning-rate", "0.5")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "learning_rate" in error and "--output-dir" in error and "--fresh" in error


def test_a_run_that_fails_before_training_leaves_no_state_and_the_corrected_command_goes_on(
    tiny_source, data_files, tmp_path, capsys
):
    output_dir = tmp_path / "out"
    unreachable = ["--test-data", "someone/gsm8k-that-is-not-here"]  # offline: the Hub cannot be reached
    assert main(tiny_argv(tiny_source, data_files, output_dir, *unreachable)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "someone/gsm8k-that-is-not-here" in err, err
    assert not output_dir.exists()  # no ab_config.json, no data split: nothing that refuses the corrected command
    output_dir.mkdir()  # a folder the user made stays, empty
    assert main(tiny_argv(tiny_source, data_files, output_dir, *unreachable)) == 2
    assert list(output_dir.iterdir()) == []
    train, test = data_files
    config = preset_config("tiny", model=str(tiny_source), train_data=str(train), test_data=str(test))
    assert prepare_output_dir(output_dir, config) is True  # the corrected settings start a new run there


def test_tiny_preset_without_a_model_is_refused(tmp_path, capsys):
    assert main(["--preset", "tiny", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_model_folder_is_one_line_saying_so_and_exit_2(tmp_path, capsys, monkeypatch):
    # A relative path, as a user types it: huggingface_hub would read `./missing` as a malformed repository id.
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "./missing", "--output_dir", "OUT"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["python -m research.ab: error: The folder ./missing does not exist."]
    assert list(tmp_path.iterdir()) == []


def test_the_committed_reports_command_is_read_by_the_command_that_replaced_it():
    # benchmarks/ab/cpu was made by `iha ab` before it left the package; `python -m research.ab` takes its flags.
    report = json.loads((REPO_ROOT / "benchmarks" / "ab" / "cpu" / "report.json").read_text(encoding="utf-8"))
    program, flags = report["command"].split()[:2], shlex.split(report["command"])[2:]
    assert program == ["iha", "ab"]
    args = make_parser().parse_args(flags)
    assert (args.preset, args.threads, args.output_dir) == ("cpu", 1, "runs/ab-cpu")


def test_interrupted_training_resumes_from_its_checkpoint_with_the_same_data(
    finished, tiny_source, data_files, tmp_path, monkeypatch
):
    output_dir, _ = finished
    train, test = data_files
    config = preset_config("tiny", model=str(tiny_source), train_data=str(train), test_data=str(test))
    train_rows, validation_rows = prepare_data(config, output_dir)
    settings = {"device": "cpu", "bf16": False, "eval_dtype": "float32"}
    run_dir = tmp_path / "base-seed0"

    def stop_after_first_checkpoint(self, args, state, control, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(StepTrace, "on_save", stop_after_first_checkpoint, raising=False)
    with pytest.raises(KeyboardInterrupt):
        train_run(run_dir, "base", 0, None, str(tiny_source), train_rows, validation_rows, config, settings)
    assert (run_dir / "training" / f"checkpoint-{config.training.save_steps}").is_dir()
    assert not (run_dir / "train.json").exists()
    monkeypatch.undo()
    resumed = train_run(run_dir, "base", 0, None, str(tiny_source), train_rows, validation_rows, config, settings)
    uninterrupted = read_run(output_dir, "base-seed0")
    assert resumed["resumed_from"] == f"checkpoint-{config.training.save_steps}"
    assert resumed["step_trace"] == uninterrupted["step_trace"]
    assert resumed["validation"]["loss"] == pytest.approx(uninterrupted["validation"]["loss"], rel=1e-4)
    assert not list((run_dir / "training").glob("checkpoint-*"))  # deleted once the run is done


# ---------------------------------------------------------------------------------------------------------------------
# Statistics against known answers
# ---------------------------------------------------------------------------------------------------------------------


def test_mcnemar_exact_matches_hand_computed_binomial_tails():
    # b=1, c=9: p = 2 * (C(10,0) + C(10,1)) / 2^10
    assert stats.mcnemar_exact(1, 9) == 2 * (1 + 10) / 1024 == 0.021484375
    assert stats.mcnemar_exact(9, 1) == stats.mcnemar_exact(1, 9)
    assert stats.mcnemar_exact(0, 6) == 2 / 64
    assert stats.mcnemar_exact(5, 5) == 1.0  # capped
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(3, 7) == pytest.approx(2 * sum(math.comb(10, i) for i in range(4)) / 1024)
    assert stats.minimum_discordant_pairs(0.05) == 6
    assert stats.discordant_counts([1, 1, 0, 0, 1], [1, 0, 1, 1, 0]) == (2, 2)


def test_bootstrap_intervals_cover_the_known_difference():
    generator = random.Random(0)
    tokens = [generator.randint(20, 80) for _ in range(300)]
    nll_a = [n * (1.0 + generator.gauss(0, 0.2)) for n in tokens]
    nll_b = [a - 0.1 * n + n * generator.gauss(0, 0.05) for a, n in zip(nll_a, tokens)]
    true_difference = (sum(nll_b) - sum(nll_a)) / sum(tokens)
    result = stats.token_loss_bootstrap(nll_a, nll_b, tokens, num_resamples=2000)
    low, high = result["difference"]["ci"]
    assert low < true_difference < high and high < 0  # the -0.1 per token shift is resolved
    assert result["difference"]["estimate"] == pytest.approx(true_difference)
    assert result["a"]["ci"][0] < sum(nll_a) / sum(tokens) < result["a"]["ci"][1]
    scores_a = [float(generator.random() < 0.3) for _ in range(400)]
    scores_b = [float(generator.random() < 0.3) for _ in range(400)]
    means = stats.mean_bootstrap(scores_a, scores_b, num_resamples=2000)
    low, high = means["difference"]["ci"]
    assert low < sum(scores_b) / 400 - sum(scores_a) / 400 < high
    identical = stats.mean_bootstrap(scores_a, scores_a, num_resamples=200)
    assert identical["difference"]["ci"] == (0.0, 0.0)


def test_detectable_difference_solves_the_paired_sample_size():
    z_alpha, z_power = 1.959963984540054, 0.8416212335729143
    for n, psi in ((100, 0.2), (1319, 0.1), (64, 0.5)):
        d = stats.detectable_accuracy_difference(n, psi)
        needed = (z_alpha * math.sqrt(psi) + z_power * math.sqrt(psi - d * d)) ** 2 / (d * d)
        assert needed == pytest.approx(n, rel=1e-6)
    assert stats.detectable_accuracy_difference(400, 0.2) < stats.detectable_accuracy_difference(100, 0.2)
    assert stats.detectable_accuracy_difference(100, 0.0) is None
    assert stats.detectable_accuracy_difference(4, 0.5) == 0.5  # too few problems: only the largest difference


def test_seed_spread_and_the_paired_comparison_over_seeds():
    spread_a = stats.seed_spread([0.30, 0.34])
    assert spread_a["mean"] == pytest.approx(0.32) and spread_a["range"] == pytest.approx(0.04)
    assert spread_a["std"] == pytest.approx(0.04 / math.sqrt(2))
    # The seeds' spreads overlap (0.30-0.34 against 0.31-0.36), but B is above A on every seed by 0.01-0.02: the
    # paired comparison sees the consistent difference the unpaired spreads hide.
    a, b = [0.30, 0.34, 0.32, 0.36], [0.315, 0.355, 0.33, 0.38]
    paired = stats.paired_over_seeds(a, b, [0, 1, 2, 3])
    assert paired["mean"] == pytest.approx(0.015) and paired["labels"] == [0, 1, 2, 3]
    assert paired["interval_excludes_zero"] and paired["t_p_value"] < 0.01
    assert paired["permutation_p_value"] == 2 / 16  # all four positive: the smallest it can be with 4 seeds
    noisy = stats.paired_over_seeds([0.30, 0.34], [0.31, 0.33], [0, 1])
    assert noisy["interval_excludes_zero"] is False and noisy["permutation_p_value"] == 1.0
    assert stats.paired_over_seeds([0.3], [0.4], [0])["interval_excludes_zero"] is None  # one seed: no spread


def test_detectable_difference_and_items_needed():
    # (z_0.975 + z_0.8) = 2.8016 standard errors; the standard error falls as 1 / sqrt(items).
    assert stats.detectable_difference(0.001) == pytest.approx(2.801585218e-3, rel=1e-8)
    # The cpu run's validation loss: SE 0.000546 over 64 rows -> 0.0005 nats/token needs 600 rows.
    needed = stats.items_needed(0.000546, 64, 0.0005)
    assert needed == math.ceil(64 * (2.801585218 * 0.000546 / 0.0005) ** 2) == 600
    assert stats.detectable_difference(0.000546 * math.sqrt(64 / needed)) <= 0.0005


def test_reference_solutions_are_scored_and_paired_per_problem(finished, data_files):
    output_dir, report = finished
    config = preset_config("tiny", test_data=str(data_files[1]))
    rows = prepare_reference_rows(config)
    test_rows = [json.loads(line) for line in data_files[1].read_text().splitlines()[: config.num_reference_problems]]
    assert len(rows) == config.num_reference_problems == 4
    assert all(row["conversations"][0]["value"].endswith(test["question"]) for row, test in zip(rows, test_rows))
    assert all("system" not in row for row in rows)  # as the tiny preset's training rows
    scored = {
        arm: [
            json.loads((output_dir / run / "reference-gsm8k.json").read_text()) for run in report["arms"][arm]["runs"]
        ]
        for arm in ("a", "b")
    }
    tokens = scored["a"][0]["tokens"]
    assert len(tokens) == 4 and all(count > 0 for count in tokens)
    assert all(entry["tokens"] == tokens for entry in scored["a"] + scored["b"])  # the same tokens in every run
    reference = report["reference_loss"]
    assert reference["a"]["values"] == pytest.approx([entry["loss"] for entry in scored["a"]])
    # Per problem, averaged over seeds, then per token: the headline difference.
    nll = {arm: [sum(values) / len(values) for values in zip(*(e["nll"] for e in scored[arm]))] for arm in scored}
    assert reference["paired"]["difference"]["estimate"] == pytest.approx((sum(nll["b"]) - sum(nll["a"])) / sum(tokens))
    assert reference["paired_over_seeds"]["differences"] == pytest.approx(
        [b["loss"] - a["loss"] for a, b in zip(scored["a"], scored["b"])]
    )
    # The mixing learning rate was chosen on the validation rows, which are training rows, not test problems.
    validation_questions = [
        row["conversations"][0]["value"] for row in read_jsonl(output_dir / "data" / "validation.jsonl")
    ]
    assert not set(validation_questions) & {row["conversations"][0]["value"] for row in rows}
    markdown = (output_dir / "report.md").read_text()
    assert markdown.index("reference-solution loss, test") < markdown.index("validation loss, selection split")
