"""The relation-composition comparison: data, the one-layer models (MHA, 2-simplicial, IHA), training, outputs."""

import copy
import json
import struct
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from iha.synthetic import (
    PRESETS,
    TINY,
    CompositionData,
    build_model,
    compose_relation,
    count_parameters,
    evaluate,
    make_composition_data,
    masked_loss,
    run_comparison,
    valid_positions,
    write_outputs,
    write_seed_summary,
)
from iha.synthetic.cli import main


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


def test_fixed_m_data_is_seeded_and_has_the_expected_label_rate():
    inputs, labels, sizes = make_composition_data("binary", 6, 2000, seed=3)
    again = make_composition_data("binary", 6, 2000, seed=3)
    assert torch.equal(inputs, again.bits) and torch.equal(labels, again.labels)
    assert not torch.equal(inputs, make_composition_data("binary", 6, 2000, seed=4).bits)
    assert inputs.shape == labels.shape == (2000, 36) and torch.equal(sizes, torch.full((2000,), 6))
    # Row-major flattening: label (i, j) is (R o R)[i, j].
    relation = inputs[0].view(6, 6)
    assert torch.equal(labels[0].view(6, 6).bool(), compose_relation(relation, 2))
    # Density 0.325 makes the labels of R o R nearly balanced at m = 6 (about 51% positive).
    assert inputs.float().mean().item() == pytest.approx(0.325, abs=0.01)
    assert 0.45 < labels.mean().item() < 0.55
    with pytest.raises(ValueError, match="Unknown task"):
        make_composition_data("quaternary", 6, 10, 0)


@pytest.mark.parametrize("task, low, high", [("binary", 6, 10), ("ternary", 5, 8)])
def test_variable_m_data_draws_the_paper_ranges_and_right_pads(task, low, high):
    data = make_composition_data(task, [low, high], 3000, seed=0)
    assert data.bits.shape == data.labels.shape == (3000, high * high)
    # Uniform over the range: every size drawn, each about equally often.
    counts = torch.bincount(data.sizes, minlength=high + 1)[low:]
    assert data.sizes.min() == low and data.sizes.max() == high
    assert counts.min() > 0.8 * 3000 / (high - low + 1)
    order = 2 if task == "binary" else 3
    for index in range(0, 3000, 97):
        m = int(data.sizes[index])
        relation = data.bits[index, : m * m].view(m, m)
        assert torch.equal(data.labels[index, : m * m].view(m, m).bool(), compose_relation(relation, order))
        assert not data.bits[index, m * m :].any() and not data.labels[index, m * m :].any()  # padding
    # The paper's densities balance the labels over the whole range only: the positive rate rises with m.
    rates = [data.labels[data.sizes == m, : m * m].mean().item() for m in range(low, high + 1)]
    assert rates == sorted(rates)
    # Expected positive rates at the ends of the ranges: binary 0.495 (m = 6) to 0.669 (m = 10), ternary 0.357
    # (m = 5) to 0.579 (m = 8).
    ends = {"binary": (0.495, 0.669), "ternary": (0.357, 0.579)}[task]
    assert rates[0] == pytest.approx(ends[0], abs=0.03) and rates[-1] == pytest.approx(ends[1], abs=0.03)
    # A batch is padded to its own largest m only.
    batch = data.subset(torch.nonzero(data.sizes <= low + 1).squeeze(1)[:8])
    assert batch.bits.shape == (8, int(batch.sizes.max()) ** 2)


@pytest.mark.parametrize("attention, num_pseudo_heads", [("mha", None), ("iha", 3), ("simplicial", None)])
def test_padded_batches_compute_what_each_relation_computes_alone(attention, num_pseudo_heads):
    # The key-padding mask (repeated over the P pseudo-tokens for IHA) hides padding from every real position.
    model = build_model(6, 16, 4, num_pseudo_heads, seed=0, attention=attention).double()
    model.eval()
    data = make_composition_data("binary", [3, 6], 12, seed=1)
    batch = data.subset(torch.arange(12))
    logits = model(batch.bits, batch.sizes)
    for index in range(12):
        m = int(batch.sizes[index])
        alone = model(batch.bits[index : index + 1, : m * m])
        torch.testing.assert_close(logits[index, : m * m], alone[0], rtol=0, atol=1e-10)
    # Whatever sits in the padding changes nothing on the real positions.
    noisy_bits = torch.where(valid_positions(batch.sizes, batch.bits.shape[1]), batch.bits, 1)
    is_real = valid_positions(batch.sizes, batch.bits.shape[1])
    torch.testing.assert_close(model(noisy_bits, batch.sizes)[is_real], logits[is_real], rtol=0, atol=1e-10)


