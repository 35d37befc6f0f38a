"""The paper's polynomial-filter claim: ceil(sqrt(k)) IHA heads with P = H compute [X, AX, ..., A^(k-1) X], which
MHA with position-only patterns needs k heads for (hand-set weights, float64, k = 4, 9, 16 and orders in between),
and the trained comparison's outputs (k = 4 and k = 9)."""

import json
import math
import shlex
from dataclasses import asdict

import pytest
import torch
from testing_utils import REPO_ROOT

from iha.cli.arguments import dataclass_values
from research.polynomial_filter.cli import main as polynomial_filter_main
from research.polynomial_filter.cli import make_parser, reproducing_command
from research.polynomial_filter.config import PolynomialConfig, task_adjacency
from research.polynomial_filter.constructions import (
    filter_target,
    hand_set_iha_filter,
    hand_set_mha_filter,
    iha_heads_for_order,
    kronecker_rank,
    mha_error_floor,
)
from research.polynomial_filter.experiment import run_experiment
from research.polynomial_filter.report import render_markdown
from research.polynomial_filter.runs import train_filter
from research.polynomial_filter.summary import summarize


# These layers are tiny: one torch thread (conftest.py's `one_torch_thread`).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cycle(num_tokens: int) -> torch.Tensor:
    """The directed cycle n -> n + 1: A^j X shifts the features by j tokens."""
    return torch.roll(torch.eye(num_tokens, dtype=torch.float64), 1, dims=1)


