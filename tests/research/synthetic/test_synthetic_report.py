"""What the relation-composition comparison writes: one comparison's tables and plot, the summary over seeds with
paired differences, and `--report` on runs still in progress."""

import copy
import json
import struct
from dataclasses import replace

import pytest
import torch

from research.synthetic import write_outputs
from research.synthetic.cli import main
from research.synthetic.states import save_epoch_state


def test_outputs_are_written(tiny_results, tmp_path):
    paths = write_outputs(tiny_results, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == 6
    table = paths["table"].read_text()
    assert table.startswith("| Task | m | Model | Parameters | test acc, lr 0.01 |")
    for line in (
        "| binary | 3..4 | MHA |",
        "| binary | 3..4 | 2-simplicial |",
        "| binary | 3..4 | IHA P=2 |",
        "| ternary | 3..4 | constant (majority label) |",
        "| binary: model | m = 3 | m = 4 |",
    ):
        assert line in table
    stopped = sum(run["stopped_by"] == "patience" for run in tiny_results["runs"])
    assert f"{stopped} of 6 runs stopped by patience, {6 - stopped} by the epoch budget." in table
    png = paths["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 400
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_seed_summary(tiny_results, tmp_path, capsys):
    other = copy.deepcopy(tiny_results)
    other["config"]["seed"] = 1
    for run in other["runs"]:
        run["test_accuracy"] = 0.5 if run["model"] == "MHA" else 0.7
    for index, results in enumerate((tiny_results, other)):
        (tmp_path / f"r{index}.json").write_text(json.dumps(results))
    main(["--summarize", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), "--output-dir", str(tmp_path / "s")])
    summary = json.loads((tmp_path / "s" / "seeds.json").read_text())
    first = next(r for r in tiny_results["runs"] if r["task"] == "binary" and r["model"] == "IHA P=2")
    entry = summary["binary/IHA P=2"]
    assert entry["test_accuracy"] == pytest.approx([100 * first["test_accuracy"], 70.0])
    assert entry["mean"] == pytest.approx((100 * first["test_accuracy"] + 70.0) / 2)
    assert entry["std"] == pytest.approx(abs(100 * first["test_accuracy"] - 70.0) / 2**0.5)
    table = (tmp_path / "s" / "seeds.md").read_text()
    assert "| Task | m | Model | lr 0.01 | val-selected lr | seed 0 | seed 1 | − MHA | − 2-simplicial |" in table
    mha_mean = summary["binary/MHA"]["mean"]
    assert f"| {entry['mean']:.2f} ± {entry['std']:.2f}" in table and f"{entry['mean'] - mha_mean:+.2f}" in table
    assert set(entry["by_m"]) == {"3", "4"}
    # The same seed twice is bad input: one line, exit 2.
    assert (
        main(["--summarize", str(tmp_path / "r0.json"), str(tmp_path / "r0.json"), "--output-dir", str(tmp_path)]) == 2
    )
    assert capsys.readouterr().err.startswith(
        "python -m research.synthetic: error: Each result must come from a different seed"
    )
    # A running call's checkpoint (seed 1 without its 2-simplicial runs yet) summarises over the seeds that have them.
    partial = {"config": other["config"], "runs": [run for run in other["runs"] if run["model"] != "2-simplicial"]}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    main(
        ["--summarize", str(tmp_path / "r0.json"), str(tmp_path / "partial.json"), "--output-dir", str(tmp_path / "p")]
    )
    summary = json.loads((tmp_path / "p" / "seeds.json").read_text())
    assert summary["binary/2-simplicial"]["seeds"] == [0] and summary["binary/IHA P=2"]["seeds"] == [0, 1]
    partial_table = (tmp_path / "p" / "seeds.md").read_text()
    # One seed's value is that seed's, said so, with no spread of zero.
    simplicial = summary["binary/2-simplicial"]
    assert f"| **{simplicial['mean']:.2f} (seed 0 only)** |" in partial_table
    assert f"{simplicial['mean']:.2f} ± 0.00" not in partial_table
    # ... and its picture says so: one seed's value with the seed named, not a mean with no spread.
    from research.synthetic.figures import accuracy_label

    one_seed = summary["binary/2-simplicial"]
    assert accuracy_label(one_seed, [0, 1]) == f"{one_seed['mean']:.2f}\n(seed 0 only)"
    both = summary["binary/IHA P=2"]
    assert accuracy_label(both, [0, 1]) == f"{both['mean']:.2f} ± {both['std']:.2f}"
    assert (tmp_path / "s" / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_summarizes_unfinished_runs_with_paired_differences(tiny_results, tmp_path, capsys):
    # Seed 0 finished, seed 1 interrupted before its 2-simplicial runs, seed 2 not started: --report (the training
    # command's settings) summarizes what is there and names what is not.
    seed_1 = copy.deepcopy(tiny_results)
    seed_1["config"]["seed"] = 1
    for index, run in enumerate(seed_1["runs"]):
        run["test_accuracy"] = min(1.0, run["test_accuracy"] + 0.01 * index)
    (tmp_path / "seed-0").mkdir()
    (tmp_path / "seed-0" / "results.json").write_text(json.dumps(tiny_results))
    partial = {"config": seed_1["config"], "runs": [run for run in seed_1["runs"] if run["model"] != "2-simplicial"]}
    (tmp_path / "seed-1").mkdir()
    (tmp_path / "seed-1" / "results.partial.json").write_text(json.dumps(partial))
    # Seed 1's binary 2-simplicial run is training: its state after 2 epochs is where the training command keeps it.
    import research.synthetic.train as synthetic_training

    history = [
        {"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.75},
        {"epoch": 2, "train_loss": 0.4, "val_accuracy": 0.8},
    ]
    state = {"config": seed_1["config"], "history": history, "best_accuracy": 0.8, "best_epoch": 2}
    state.update(epochs_without_gain=0, seconds=12.0)
    key = ("binary", "2-simplicial", seed_1["config"]["learning_rates"][0])
    state_path = synthetic_training.epoch_state_path(tmp_path / "seed-1" / "results.partial.json", key)
    state_path.parent.mkdir()
    no_tensors = {"model": {}, "best_state": {}, "optimizer": {"state": {}, "param_groups": []}}
    save_epoch_state(state_path, {**state, **no_tensors, "generator": torch.zeros(1, dtype=torch.uint8)})
    assert main(["--preset", "tiny", "--seeds", "0", "1", "2", "--output-dir", str(tmp_path), "--report"]) == 0
    table = (tmp_path / "seeds.md").read_text()
    assert table.startswith("**Partial results: 10 of 18 runs finished.**")
    assert "binary 2-simplicial (seeds 1, 2; seed 1 in progress, below)" in table and "binary MHA (seed 2)" in table
    mha_by_epoch_2 = max(100 * point["val_accuracy"] for point in seed_1["runs"][0]["history"][:2])
    assert seed_1["runs"][0]["model"] == "MHA" and seed_1["runs"][0]["task"] == "binary"
    assert f"| binary | 2-simplicial | 1 | 2 | 80.00 (2) | 0 | {mha_by_epoch_2:.2f} |" in table
    assert (tmp_path / "curves.png").is_file()
    # ... and in in_progress.json, with the per-epoch history the curves are drawn from.
    (progress,) = json.loads((tmp_path / "in_progress.json").read_text())
    assert (progress["task"], progress["model"], progress["seed"]) == ("binary", "2-simplicial", 1)
    assert progress["history"] == history and progress["epochs_run"] == 2
    summary = json.loads((tmp_path / "seeds.json").read_text())
    entry = summary["binary/IHA P=2"]
    assert entry["seeds"] == [0, 1] and entry["unfinished_seeds"] == [2]
    paired = entry["paired"]["MHA"]["accuracy"]
    by_seed = [
        {run["model"]: 100 * run["test_accuracy"] for run in results["runs"] if run["task"] == "binary"}
        for results in (tiny_results, seed_1)
    ]
    assert paired["differences"] == pytest.approx([values["IHA P=2"] - values["MHA"] for values in by_seed])
    assert paired["labels"] == [0, 1] and paired["smallest_permutation_p_value"] == 0.5
    exact = entry["paired"]["MHA"]["exact_match"]
    assert exact["n"] == 2 and "exact match" in table and "| binary | IHA P=2 − MHA | accuracy | 2 |" in table
    single = summary["binary/IHA P=2"]["paired"]["2-simplicial"]["accuracy"]  # only seed 0 has both
    assert single["n"] == 1 and single["ci"] is None and single["t_p_value"] is None
    # Runs of other settings are refused rather than summarized under the wrong name.
    assert (
        main(["--preset", "tiny", "--seeds", "0", "1", "--num-train", "8", "--output-dir", str(tmp_path), "--report"])
        == 2
    )
    assert "another configuration" in capsys.readouterr().err
    # Once nothing is training, the report leaves no in_progress.json to disagree with seeds.json.
    state_path.unlink()
    assert main(["--preset", "tiny", "--seeds", "0", "1", "2", "--output-dir", str(tmp_path), "--report"]) == 0
    assert (
        not (tmp_path / "in_progress.json").exists() and "Runs in progress" not in (tmp_path / "seeds.md").read_text()
    )


def test_the_finished_comparison_replaces_a_report_of_runs_in_progress(tmp_path):
    # A --report made while runs were training left in_progress.json and curves of unfinished runs; the call that
    # finishes the comparison leaves neither beside its final tables.
    (tmp_path / "in_progress.json").write_text('[{"task": "binary", "model": "MHA", "seed": 0, "epochs_run": 1}]')
    (tmp_path / "curves.png").write_bytes(b"curves of a run in progress")
    arguments = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--no-simplicial", "--seeds", "0", "1"]
    assert main([*arguments, "--output-dir", str(tmp_path)]) == 0
    assert (
        not (tmp_path / "in_progress.json").exists() and "Runs in progress" not in (tmp_path / "seeds.md").read_text()
    )
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fake_results(seed: int, accuracies: dict[str, float], exact: dict[str, float] | None = None) -> dict:
    """One seed's results of the tiny preset's binary task with the given test accuracy (and exact match) per model."""
    from research.synthetic.config import TINY
    from research.synthetic.train import config_as_saved

    config = config_as_saved(replace(TINY, tasks=["binary"], seed=seed))
    runs = [
        {
            "task": "binary",
            "model": model,
            "learning_rate": config["learning_rates"][0],
            "val_accuracy": accuracy,
            "test_accuracy": accuracy,
            "test_exact_match": (exact or accuracies)[model],
            "test_accuracy_by_m": {"3": accuracy, "4": accuracy},
            "stopped_by": "patience",
            "best_epoch": 1,
            "epochs_run": 1,
            "history": [{"epoch": 1, "train_loss": 0.1, "val_accuracy": accuracy}],
        }
        for model, accuracy in accuracies.items()
    ]
    return {"config": config, "runs": runs}


def test_gaps_are_paired_over_shared_seeds_and_the_paired_table_is_holm_adjusted():
    from research.statistics import holm_adjusted, paired_differences
    from research.synthetic.report import seed_summary

    # 2-simplicial on seed 0 only, and far from its mean over the seeds MHA has: its "− MHA" is seed 0's gap.
    per_seed = [
        fake_results(0, {"MHA": 0.80, "2-simplicial": 0.90, "IHA P=2": 0.82}),
        fake_results(1, {"MHA": 0.60, "IHA P=2": 0.65}),
        fake_results(2, {"MHA": 0.70, "IHA P=2": 0.71}),
    ]
    table, summary = seed_summary(per_seed)
    simplicial_row = next(line for line in table.splitlines() if line.startswith("| binary | 3..4 | 2-simplicial |"))
    assert "| **90.00 (seed 0 only)** |" in simplicial_row and "| +10.00 (seed 0 only) |" in simplicial_row
    assert "±" not in simplicial_row  # the 3-seed mean of MHA (70.00) would have given +20.00
    iha_row = next(line for line in table.splitlines() if line.startswith("| binary | 3..4 | IHA P=2 |"))
    assert iha_row.endswith("| +2.67 (3 seeds) | -8.00 (seed 0 only) |")
    assert "| 90.00 (seed 0 only) |" in table  # exact match and per-m tables alike
    # The paired table is one family: Holm over its tests with a p-value (IHA − MHA on 3 seeds, two metrics).
    iha = summary["binary/IHA P=2"]["paired"]["MHA"]
    raw = [iha["accuracy"]["t_p_value"], iha["exact_match"]["t_p_value"]]
    assert [iha[metric]["t_p_value_holm"] for metric in ("accuracy", "exact_match")] == holm_adjusted(raw)
    assert iha["accuracy"]["holm_family_size"] == 2
    expected = paired_differences([80.0, 60.0, 70.0], [82.0, 65.0, 71.0])
    assert iha["accuracy"]["t_p_value"] == pytest.approx(expected["t_p_value"])
    line = next(line for line in table.splitlines() if line.startswith("| binary | IHA P=2 − MHA | accuracy |"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[6:10] == [
        f"{iha['accuracy']['t_p_value']:.3g}",
        f"{iha['accuracy']['t_p_value_holm']:.3g}",
        f"{iha['accuracy']['permutation_p_value']:.3g}",
        f"{iha['accuracy']['permutation_p_value_holm']:.3g}",
    ]
    assert "over the 2 tests of this table" in table
    one_pair = summary["binary/2-simplicial"]["paired"]["MHA"]["accuracy"]
    assert "t_p_value_holm" not in one_pair  # one seed: no test, so not in the family


def test_a_saturated_per_entry_metric_is_said_to_be_saturated():
    from research.synthetic.report import seed_summary

    saturated, _ = seed_summary([fake_results(0, {"MHA": 0.9984, "2-simplicial": 1.0, "IHA P=2": 0.9991})])
    assert "binary: per-entry test accuracy of every finished run is 99.84-100.00% (all above 99.5%)" in saturated
    assert "is saturated here" in saturated
    spread, _ = seed_summary([fake_results(0, {"MHA": 0.80, "2-simplicial": 1.0, "IHA P=2": 0.9991})])
    assert "binary: per-entry test accuracy of every finished run is 80.00-100.00%." in spread
    assert "saturated" not in spread


def history_of(accuracies: list[float]) -> list[dict]:
    return [{"epoch": epoch, "train_loss": 0.1, "val_accuracy": value} for epoch, value in enumerate(accuracies, 1)]


def test_equal_epochs_say_when_the_stopping_rule_decides_the_order(tmp_path):
    from research.synthetic.outputs import write_seed_summary
    from research.synthetic.summary import best_so_far, equal_epoch_comparison

    assert best_so_far(history_of([0.5, 0.7, 0.6, 0.8])) == [50.0, 70.0, 70.0, 80.0]
    # MHA ahead at every epoch it ran (1-4), then stopped by patience; IHA ran on to 6 and passed it.
    mha = {"model": "MHA", "epochs_run": 4, "stopped_by": "patience", "history": history_of([0.6, 0.7, 0.8, 0.8])}
    iha = {"model": "IHA P=2", "epochs_run": 6, "stopped_by": "epoch budget"}
    iha["history"] = history_of([0.5, 0.6, 0.7, 0.75, 0.85, 0.9])
    comparison = equal_epoch_comparison("binary", 0, mha, iha)
    assert comparison["stretches"] == [(-1, 1, 4)] and comparison["common_epochs"] == 4
    assert comparison["at_common_epoch"] == [80.0, 75.0] and comparison["at_stop"] == [80.0, 90.0]
    assert comparison["decided_by_stopping"]
    # Passing it before MHA stopped: the same order both ways, with both stretches named.
    iha["history"] = history_of([0.5, 0.6, 0.9, 0.9, 0.9, 0.9])
    comparison = equal_epoch_comparison("binary", 0, mha, iha)
    assert comparison["stretches"] == [(-1, 1, 2), (1, 3, 4)] and not comparison["decided_by_stopping"]
    # In the report: the table at equal epochs and the sentence, and the figure.
    per_seed = [fake_results(0, {"MHA": 0.8, "2-simplicial": 0.8, "IHA P=2": 0.9})]
    runs = {run["model"]: run for run in per_seed[0]["runs"]}
    runs["MHA"].update(mha)
    runs["IHA P=2"].update(iha, history=history_of([0.5, 0.6, 0.7, 0.75, 0.85, 0.9]))
    runs["2-simplicial"].update(history=history_of([0.8] * 5), epochs_run=5)
    paths = write_seed_summary(per_seed, tmp_path)
    table = paths["table"].read_text()
    assert "| binary | 0 | IHA P=2 | – | – | – | 4: 75.00 | 90.00 | 6 (the budget) |" in table
    assert (
        "seed 0, IHA P=2 against MHA: best validation accuracy so far MHA above IHA P=2 at every epoch from 1 to 4. "
        "MHA stopped at 4 (patience), where IHA P=2 − MHA was -5.000 points; IHA P=2 ran to 6 (epoch budget), and at "
        "the stopping points the difference is +10.000: the order at the stopping points is not the order at equal "
        "epochs, so the stopping rule decides it." in table
    )
    assert paths["equal_epochs"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