def test_loss_and_accuracy_count_real_positions_only():
    data = make_composition_data("ternary", [3, 5], 40, seed=2)
    batch = data.subset(torch.arange(40))
    is_real = valid_positions(batch.sizes, batch.bits.shape[1])
    logits = torch.randn(batch.bits.shape, generator=torch.Generator().manual_seed(0))
    expected = torch.cat(
        [
            F.binary_cross_entropy_with_logits(logits[i, : m * m], batch.labels[i, : m * m], reduction="none")
            for i, m in enumerate(batch.sizes.tolist())
        ]
    ).mean()
    torch.testing.assert_close(masked_loss(logits, batch), expected)
    # Labels and logits in the padding do not count.
    padded_labels = torch.where(is_real, batch.labels, 1.0)
    torch.testing.assert_close(
        masked_loss(torch.where(is_real, logits, 50.0), CompositionData(batch.bits, padded_labels, batch.sizes)),
        expected,
    )
    # Accuracy: per position over real positions, per m, and independent of the evaluation batch size.
    model = build_model(5, 16, 4, 2, seed=0)
    small, large = evaluate(model, data, batch_size=7), evaluate(model, data, batch_size=64)
    assert small["accuracy"] == pytest.approx(large["accuracy"]) and small["loss"] == pytest.approx(large["loss"])
    assert set(small["accuracy_by_m"]) == {"3", "4", "5"}
    positions = {m: int((data.sizes == m).sum()) * m * m for m in (3, 4, 5)}
    weighted = sum(small["accuracy_by_m"][str(m)] * count for m, count in positions.items())
    assert small["accuracy"] == pytest.approx(weighted / sum(positions.values()))
    with torch.no_grad():
        model.eval()
        predictions = (model(data.bits, data.sizes) > 0).float()
    real = valid_positions(data.sizes, data.bits.shape[1])
    manual = (predictions == data.labels)[real].float().mean().item()
    assert small["accuracy"] == pytest.approx(manual)


def test_mha_and_iha_differ_only_in_the_mixing():
    mha = build_model(max_m=5, hidden_size=32, num_heads=8, num_pseudo_heads=None, seed=0)
    iha_model = build_model(max_m=5, hidden_size=32, num_heads=8, num_pseudo_heads=4, seed=0)
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
    mha = build_model(max_m=4, hidden_size=16, num_heads=4, num_pseudo_heads=None, seed=1).double()
    iha_model = build_model(max_m=4, hidden_size=16, num_heads=4, num_pseudo_heads=3, seed=1).double()
    iha_model.attention.head_mixing.collapse_init = collapse_init
    iha_model.attention.head_mixing.reset_to_identity()
    if collapse_init == "mean":  # the float32 1/3 of the identity tensors is not 1/3 in float64
        iha_model.attention.head_mixing.collapse.data.fill_(1 / 3)
    bits, _, sizes = make_composition_data("binary", [2, 4], 8, seed=0)  # padded, so through the mask too
    torch.testing.assert_close(iha_model(bits, sizes), mha(bits, sizes), rtol=0, atol=1e-12)
    # ... and random mixing computes something else.
    randomized = build_model(max_m=4, hidden_size=16, num_heads=4, num_pseudo_heads=3, seed=1).double()
    assert (randomized(bits, sizes) - mha(bits, sizes)).abs().max() > 1e-3


def test_model_checks_the_sequence_length():
    model = build_model(max_m=4, hidden_size=16, num_heads=4, num_pseudo_heads=None, seed=0)
    with pytest.raises(ValueError, match="10 tokens are no m x m relation"):
        model(torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="m = 5 need 25 tokens"):
        model(torch.zeros(2, 25, dtype=torch.long))


@pytest.fixture(scope="module")
def tiny_results():
    torch.manual_seed(0)
    return run_comparison(TINY, progress=False)


