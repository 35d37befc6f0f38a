"""Training the relation-composition comparison: every variant learns; presets and the command line; runs resumed
after an interruption, between runs and between epochs; several seeds; two processes sharing a comparison."""

import json
from dataclasses import replace

import pytest
from safetensors import safe_open

from research.synthetic import PRESET_SEEDS, PRESETS, run_comparison, write_seed_summary
from research.synthetic.checkpoints import runs_in_progress
from research.synthetic.cli import main
from research.synthetic.config import TINY
from research.synthetic.models import build_model
from research.synthetic.states import load_epoch_state, load_run_weights
from research.synthetic.task import make_composition_data, split_seeds


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


def test_cli_runs_the_tiny_preset(tmp_path):
    main(["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["tasks"] == ["binary"] and data["config"]["max_epochs"] == 1
    assert {run["model"] for run in data["runs"]} == {"MHA", "2-simplicial", "IHA P=2"}
    assert (tmp_path / "accuracy.png").is_file() and (tmp_path / "results.md").is_file()


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
    # The affordable part of it: ternary at m = 5 with the paper's data, width and heads, P = 2 and the paper's P = H,
    # lr 1e-3, patience 10, three seeds (2-simplicial trained last).
    ternary = PRESETS["paper-ternary"]
    assert (ternary.tasks, ternary.m, ternary.learning_rates, ternary.patience) == (
        ["ternary"],
        {"ternary": [5, 5]},
        [1e-3],
        10,
    )
    assert (ternary.num_train, ternary.num_val, ternary.num_test, ternary.hidden_size, ternary.num_heads) == (
        40_000,
        5_000,
        5_000,
        128,
        8,
    )
    assert sorted(ternary.pseudo_heads) == [2, 8] and ternary.simplicial and PRESET_SEEDS["paper-ternary"] == [0, 1, 2]
    assert (ternary.batch_size, ternary.max_epochs) == (128, 100)
    # The paper's own regime for a GPU: its m distributions, data, both rates, MHA / IHA P = 8 / 2-simplicial,
    # independent data streams, capped at 10 epochs.
    regime = PRESETS["paper-regime"]
    assert (regime.tasks, regime.m, regime.learning_rates) == (
        ["binary", "ternary"],
        {"binary": [6, 10], "ternary": [5, 8]},
        [1e-3, 1e-4],
    )
    assert (regime.num_train, regime.num_val, regime.num_test, regime.hidden_size, regime.num_heads) == (
        40_000,
        5_000,
        5_000,
        128,
        8,
    )
    assert (regime.pseudo_heads, regime.simplicial, regime.data_streams, regime.patience) == (
        [8],
        True,
        "independent",
        10,
    )
    assert regime.max_epochs == 10 and PRESET_SEEDS["paper-regime"] == [0, 1, 2]
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


def test_an_interrupted_comparison_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import research.synthetic.train as synthetic_training

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
    import research.synthetic.train as synthetic_training

    config = replace(TINY, tasks=["binary"], max_epochs=4, patience=10, simplicial=False, pseudo_heads=[])
    uninterrupted = run_comparison(config, progress=False)["runs"][0]
    checkpoint = tmp_path / "results.partial.json"
    real_epoch_batches = synthetic_training.epoch_batches
    epochs_started = []

    def batches_then_fail_in_the_third_epoch(*args, **kwargs):
        epochs_started.append(1)
        if len(epochs_started) == 3:
            raise KeyboardInterrupt  # the machine went away in epoch 3, after epoch 2's state was saved
        return real_epoch_batches(*args, **kwargs)

    monkeypatch.setattr(synthetic_training, "epoch_batches", batches_then_fail_in_the_third_epoch)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(config, progress=False, checkpoint=checkpoint)
    state_file = synthetic_training.epoch_state_path(checkpoint, ("binary", "MHA", config.learning_rates[0]))
    assert len(load_epoch_state(state_file, with_tensors=False)["history"]) == 2
    monkeypatch.setattr(synthetic_training, "epoch_batches", real_epoch_batches)
    # The report shows the unfinished run as far as it got, beside a finished run of the same seed at the same epoch
    # (here the uninterrupted run itself: by epoch 2 it had what the interrupted one has).
    (in_progress,) = runs_in_progress(config, checkpoint)
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
    stale = tmp_path / ".epochs" / "results.partial.ternary-MHA-lr0.01.safetensors"  # a run this call never finishes
    stale.parent.mkdir()
    stale.write_bytes(b"state of an interrupted run")
    argv = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)]
    assert main(argv) == 0 and stale.exists()  # kept for the call that resumes it
    assert main([*argv, "--fresh"]) == 0 and not stale.exists()


def test_a_pickled_epoch_state_is_refused_not_unpickled(tmp_path, capsys):
    """States of older releases were pickles: a file from a checkout must never run code when a run resumes."""
    pickled = tmp_path / ".epochs" / "results.partial.binary-MHA-lr0.01.pt"
    pickled.parent.mkdir()
    pickled.write_bytes(b"not to be unpickled")
    argv = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "old pickle format, which is never unpickled" in error and str(pickled) in error
    assert not (tmp_path / "results.json").exists()