def gaussian_graph(num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    adjacency = torch.randn(num_tokens, num_tokens, generator=generator, dtype=torch.float64)
    return adjacency / torch.linalg.matrix_norm(adjacency, ord=2)


def rotation(num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """A random rotation: every power has the norm of I (a Gaussian graph's high powers fade)."""
    weights = torch.randn(num_tokens, num_tokens, generator=generator, dtype=torch.float64)
    return torch.linalg.qr(weights)[0]


def projection_parameters(layer) -> int:
    return sum(parameter.numel() for name, parameter in layer.named_parameters() if "proj" in name)


def test_iha_heads_for_order_is_the_ceiling_of_the_square_root():
    assert [iha_heads_for_order(order) for order in (1, 2, 4, 5, 9, 10, 16, 17)] == [1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="order must be >= 1"):
        iha_heads_for_order(0)


@pytest.mark.parametrize("heads", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_h_iha_heads_compute_the_order_h_squared_filter_exactly_with_linear_attention(heads, seed):
    order = heads * heads
    generator = torch.Generator().manual_seed(seed)
    num_tokens, feature_size = order + 1, 2
    adjacency = gaussian_graph(num_tokens, generator)
    features = torch.randn(7, num_tokens, feature_size, generator=generator, dtype=torch.float64)
    target = filter_target(adjacency, features, order)
    assert target.shape == (7, num_tokens, order * feature_size)
    torch.testing.assert_close(
        target[..., (order - 1) * feature_size :], torch.linalg.matrix_power(adjacency, order - 1) @ features
    )
    head_dim = max(num_tokens, heads * feature_size)
    iha = hand_set_iha_filter(adjacency, feature_size, head_dim, order=order)
    assert (iha.num_heads, iha.head_mixing.num_pseudo_heads) == (heads, heads)
    torch.testing.assert_close(iha(features), target, rtol=0, atol=1e-12)
    # The k-head MHA layer computes the same; the H-head IHA layer does it with 1/H of its projections.
    mha = hand_set_mha_filter(adjacency, feature_size, head_dim, order=order)
    assert mha.num_heads == order
    torch.testing.assert_close(mha(features), target, rtol=0, atol=1e-12)
    assert heads * projection_parameters(iha) == projection_parameters(mha)


@pytest.mark.parametrize("order", [2, 3, 5, 7, 10])
def test_orders_between_squares_take_the_ceiling_of_the_square_root_heads(order):
    generator = torch.Generator().manual_seed(order)
    num_tokens, feature_size = order + 1, 3
    adjacency = gaussian_graph(num_tokens, generator)
    features = torch.randn(5, num_tokens, feature_size, generator=generator, dtype=torch.float64)
    heads = math.ceil(math.sqrt(order))
    iha = hand_set_iha_filter(adjacency, feature_size, max(num_tokens, heads * feature_size), order=order)
    assert iha.num_heads == heads
    torch.testing.assert_close(iha(features), filter_target(adjacency, features, order), rtol=0, atol=1e-12)


@pytest.mark.parametrize("heads", [2, 3, 4])
def test_the_softmax_form_is_exact_up_to_e_to_the_minus_beta_and_hard_attention_exactly_on_a_permutation(heads):
    order = heads * heads
    num_tokens, feature_size = order + 2, 3
    adjacency = cycle(num_tokens)
    generator = torch.Generator().manual_seed(heads)
    features = torch.randn(4, num_tokens, feature_size, generator=generator, dtype=torch.float64)
    target = filter_target(adjacency, features, order)
    torch.testing.assert_close(target[..., feature_size : 2 * feature_size], features.roll(-1, dims=1))
    head_dim = max(num_tokens, heads * feature_size)
    errors = {}
    for beta in (4.0, 60.0):
        layer = hand_set_iha_filter(adjacency, feature_size, head_dim, attention="softmax", beta=beta, order=order)
        assert layer.attention == "softmax"
        errors[beta] = (layer(features) - target).abs().max().item()
    assert errors[60.0] < 1e-12 < 1e-3 < errors[4.0]  # the construction needs sharp patterns, and gets them
    hard = hand_set_iha_filter(adjacency, feature_size, head_dim, attention="hard", order=order)
    torch.testing.assert_close(hard(features), target, rtol=0, atol=1e-12)
    for attention in ("softmax", "hard"):
        mha = hand_set_mha_filter(adjacency, feature_size, head_dim, attention=attention, order=order)
        torch.testing.assert_close(mha(features), target, rtol=0, atol=1e-12)


def test_the_construction_refuses_a_head_dim_too_small_for_its_streams():
    with pytest.raises(ValueError, match=r"head_dim must be >= max\(N, H d_x\) = 9 for order 9"):
        hand_set_iha_filter(cycle(4), 3, 8, order=9)


@pytest.mark.parametrize("heads", [2, 3, 4])
def test_fewer_than_k_mha_heads_with_position_only_patterns_cannot_compute_the_filter(heads):
    # The filter's Kronecker rank is k (for a generic A and N >= k): no sum of fewer than k Kronecker products (MHA
    # heads whose patterns read positions only) reaches it; ceil(sqrt(k)) such heads stay far from it.
    order = heads * heads
    generator = torch.Generator().manual_seed(heads)
    num_tokens = order + 1
    assert kronecker_rank(gaussian_graph(num_tokens, generator), order) == order
    adjacency = rotation(num_tokens, generator)
    assert kronecker_rank(adjacency, order) == order
    assert kronecker_rank(torch.eye(num_tokens, dtype=torch.float64), order) == 1
    # With fewer tokens than the order, the powers beyond A^(N-1) depend on the lower ones (Cayley-Hamilton).
    assert kronecker_rank(gaussian_graph(order - 2, generator), order) == order - 2
    floors = [mha_error_floor(adjacency, count, order) for count in range(1, order + 1)]
    assert all(earlier > later for earlier, later in zip(floors, floors[1:]))
    assert floors[order - 2] > 1e-3 and floors[order - 1] < 1e-12  # k - 1 heads fall short, k heads reach it
    # A ceil(sqrt(k))-head MHA layer whose patterns are `heads` of the k powers, its values and output projection
    # fitted by least squares, does no better than the floor.
    feature_size = 2
    features = torch.randn(3000, num_tokens, feature_size, generator=generator, dtype=torch.float64)
    target = filter_target(adjacency, features, order).reshape(-1, order * feature_size)
    chosen = [torch.linalg.matrix_power(adjacency, power) @ features for power in range(0, order, heads)]
    patterns = torch.cat(chosen, dim=-1).reshape(-1, heads * feature_size)
    solution = torch.linalg.lstsq(patterns, target).solution
    error = torch.linalg.vector_norm(patterns @ solution - target) / torch.linalg.vector_norm(target)
    assert error.item() >= floors[heads - 1] * 0.97 > 0.05


def test_the_persistent_graphs_keep_every_power_apart_where_the_gaussian_ones_fade():
    for attention in ("linear", "softmax"):
        gaussian = task_adjacency(10, attention, 1234, "gaussian").double()
        persistent = task_adjacency(10, attention, 1234, "persistent").double()
        assert kronecker_rank(persistent, 9) == 9
        # Three position-only MHA heads miss much more of the persistent filter than of the fading one.
        assert mha_error_floor(persistent, 3, 9) > 0.3 > 1.2 * mha_error_floor(gaussian, 3, 9)
    rotation = task_adjacency(10, "linear", 0, "persistent")  # float32, as trained
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(10), rtol=0, atol=1e-5)
    stochastic = task_adjacency(10, "softmax", 0, "persistent")
    torch.testing.assert_close(stochastic.sum(dim=-1), torch.ones(10))
    assert stochastic.roll(-1, dims=1).diagonal().mean() > 0.5  # most of the weight on the next node


def test_the_trained_comparison_learns_and_writes_its_report(tmp_path):
    config = PolynomialConfig(num_tokens=4, feature_size=2, head_dim=8, seeds=[0, 1], steps=60, eval_every=20)
    assert config.models == ["MHA H=2", "MHA H=4", "IHA H=2 P=2"]
    report = run_experiment(config, tmp_path, command="test", progress=False)
    assert len(report["runs"]) == 2 * 3 * 2
    for run in report["runs"]:
        errors = [error for _, error in run["curve"]]
        assert [step for step, _ in run["curve"]] == [20, 40, 60]
        assert errors[-1] < errors[0]  # training lowers the held-out error
    summary = report["summary"]
    assert summary["models"]["linear/IHA H=2 P=2"]["seeds"] == [0, 1]
    paired = summary["paired"]["softmax/IHA H=2 P=2 - MHA H=4"]
    assert paired["n"] == 2 and paired["labels"] == [0, 1]
    assert len(summary["paired"]) == 4 and paired["holm_family_size"] == 4
    assert paired["holm_t_p_value"] >= paired["t_p_value"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["summary"]["models"].keys() == summary["models"].keys()
    markdown = (tmp_path / "report.md").read_text()
    assert "| linear | MHA H=4 |" in markdown and "2-head MHA with position-only patterns" in markdown
    assert "| softmax | IHA H=2 P=2 - MHA H=4 |" in markdown and "after Holm" in markdown
    assert (tmp_path / "error.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "runs.partial.json").exists()
    # A finished report with the same settings is re-rendered from its runs, not retrained.
    (tmp_path / "report.md").unlink()
    again = run_experiment(config, tmp_path, command="again", progress=False)
    assert again["runs"] == report["runs"] and (tmp_path / "report.md").is_file()


def test_the_order_9_comparison_trains_three_heads_against_three_and_nine(tmp_path):
    config = PolynomialConfig(
        order=9,
        num_tokens=9,
        feature_size=1,
        head_dim=9,
        graphs="persistent",
        attentions=["softmax"],
        seeds=[0],
        steps=40,
        eval_every=20,
    )
    assert config.models == ["MHA H=3", "IHA H=3 P=3", "MHA H=9"]
    report = run_experiment(config, tmp_path, command="test", progress=False)
    runs = {run["model"]: run for run in report["runs"]}
    assert runs["MHA H=9"]["parameters"] > 2 * runs["MHA H=3"]["parameters"]
    assert all(run["curve"][-1][1] < run["curve"][0][1] for run in runs.values())
    assert set(report["summary"]["paired"]) == {"softmax/IHA H=3 P=3 - MHA H=3", "softmax/IHA H=3 P=3 - MHA H=9"}
    markdown = (tmp_path / "report.md").read_text()
    assert "(k = 9)" in markdown and "one seed: no test" in markdown and "Kronecker rank: softmax 9" in markdown


def test_processes_split_by_attention_pair_with_each_other_and_an_unfinished_report_says_what_is_missing(tmp_path):
    tiny = dict(num_tokens=4, feature_size=2, head_dim=8, seeds=[0, 1], steps=40, eval_every=20)
    full = PolynomialConfig(**tiny)
    # One process ran linear seed 0 only; the report of everything, rendered without training, is unfinished.
    linear_seed_0 = PolynomialConfig(**{**tiny, "attentions": ["linear"], "seeds": [0]})
    run_experiment(linear_seed_0, tmp_path / "linear", progress=False)
    partial = run_experiment(full, tmp_path / "all", runs_from=[tmp_path / "linear"], train=False, progress=False)
    assert len(partial["runs"]) == 3 and len(partial["summary"]["missing"]) == 9
    assert ["linear", "MHA H=2", 1] in partial["summary"]["missing"]
    assert partial["summary"]["paired"]["linear/IHA H=2 P=2 - MHA H=4"]["n"] == 1  # seed 0 only: no test
    markdown = (tmp_path / "all" / "report.md").read_text()
    assert "## Unfinished: 3 of 12 runs" in markdown
    assert "linear MHA H=2: seed 0; " in markdown and "softmax IHA H=2 P=2: none" in markdown
    assert "each row pairs only the seeds where both models have a run" in markdown
    # The other attention in another process; then the full command trains only what is still missing, and a run
    # made by a split process is the run the full command makes (it depends on its settings, model, attention, seed).
    run_experiment(PolynomialConfig(**tiny, attentions=["softmax"]), tmp_path / "softmax", progress=False)
    split = {(run["attention"], run["model"], run["seed"]): run for run in partial["runs"]}
    trained = []
    finished = run_experiment(full, tmp_path / "all", runs_from=[tmp_path / "softmax"], progress=False)
    assert len(finished["runs"]) == 12 and finished["summary"]["missing"] == []
    assert {(run["attention"], run["model"], run["seed"]) for run in finished["runs"]} == {
        (a, m, s) for a in full.attentions for m in full.models for s in full.seeds
    }
    for run in finished["runs"]:
        key = (run["attention"], run["model"], run["seed"])
        if key in split:
            assert run == split[key]  # reused, not retrained
        elif run["attention"] == "linear":
            trained.append(run)
    assert len(trained) == 3  # linear seed 1: the only runs neither process had made
    made_by_split = next(
        run
        for run in finished["runs"]
        if (run["attention"], run["model"], run["seed"]) == ("softmax", "IHA H=2 P=2", 1)
    )
    assert train_filter(full, "IHA H=2 P=2", "softmax", 1)["curve"] == made_by_split["curve"]
    assert "Unfinished" not in (tmp_path / "all" / "report.md").read_text()


def test_runs_made_with_other_task_settings_are_not_reused(tmp_path):
    tiny = dict(num_tokens=4, feature_size=2, head_dim=8, seeds=[0], steps=20, eval_every=20, attentions=["linear"])
    run_experiment(PolynomialConfig(**tiny), tmp_path / "a", progress=False)
    other = PolynomialConfig(**{**tiny, "learning_rate": 1e-3})
    report = run_experiment(other, tmp_path / "b", runs_from=[tmp_path / "a"], train=False, progress=False)
    assert report["runs"] == [] and len(report["summary"]["missing"]) == 3


def test_the_command_records_the_command_that_makes_its_runs(tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path / "k9"), "--order", "9", "--num_tokens", "9", "--feature_size", "1"]
    argv += ["--head_dim", "9", "--attentions", "linear", "--seeds", "0", "--steps", "20", "--eval_every", "20"]
    assert polynomial_filter_main([*argv, "--report-only", "--runs-from", str(tmp_path / "elsewhere")]) == 0
    report = json.loads((tmp_path / "k9" / "report.json").read_text())
    assert report["runs"] == [] and report["command"] == reproducing_command(
        "python -m research.polynomial_filter", argv
    )
    assert "--report-only" not in report["command"] and "elsewhere" not in report["command"]
    printed = capsys.readouterr().out
    assert "## Unfinished: 0 of 3 runs" in printed and "nothing to pair" in printed
    assert reproducing_command("iha x", ["--runs-from=a", "--seeds", "0", "--report-only"]) == "iha x --seeds 0"


@pytest.mark.parametrize("folder", ["polynomial-filter", "polynomial-filter-k9"])
def test_the_committed_reports_are_what_their_own_runs_give(folder):
    # Every number of report.md (and the summary in report.json) recomputes from the runs saved beside it.
    saved = json.loads((REPO_ROOT / "benchmarks" / "synthetic" / folder / "report.json").read_text())
    config = PolynomialConfig(**saved["config"])
    summary = summarize(config, saved["runs"])
    assert summary == saved["summary"] and summary["missing"] == []
    markdown = render_markdown(config, summary, saved["runs"], saved["command"])
    assert markdown == (REPO_ROOT / "benchmarks" / "synthetic" / folder / "report.md").read_text()
    # Made before the command left the package, as `iha polynomial-filter FLAGS`: `python -m
    # research.polynomial_filter` takes the same flags, and they still make the saved settings.
    program, flags = saved["command"].split(" ", 2)[:2], shlex.split(saved["command"])[2:]
    assert program == ["iha", "polynomial-filter"] and "--runs-from" not in flags
    args = make_parser().parse_args(flags)
    assert asdict(PolynomialConfig(**dataclass_values(args, PolynomialConfig))) == saved["config"]


def test_the_config_refuses_an_unknown_order_or_graph_family():
    with pytest.raises(ValueError, match="Unknown order 5"):
        PolynomialConfig(order=5)
    with pytest.raises(ValueError, match="Unknown graphs 'ring'"):
        PolynomialConfig(graphs="ring")
