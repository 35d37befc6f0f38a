"""The relation-composition comparison: data, the one-layer models (MHA vs IHA), training, outputs."""

import copy
import json
import struct
from dataclasses import replace

import pytest
import torch

from iha.synthetic import (
    TINY,
    build_model,
    compose_relation,
    count_parameters,
    main,
    make_composition_data,
    run_comparison,
    write_outputs,
)


def brute_force_composition(relation: torch.Tensor, order: int) -> torch.Tensor:
    m = relation.shape[0]
    result = relation.clone().bool()
    for _ in range(order - 1):
        step = torch.zeros(m, m, dtype=torch.bool)
        for i in range(m):
            for j in range(m):
                step[i, j] = any(bool(result[i, k]) and bool(relation[k, j]) for k in range(m))
        result = step
    return result


@pytest.mark.parametrize("order", [2, 3])
def test_composition_matches_brute_force(order):
    generator = torch.Generator().manual_seed(order)
    for _ in range(5):
        relation = torch.rand(5, 5, generator=generator) < 0.3
        assert torch.equal(compose_relation(relation, order), brute_force_composition(relation, order))


def test_data_is_seeded_and_has_the_expected_label_rate():
    inputs, labels = make_composition_data("binary", 6, 2000, seed=3)
    again_inputs, again_labels = make_composition_data("binary", 6, 2000, seed=3)
    assert torch.equal(inputs, again_inputs) and torch.equal(labels, again_labels)
    assert not torch.equal(inputs, make_composition_data("binary", 6, 2000, seed=4)[0])
    assert inputs.shape == labels.shape == (2000, 36)
    # Row-major flattening: label (i, j) is (R o R)[i, j].
    relation = inputs[0].view(6, 6)
    assert torch.equal(labels[0].view(6, 6).bool(), compose_relation(relation, 2))
    # Density 0.325 makes the labels of R o R nearly balanced at m = 6 (about 51% positive).
    assert inputs.float().mean().item() == pytest.approx(0.325, abs=0.01)
    assert 0.45 < labels.mean().item() < 0.55
    with pytest.raises(ValueError, match="Unknown task"):
        make_composition_data("quaternary", 6, 10, 0)


def test_mha_and_iha_differ_only_in_the_mixing():
    mha = build_model(m=5, hidden_size=32, num_heads=8, num_pseudo_heads=None, seed=0)
    iha_model = build_model(m=5, hidden_size=32, num_heads=8, num_pseudo_heads=4, seed=0)
    mha_state, iha_state = mha.state_dict(), iha_model.state_dict()
    extra = set(iha_state) - set(mha_state)
    assert extra == {f"attention.head_mixing.{name}" for name in ("alpha_q", "alpha_k", "alpha_v", "collapse")}
    for name, value in mha_state.items():
        assert torch.equal(value, iha_state[name]), name  # same embeddings, projections, MLP, readout
    # Overhead: alpha_q, alpha_k, alpha_v [H, H, P] and the per-head collapse [H, P].
    assert count_parameters(iha_model) - count_parameters(mha) == 3 * 8 * 8 * 4 + 8 * 4
    # Trained from scratch, the mixing is random, not identity.
    assert not torch.allclose(iha_model.attention.head_mixing.alpha_q, torch.eye(8)[:, :, None].expand(-1, -1, 4))


@pytest.mark.parametrize("collapse_init", ["last", "mean"])
def test_iha_at_identity_computes_mha(collapse_init):
    # Without a mask, P identical copies of every key leave the softmax unchanged: identity IHA is MHA exactly.
    mha = build_model(m=4, hidden_size=16, num_heads=4, num_pseudo_heads=None, seed=1).double()
    iha_model = build_model(m=4, hidden_size=16, num_heads=4, num_pseudo_heads=3, seed=1).double()
    iha_model.attention.head_mixing.collapse_init = collapse_init
    iha_model.attention.head_mixing.reset_to_identity()
    if collapse_init == "mean":  # the float32 1/3 of the identity tensors is not 1/3 in float64
        iha_model.attention.head_mixing.collapse.data.fill_(1 / 3)
    bits, _ = make_composition_data("binary", 4, 8, seed=0)
    torch.testing.assert_close(iha_model(bits), mha(bits), rtol=0, atol=1e-12)
    # ... and random mixing computes something else.
    randomized = build_model(m=4, hidden_size=16, num_heads=4, num_pseudo_heads=3, seed=1).double()
    assert (randomized(bits) - mha(bits)).abs().max() > 1e-3


def test_model_checks_the_sequence_length():
    model = build_model(m=4, hidden_size=16, num_heads=4, num_pseudo_heads=None, seed=0)
    with pytest.raises(ValueError, match="Expected 16 tokens"):
        model(torch.zeros(2, 9, dtype=torch.long))


@pytest.fixture(scope="module")
def tiny_results():
    torch.manual_seed(0)
    return run_comparison(TINY, progress=False)