def test_finished_runs_save_their_best_weights_and_epoch_states_are_no_pickles(tmp_path, monkeypatch):
    """Every finished run's best weights are a safetensors file named in its result: rebuilt from them, the model
    gives the run's test metrics again; epoch states hold tensors and JSON only, and resume bit for bit."""
    import research.synthetic.train as synthetic_training

    config = replace(TINY, tasks=["binary"], max_epochs=3, patience=10)
    results = run_comparison(config, progress=False, checkpoint=tmp_path / "results.partial.json")
    data = make_composition_data(
        "binary",
        config.m["binary"],
        config.num_test,
        split_seeds(config.seed, "binary", 0, config.data_streams)["test"],
    )
    for run in results["runs"]:
        state_dict, description = load_run_weights(tmp_path / run["weights"])
        assert (description["model"], description["best_epoch"]) == (run["model"], run["best_epoch"])
        model = build_model(
            description["max_m"],
            description["hidden_size"],
            description["num_heads"],
            description["num_pseudo_heads"],
            0,
            description["attention"],
        )
        model.load_state_dict(state_dict)
        metrics = synthetic_training.evaluate(model, data, config.batch_size)
        assert metrics["accuracy"] == pytest.approx(run["test_accuracy"], abs=1e-6)
        assert metrics["exact_match"] == pytest.approx(run["test_exact_match"], abs=1e-6)
        # The epoch that set the best validation accuracy recorded that model's test metrics too.
        best = next(point for point in run["history"] if point["epoch"] == run["best_epoch"])
        assert best["test_accuracy"] == pytest.approx(run["test_accuracy"], abs=1e-6)
    with safe_open(str(tmp_path / results["runs"][0]["weights"]), framework="pt") as handle:
        assert json.loads(handle.metadata()["state"])["format"] == "iha-synthetic-run-weights/1"


def test_a_finished_comparison_is_reused_and_never_overwritten_by_another(tmp_path, monkeypatch):
    import research.synthetic.train as synthetic_training

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


def test_several_seeds_train_the_cheap_models_first_and_resume_after_an_interruption(tmp_path, monkeypatch):
    import research.synthetic.train as synthetic_training

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


def test_two_processes_share_a_comparison_run_by_run(tmp_path, monkeypatch):
    # Another process holding a run's claim: this one skips it while ordering the work, and when finishing takes
    # the result the other process wrote instead of training it again.
    from filelock import FileLock

    import research.synthetic.train as synthetic_training
    from research.synthetic.checkpoints import lock_path, save_run
    from research.synthetic.experiment import train_cheap_models_first

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
    train_cheap_models_first(config, [0], tmp_path, "cpu")
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


# The paper-regime preset shrunk to seconds as the GPU check's quick run shrinks it (scripts/gpu_check_steps.py), on
# the binary task: MHA, IHA P = 8 and 2-simplicial at both of the preset's learning rates, two epochs each.
PAPER_REGIME_SHRUNK = ["--preset", "paper-regime", "--seeds", "0", "--tasks", "binary", "--max-epochs", "2"]
PAPER_REGIME_SHRUNK += ["--m", "binary=3-4", "ternary=3-4", "--num-train", "64", "--num-val", "32", "--num-test", "32"]
PAPER_REGIME_SHRUNK += ["--hidden-size", "16", "--num-heads", "4", "--batch-size", "32", "--device", "cpu"]


def test_the_paper_regime_command_on_a_cpu_resumes_to_the_result_of_an_uninterrupted_run(tmp_path, monkeypatch):
    """The paper-regime command runs on a CPU as on a GPU; killed in the middle of its fourth run, the same command
    continues from the last finished epoch and ends with the results of a call never stopped."""
    import research.synthetic.train as synthetic_training

    assert main(PAPER_REGIME_SHRUNK + ["--output-dir", str(tmp_path / "uninterrupted")]) == 0
    uninterrupted = json.loads((tmp_path / "uninterrupted" / "results.json").read_text())
    assert uninterrupted["device"] == "cpu" and uninterrupted["config"]["learning_rates"] == [1e-3, 1e-4]
    assert [(run["model"], run["learning_rate"]) for run in uninterrupted["runs"]] == [
        (model, rate) for model in ("MHA", "2-simplicial", "IHA P=8") for rate in (1e-3, 1e-4)
    ]

    real_epoch_batches = synthetic_training.epoch_batches
    epochs_started = []

    def batches_then_fail_in_the_eighth_epoch(*args, **kwargs):
        epochs_started.append(1)
        if len(epochs_started) == 8:  # runs 1-3 finished, run 4 (2-simplicial, lr 1e-4) in its second epoch
            raise KeyboardInterrupt
        return real_epoch_batches(*args, **kwargs)

    interrupted = PAPER_REGIME_SHRUNK + ["--output-dir", str(tmp_path / "interrupted")]
    monkeypatch.setattr(synthetic_training, "epoch_batches", batches_then_fail_in_the_eighth_epoch)
    assert main(interrupted) == 130
    assert not (tmp_path / "interrupted" / "results.json").exists()

    epochs_trained = []
    monkeypatch.setattr(
        synthetic_training,
        "epoch_batches",
        lambda *args, **kwargs: (epochs_trained.append(1), real_epoch_batches(*args, **kwargs))[1],
    )
    assert main(interrupted) == 0
    assert len(epochs_trained) == 12 - 7  # the fourth run's second epoch and the two runs after it
    resumed = json.loads((tmp_path / "interrupted" / "results.json").read_text())
    fields = ("task", "model", "learning_rate", "history", "best_epoch", "stopped_by", "val_accuracy")
    fields += ("test_accuracy", "test_exact_match", "test_loss", "test_accuracy_by_m")
    for run, reference in zip(resumed["runs"], uninterrupted["runs"], strict=True):
        assert {field: run[field] for field in fields} == {field: reference[field] for field in fields}