def test_tiny_comparison_trains_every_variant(tiny_results):
    runs = tiny_results["runs"]
    assert {(run["task"], run["model"]) for run in runs} == {
        (task, model) for task in ("binary", "ternary") for model in ("MHA", "2-simplicial", "IHA P=2")
    }
    for run in runs:
        history = run["history"]
        assert history[-1]["train_loss"] < history[0]["train_loss"], run  # it learns
        assert 1 <= run["best_epoch"] <= run["epochs_run"] <= TINY.max_epochs
        assert run["val_accuracy"] == max(point["val_accuracy"] for point in history)
        assert 0.0 <= run["test_exact_match"] <= run["test_accuracy"] <= 1.0
        assert set(run["test_accuracy_by_m"]) == {"3", "4"} and run["m"] == [3, 4]
        assert run["stopped_by"] == ("patience" if run["epochs_run"] < TINY.max_epochs else "epoch budget")
    assert tiny_results["device"] == "cpu"
    mha = next(run for run in runs if run["model"] == "MHA")
    iha_run = next(run for run in runs if run["model"] == "IHA P=2")
    assert iha_run["parameters"] - mha["parameters"] == 3 * 4 * 4 * 2 + 4 * 2
    simplicial = next(run for run in runs if run["model"] == "2-simplicial")
    assert simplicial["parameters"] - mha["parameters"] == 2 * 16 * 16


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