def test_tiny_comparison_trains_every_variant(tiny_results):
    runs = tiny_results["runs"]
    assert {(run["task"], run["model"]) for run in runs} == {
        (task, model) for task in ("binary", "ternary") for model in ("MHA", "IHA P=2")
    }
    for run in runs:
        history = run["history"]
        assert history[-1]["train_loss"] < history[0]["train_loss"], run  # it learns
        assert 1 <= run["best_epoch"] <= run["epochs_run"] <= TINY.max_epochs
        assert run["val_accuracy"] == max(point["val_accuracy"] for point in history)
        assert 0.0 <= run["test_exact_match"] <= run["test_accuracy"] <= 1.0
    mha = next(run for run in runs if run["model"] == "MHA")
    iha_run = next(run for run in runs if run["model"] == "IHA P=2")
    assert iha_run["parameters"] - mha["parameters"] == 3 * 4 * 4 * 2 + 4 * 2


def test_outputs_are_written(tiny_results, tmp_path):
    paths = write_outputs(tiny_results, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == 4
    table = paths["table"].read_text()
    assert table.startswith("| Task | m | Model | Parameters | test acc, lr 0.01 |")
    for line in ("| binary | 4 | MHA |", "| binary | 4 | IHA P=2 |", "| ternary | 4 | constant (majority label) |"):
        assert line in table
    png = paths["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 400
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_cli_runs_the_tiny_preset(tmp_path):
    main(["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["tasks"] == ["binary"] and data["config"]["max_epochs"] == 1
    assert {run["model"] for run in data["runs"]} == {"MHA", "IHA P=2"}
    assert (tmp_path / "accuracy.png").is_file() and (tmp_path / "results.md").is_file()


def test_an_interrupted_comparison_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import iha.synthetic as synthetic

    config = replace(TINY, tasks=["binary"], max_epochs=1)
    checkpoint = tmp_path / "results.partial.json"
    real_train_one = synthetic.train_one
    calls = []

    def train_then_fail_on_the_second_run(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the machine went away during the second run
        return real_train_one(*args, **kwargs)

    monkeypatch.setattr(synthetic, "train_one", train_then_fail_on_the_second_run)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(config, progress=False, checkpoint=checkpoint)
    saved = json.loads(checkpoint.read_text())
    assert [run["model"] for run in saved["runs"]] == ["MHA"]

    monkeypatch.setattr(synthetic, "train_one", real_train_one)
    resumed = run_comparison(config, progress=False, checkpoint=checkpoint)
    assert [run["model"] for run in resumed["runs"]] == ["MHA", "IHA P=2"]
    assert resumed["runs"][0] == saved["runs"][0]  # taken over, not retrained
    # A checkpoint of another configuration is refused rather than mixed in.
    with pytest.raises(ValueError, match="different configuration"):
        run_comparison(replace(config, seed=1), progress=False, checkpoint=checkpoint)


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
    assert "| Task | m | Model | seed 0 | seed 1 | mean | std | mean − MHA mean |" in table
    # The same seed twice is bad input: one line, exit 2.
    assert (
        main(["--summarize", str(tmp_path / "r0.json"), str(tmp_path / "r0.json"), "--output-dir", str(tmp_path)]) == 2
    )
    assert capsys.readouterr().err.startswith("iha synthetic: error: Each result must come from a different seed")
    assert (tmp_path / "s" / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_with_several_seeds_runs_each_and_summarizes(tmp_path):
    main(
        [
            "--preset",
            "tiny",
            "--tasks",
            "binary",
            "--max-epochs",
            "1",
            "--seeds",
            "3",
            "5",
            "--output-dir",
            str(tmp_path),
        ]
    )
    per_seed = {seed: json.loads((tmp_path / f"seed-{seed}" / "results.json").read_text()) for seed in (3, 5)}
    assert {seed: results["config"]["seed"] for seed, results in per_seed.items()} == {3: 3, 5: 5}
    # Another seed draws other data and another initialisation, so the measured accuracies differ.
    assert per_seed[3]["runs"][0]["test_accuracy"] != per_seed[5]["runs"][0]["test_accuracy"]
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert summary["binary/MHA"]["seeds"] == [3, 5]
    assert summary["binary/MHA"]["test_accuracy"] == pytest.approx(
        [100 * per_seed[seed]["runs"][0]["test_accuracy"] for seed in (3, 5)]
    )
    assert (tmp_path / "seeds.png").is_file() and "| seed 3 | seed 5 |" in (tmp_path / "seeds.md").read_text()
    with pytest.raises(SystemExit, match="either --seed or --seeds"):
        main(["--preset", "tiny", "--seed", "1", "--seeds", "1", "2", "--output-dir", str(tmp_path)])


def test_a_finished_comparison_is_reused_and_never_overwritten_by_another(tmp_path, monkeypatch):
    import iha.synthetic as synthetic

    arguments = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)]
    main(arguments)
    first = (tmp_path / "results.json").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished comparison must not be trained again")

    monkeypatch.setattr(synthetic, "train_one", no_training)
    main(arguments)  # same configuration: reused
    assert (tmp_path / "results.json").read_text() == first
    with pytest.raises(SystemExit, match="another configuration: pass --fresh"):
        main([*arguments, "--num-train", "256"])
    assert (tmp_path / "results.json").read_text() == first
    with pytest.raises(AssertionError, match="must not be trained again"):
        main([*arguments, "--fresh"])  # --fresh does train again
