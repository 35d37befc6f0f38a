"""Per-relation tests from a finished comparison's saved weights: the rebuilt models give the recorded results
exactly, McNemar counts the relations only one model got right, runs without weights are named, and the report
holds the tables."""

import json
from dataclasses import replace

import pytest

from research.statistics import holm_adjusted, mcnemar_exact
from research.synthetic import run_comparison
from research.synthetic.cli import main
from research.synthetic.config import TINY
from research.synthetic.relations import (
    exact_match_per_relation,
    load_run_model,
    relation_tests,
    seen_in,
)
from research.synthetic.summary import NO_WEIGHTS
from research.synthetic.train import comparison_data, evaluate


CONFIG = replace(TINY, tasks=["binary"], max_epochs=3, patience=10)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Two seeds of the tiny binary comparison, finished with their best weights, as `python -m research.synthetic --seeds 0 1`
    leaves them."""
    folder = tmp_path_factory.mktemp("relations")
    per_seed = []
    for seed in (0, 1):
        seed_dir = folder / f"seed-{seed}"
        config = replace(CONFIG, seed=seed)
        per_seed.append(run_comparison(config, progress=False, checkpoint=seed_dir / "results.partial.json"))
    return folder, per_seed


def test_saved_weights_rebuild_the_run_and_its_test_split_exactly(finished):
    folder, per_seed = finished
    for seed, results in zip((0, 1), per_seed):
        test = comparison_data(replace(CONFIG, seed=seed), "binary")["test"]
        for run in results["runs"]:
            exact = exact_match_per_relation(run, folder / f"seed-{seed}", test, CONFIG.batch_size)
            # Exactly the recorded exact match (float32 mean of the same booleans), not approximately.
            assert exact.float().mean().item() == run["test_exact_match"], (seed, run["model"])
            model, description = load_run_model(folder / f"seed-{seed}" / run["weights"])
            assert evaluate(model, test, CONFIG.batch_size)["accuracy"] == run["test_accuracy"]
            assert (description["seed"], description["model"]) == (seed, run["model"])


def test_mcnemar_counts_the_relations_only_one_model_got_right(finished):
    folder, per_seed = finished
    tests = relation_tests(per_seed, [folder / "seed-0", folder / "seed-1"], "cpu")
    for seed, results, seed_tests in zip((0, 1), per_seed, tests["seeds"]):
        test = comparison_data(replace(CONFIG, seed=seed), "binary")["test"]
        exact = {
            run["model"]: exact_match_per_relation(run, folder / f"seed-{seed}", test, CONFIG.batch_size).tolist()
            for run in results["runs"]
        }
        pairs = seed_tests["tasks"]["binary"]["pairs"]
        assert [pair["models"] for pair in pairs] == [
            ["MHA", "2-simplicial"],
            ["MHA", "IHA P=2"],
            ["2-simplicial", "IHA P=2"],
        ]
        for pair in pairs:
            a, b = (exact[model] for model in pair["models"])
            only_a = sum(1 for index in range(len(a)) if a[index] and not b[index])
            only_b = sum(1 for index in range(len(a)) if b[index] and not a[index])
            assert (pair["only_a_right"], pair["only_b_right"]) == (only_a, only_b)
            assert pair["p_value"] == mcnemar_exact(only_a, only_b)
        # Seen and unseen relations split the test set, and their exact matches average back to the whole.
        in_train = seen_in(test, comparison_data(replace(CONFIG, seed=seed), "binary")["train"])
        for model, run in seed_tests["tasks"]["binary"]["runs"].items():
            assert run["seen"]["relations"] == int(in_train.sum())
            assert run["seen"]["relations"] + run["unseen"]["relations"] == len(test)
            right = sum(exact[model])
            parts = [run[part]["exact_match"] * run[part]["relations"] for part in ("seen", "unseen")]
            assert sum(part for part in parts if part) == pytest.approx(right)
    every_pair = [pair for seed in tests["seeds"] for pair in seed["tasks"]["binary"]["pairs"]]
    assert tests["mcnemar_tests"] == 6
    assert [pair["p_value_holm"] for pair in every_pair] == holm_adjusted([pair["p_value"] for pair in every_pair])


def test_mcnemar_by_hand_on_a_tiny_example():
    # Five relations: A alone right on 1 and 3, B alone on 4, both on 0, neither on 2.
    from research.statistics import discordant_counts

    a = [True, True, False, True, False]
    b = [True, False, False, False, True]
    assert discordant_counts(a, b) == (2, 1)
    # Two-sided exact: P(X <= 1) + P(X >= 2) for X ~ Binomial(3, 1/2) = 1 (the discordant pairs split 2 : 1).
    assert mcnemar_exact(2, 1) == 1.0
    # 8 : 0 discordant pairs: 2 / 2^8.
    assert mcnemar_exact(8, 0) == pytest.approx(2 / 256)


def test_runs_without_weights_are_named_and_the_report_holds_the_tables(finished, tmp_path):
    folder, per_seed = finished
    # Seed 1 as the runs finished before weights were saved left it: no weights for MHA.
    for seed, results in zip((0, 1), per_seed):
        seed_dir = tmp_path / f"seed-{seed}"
        seed_dir.mkdir()
        runs = [dict(run) for run in results["runs"]]
        if seed == 1:
            runs[0].pop("weights")
            assert runs[0]["model"] == "MHA"
        (seed_dir / "weights").symlink_to(folder / f"seed-{seed}" / "weights")
        (seed_dir / "results.partial.json").write_text(json.dumps({"config": results["config"], "runs": runs}))
    arguments = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "3", "--patience", "10", "--seeds", "0", "1"]
    assert main([*arguments, "--output-dir", str(tmp_path), "--report"]) == 0
    table = (tmp_path / "seeds.md").read_text()
    relations = json.loads((tmp_path / "relations.json").read_text())
    assert relations["mcnemar_tests"] == 4  # seed 0's three pairs and seed 1's 2-simplicial − IHA P=2
    assert f"| binary | 1 | MHA | {NO_WEIGHTS} | – | – |" in table
    assert f"| binary | 1 | MHA | 2-simplicial | {NO_WEIGHTS}: MHA | – | – | – |" in table
    assert "Holm's adjustment over the 4 tests of this table" in table
    assert "**Data, binary** (independent data streams)" in table