def test_cli_runs_the_tiny_preset(tmp_path):
    main(["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["tasks"] == ["binary"] and data["config"]["max_epochs"] == 1
    assert {run["model"] for run in data["runs"]} == {"MHA", "2-simplicial", "IHA P=2"}
    assert (tmp_path / "accuracy.png").is_file() and (tmp_path / "results.md").is_file()


def test_an_interrupted_comparison_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import iha.synthetic.train as synthetic_training

    config = replace(TINY, tasks=["binary"], max_epochs=1)
    checkpoint = tmp_path / "results.partial.json"
    real_train_one = synthetic_training.train_one
    calls = []

    def train_then_fail_on_the_second_run(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the machine went away during the second run
        return real_train_one(*args, **kwargs)

    monkeypatch.setattr(synthetic_training, "train_one", train_then_fail_on_the_second_run)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(config, progress=False, checkpoint=checkpoint)
    saved = json.loads(checkpoint.read_text())
    assert [run["model"] for run in saved["runs"]] == ["MHA"]

    monkeypatch.setattr(synthetic_training, "train_one", real_train_one)
    resumed = run_comparison(config, progress=False, checkpoint=checkpoint)
    assert [run["model"] for run in resumed["runs"]] == ["MHA", "2-simplicial", "IHA P=2"]
    assert resumed["runs"][0] == saved["runs"][0]  # taken over, not retrained
    # A checkpoint of another configuration is refused rather than mixed in.
    with pytest.raises(ValueError, match="different configuration"):
        run_comparison(replace(config, seed=1), progress=False, checkpoint=checkpoint)


def test_a_run_interrupted_between_epochs_continues_to_the_result_of_an_uninterrupted_one(tmp_path, monkeypatch):
    """A run keeps its state after every epoch: killed in its third epoch, the same command continues after the
    second one (not from scratch), and the run ends with the history and test metrics of a run never stopped."""
    import iha.synthetic.train as synthetic_training

    config = replace(TINY, tasks=["binary"], max_epochs=4, patience=10, simplicial=False, pseudo_heads=[])
    uninterrupted = run_comparison(config, progress=False)["runs"][0]
    checkpoint = tmp_path / "results.partial.json"
    real_evaluate = synthetic_training.evaluate
    validations = []

    def evaluate_then_fail_in_the_third_epoch(model, data, batch_size=256):
        validations.append(len(data))
        if len(validations) == 3:
            raise KeyboardInterrupt  # the machine went away in epoch 3, after epoch 2's state was saved
        return real_evaluate(model, data, batch_size)

    monkeypatch.setattr(synthetic_training, "evaluate", evaluate_then_fail_in_the_third_epoch)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(config, progress=False, checkpoint=checkpoint)
    state_file = synthetic_training.epoch_state_path(checkpoint, ("binary", "MHA", config.learning_rates[0]))
    assert len(torch.load(state_file, weights_only=False)["history"]) == 2
    monkeypatch.setattr(synthetic_training, "evaluate", real_evaluate)
    # The report shows the unfinished run as far as it got, beside a finished run of the same seed at the same epoch
    # (here the uninterrupted run itself: by epoch 2 it had what the interrupted one has).
    (in_progress,) = synthetic_training.runs_in_progress(config, checkpoint)
    assert (in_progress["model"], in_progress["epochs_run"], in_progress["seed"]) == ("MHA", 2, config.seed)
    assert in_progress["history"] == uninterrupted["history"][:2]
    best = max(point["val_accuracy"] for point in uninterrupted["history"][:2])
    assert in_progress["val_accuracy"] == best
    finished = {"config": synthetic_training.config_as_saved(config), "runs": [uninterrupted]}
    paths = write_seed_summary([finished], tmp_path / "report", [in_progress])
    table = paths["table"].read_text()
    row = f"| binary | MHA | {config.seed} | 2 | {100 * best:.2f} ({in_progress['best_epoch']}) |"
    assert "**Runs in progress**" in table and row in table and table.rstrip().endswith(f"| {100 * best:.2f} |")
    assert paths["curves"].is_file()
    # Another configuration in the same folder does not continue this run's state.
    with pytest.raises(ValueError, match="unfinished run of another configuration"):
        run_comparison(replace(config, patience=9), progress=False, checkpoint=checkpoint)

    epochs_trained = []
    real_epoch_batches = synthetic_training.epoch_batches
    monkeypatch.setattr(
        synthetic_training,
        "epoch_batches",
        lambda *args, **kwargs: (epochs_trained.append(1), real_epoch_batches(*args, **kwargs))[1],
    )
    resumed = run_comparison(config, progress=False, checkpoint=checkpoint)["runs"][0]
    assert len(epochs_trained) == 2  # epochs 3 and 4 only
    for field in ("history", "best_epoch", "val_accuracy", "test_accuracy", "test_exact_match", "test_loss"):
        assert resumed[field] == uninterrupted[field], field
    assert not state_file.exists()  # the finished run is in the checkpoint; its epoch state is gone


def test_fresh_discards_the_unfinished_runs_states(tmp_path):
    stale = tmp_path / ".epochs" / "results.partial.ternary-MHA-lr0.01.pt"  # a run this call would never finish
    stale.parent.mkdir()
    stale.write_bytes(b"state of an interrupted run")
    argv = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)]
    assert main(argv) == 0 and stale.exists()  # kept for the call that resumes it
    assert main([*argv, "--fresh"]) == 0 and not stale.exists()


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
    assert capsys.readouterr().err.startswith("iha synthetic: error: Each result must come from a different seed")
    # A running call's checkpoint (seed 1 without its 2-simplicial runs yet) summarises over the seeds that have them.
    partial = {"config": other["config"], "runs": [run for run in other["runs"] if run["model"] != "2-simplicial"]}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    main(
        ["--summarize", str(tmp_path / "r0.json"), str(tmp_path / "partial.json"), "--output-dir", str(tmp_path / "p")]
    )
    summary = json.loads((tmp_path / "p" / "seeds.json").read_text())
    assert summary["binary/2-simplicial"]["seeds"] == [0] and summary["binary/IHA P=2"]["seeds"] == [0, 1]
    assert "(1 of 2 seeds)" in (tmp_path / "p" / "seeds.md").read_text()
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
    import iha.synthetic.train as synthetic_training

    arguments = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)]
    main(arguments)
    first = (tmp_path / "results.json").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished comparison must not be trained again")

    monkeypatch.setattr(synthetic_training, "train_one", no_training)
    main(arguments)  # same configuration: reused
    assert (tmp_path / "results.json").read_text() == first
    with pytest.raises(SystemExit, match="another configuration: pass --fresh"):
        main([*arguments, "--num-train", "128"])
    assert (tmp_path / "results.json").read_text() == first
    with pytest.raises(AssertionError, match="must not be trained again"):
        main([*arguments, "--fresh"])  # --fresh does train again


def test_presets_and_size_ranges_on_the_command_line(tmp_path, capsys):
    paper, cpu = PRESETS["paper"], PRESETS["cpu"]
    # The paper's stated scale.
    assert (paper.hidden_size, paper.num_heads, paper.num_train, paper.num_val, paper.num_test) == (
        128,
        8,
        40_000,
        5_000,
        5_000,
    )
    assert 8 in paper.pseudo_heads and paper.patience == 10 and paper.learning_rates == [1e-3, 1e-4]
    assert paper.m == {"binary": [6, 10], "ternary": [5, 8]}
    # The CPU preset runs the same comparison (models, tasks, ranges, heads, patience) smaller.
    assert (cpu.m, cpu.num_heads, cpu.pseudo_heads, cpu.simplicial, cpu.patience) == (
        paper.m,
        paper.num_heads,
        paper.pseudo_heads,
        True,
        10,
    )
    main(
        ["--preset", "tiny", "--tasks", "ternary", "--m", "ternary=5", "--max-epochs", "1", "--no-simplicial"]
        + [
            "--output-dir",
            str(tmp_path),
        ]
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["m"] == {"binary": [3, 4], "ternary": [5, 5]} and data["config"]["simplicial"] is False
    assert {run["model"] for run in data["runs"]} == {"MHA", "IHA P=2"}
    assert set(data["runs"][0]["test_accuracy_by_m"]) == {"5"}
    with pytest.raises(SystemExit, match="TASK=SIZE or TASK=LOW-HIGH"):
        main(["--preset", "tiny", "--m", "binary=6..10", "--output-dir", str(tmp_path / "other")])
    # Bad input: one line, exit 2.
    assert main(["--preset", "tiny", "--m", "binary=9-6", "--output-dir", str(tmp_path / "other")]) == 2
    assert "2 <= low <= high" in capsys.readouterr().err


def test_several_seeds_train_the_cheap_models_first_and_resume_after_an_interruption(tmp_path, monkeypatch):
    import iha.synthetic.train as synthetic_training

    arguments = ["--preset", "tiny", "--max-epochs", "1", "--seeds", "0", "1", "--output-dir", str(tmp_path)]
    real_train_one = synthetic_training.train_one
    order = []

    def record(model, data, learning_rate, config, description="", resume_path=None):
        order.append((config.seed, description.split(" lr=")[0]))
        if len(order) == 10:
            raise KeyboardInterrupt  # the machine went away in the second costly run
        return real_train_one(model, data, learning_rate, config, description, resume_path)

    monkeypatch.setattr(synthetic_training, "train_one", record)
    assert main(arguments) == 130  # Ctrl-C: one line, the conventional exit status
    # MHA and IHA P=2 of both tasks for every seed before any 2-simplicial run.
    cheap = [f"{task} m=3..4 {model}" for task in ("binary", "ternary") for model in ("MHA", "IHA P=2")]
    assert order[:8] == [(seed, name) for seed in (0, 1) for name in cheap]
    assert order[8:] == [(0, "binary m=3..4 2-simplicial"), (1, "binary m=3..4 2-simplicial")]
    saved = json.loads((tmp_path / "seed-0" / "results.partial.json").read_text())
    assert len(saved["runs"]) == 5 and not (tmp_path / "seed-0" / "results.json").exists()

    order.clear()
    monkeypatch.setattr(
        synthetic_training,
        "train_one",
        lambda *args, **kwargs: (order.append(args[3].seed), real_train_one(*args, **kwargs))[1],
    )
    main(arguments)  # the same command resumes: 4 runs of seed 0 and 1 of seed 1 are not trained again
    assert sorted(order) == [0, 1, 1]  # seed 0's ternary 2-simplicial, seed 1's two
    for seed in (0, 1):
        results = json.loads((tmp_path / f"seed-{seed}" / "results.json").read_text())
        assert len(results["runs"]) == 6 and not (tmp_path / f"seed-{seed}" / "results.partial.json").exists()
    assert (tmp_path / "seeds.md").is_file()


@pytest.mark.parametrize("group_by_m", [True, False])
def test_epoch_batches_cover_every_example_once_and_group_by_m(group_by_m):
    from iha.synthetic import epoch_batches

    data = make_composition_data("binary", [3, 6], 203, seed=5)
    batches = epoch_batches(data.sizes, 16, torch.Generator().manual_seed(0), group_by_m)
    assert sorted(torch.cat(batches).tolist()) == list(range(203))
    assert all(len(batch) <= 16 for batch in batches)
    sizes_per_batch = [set(data.sizes[batch].tolist()) for batch in batches]
    if group_by_m:
        assert all(len(sizes) == 1 for sizes in sizes_per_batch)  # nothing is padded
        # Batches of different m are interleaved, not one m after another.
        firsts = [min(sizes) for sizes in sizes_per_batch]
        assert firsts != sorted(firsts)
    else:
        # The order the results written before grouping were trained in: slices of one permutation.
        expected = torch.randperm(203, generator=torch.Generator().manual_seed(0)).split(16)
        assert all(torch.equal(a, b) for a, b in zip(batches, expected))
        assert any(len(sizes) > 1 for sizes in sizes_per_batch)


def test_grouped_batches_train_on_the_loss_of_each_relation_alone():
    # A grouped batch is unpadded, and its loss is the mean over its relations computed one at a time.
    from iha.synthetic import epoch_batches

    model = build_model(5, 16, 4, 2, seed=0).double()
    data = make_composition_data("ternary", [3, 5], 40, seed=2)
    for index in epoch_batches(data.sizes, 8, torch.Generator().manual_seed(1)):
        bits, labels, sizes = data.subset(index)
        batch = CompositionData(bits, labels.double(), sizes)
        m = int(batch.sizes[0])
        assert batch.bits.shape == (len(index), m * m)
        alone = [
            F.binary_cross_entropy_with_logits(model(batch.bits[i : i + 1])[0], batch.labels[i])
            for i in range(len(index))
        ]
        torch.testing.assert_close(
            masked_loss(model(batch.bits, batch.sizes), batch), torch.stack(alone).mean(), rtol=0, atol=1e-12
        )


def test_two_processes_share_a_comparison_run_by_run(tmp_path, monkeypatch):
    # Another process holding a run's claim: this one skips it while ordering the work, and when finishing takes
    # the result the other process wrote instead of training it again.
    from filelock import FileLock

    import iha.synthetic.train as synthetic_training
    from iha.synthetic.cli import _train_cheap_models_first
    from iha.synthetic.train import lock_path, save_run

    config = replace(TINY, tasks=["binary"], max_epochs=1, simplicial=False)
    checkpoint = tmp_path / "seed-0" / "results.partial.json"
    claim_file = lock_path(checkpoint, "binary-IHAP2-lr0.01")
    claim_file.parent.mkdir(parents=True)
    trained = []
    real_train_one = synthetic_training.train_one

    def record(*args, **kwargs):
        trained.append(args[4])
        return real_train_one(*args, **kwargs)

    monkeypatch.setattr(synthetic_training, "train_one", record)
    other_process = FileLock(claim_file, timeout=0)
    other_process.acquire()
    _train_cheap_models_first(config, [0], tmp_path, "cpu")
    assert trained == ["binary m=3..4 MHA lr=0.01"]
    # The other process finishes its run and lets go; this process's call then reuses it.
    their_run = run_comparison(config, progress=False, only={("binary", "IHA P=2")})["runs"][0]
    their_run["test_accuracy"] = 0.123  # a mark: the result is the one the other process wrote
    save_run(checkpoint, config, their_run)
    other_process.release()
    trained.clear()
    main(
        ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--no-simplicial", "--seeds", "0", "1"]
        + ["--output-dir", str(tmp_path)]
    )
    results = json.loads((tmp_path / "seed-0" / "results.json").read_text())
    assert {run["model"]: run["test_accuracy"] for run in results["runs"]}["IHA P=2"] == 0.123
    assert trained == ["binary m=3..4 MHA lr=0.01", "binary m=3..4 IHA P=2 lr=0.01"]  # seed 1's, not seed 0's


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
    import iha.synthetic.train as synthetic_training

    history = [
        {"epoch": 1, "train_loss": 0.5, "val_accuracy": 0.75},
        {"epoch": 2, "train_loss": 0.4, "val_accuracy": 0.8},
    ]
    state = {"config": seed_1["config"], "history": history, "best_accuracy": 0.8, "best_epoch": 2}
    state.update(epochs_without_gain=0, seconds=12.0)
    key = ("binary", "2-simplicial", seed_1["config"]["learning_rates"][0])
    state_path = synthetic_training.epoch_state_path(tmp_path / "seed-1" / "results.partial.json", key)
    state_path.parent.mkdir()
    torch.save(state, state_path)
    assert main(["--preset", "tiny", "--seeds", "0", "1", "2", "--output-dir", str(tmp_path), "--report"]) == 0
    table = (tmp_path / "seeds.md").read_text()
    assert table.startswith("**Partial results: 10 of 18 runs finished.**")
    assert "binary 2-simplicial (seeds 1, 2; seed 1 in progress, below)" in table and "binary MHA (seed 2)" in table
    mha_by_epoch_2 = max(100 * point["val_accuracy"] for point in seed_1["runs"][0]["history"][:2])
    assert seed_1["runs"][0]["model"] == "MHA" and seed_1["runs"][0]["task"] == "binary"
    assert f"| binary | 2-simplicial | 1 | 2 | 80.00 (2) | 0 | {mha_by_epoch_2:.2f} |" in table
    assert (tmp_path / "curves.png").is_file()
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
