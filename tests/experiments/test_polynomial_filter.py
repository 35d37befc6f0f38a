"""The paper's polynomial-filter claim: 2 IHA heads with P = 2 compute [X, AX, A^2 X, A^3 X], which MHA needs 4
heads for (hand-set weights, float64), and the trained comparison's outputs."""

import json

import pytest
import torch

from iha.experiments.synthetic.polynomial import PolynomialConfig, run_experiment
from iha.experiments.synthetic.polynomial_filter import (
    filter_target,
    hand_set_iha_filter,
    hand_set_mha_filter,
    kronecker_rank,
    mha_error_floor,
)


def cycle(num_tokens: int) -> torch.Tensor:
    """The directed cycle n -> n + 1: A^j X shifts the features by j tokens."""
    return torch.roll(torch.eye(num_tokens, dtype=torch.float64), 1, dims=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_iha_heads_compute_the_order_4_filter_exactly_with_linear_attention(seed):
    generator = torch.Generator().manual_seed(seed)
    num_tokens, feature_size = 5, 2
    adjacency = torch.randn(num_tokens, num_tokens, generator=generator, dtype=torch.float64)
    features = torch.randn(7, num_tokens, feature_size, generator=generator, dtype=torch.float64)
    target = filter_target(adjacency, features)
    assert target.shape == (7, num_tokens, 4 * feature_size)
    torch.testing.assert_close(target[..., 3 * feature_size :], adjacency @ adjacency @ adjacency @ features)
    iha = hand_set_iha_filter(adjacency, feature_size, head_dim=6)
    assert (iha.num_heads, iha.head_mixing.num_pseudo_heads) == (2, 2)
    torch.testing.assert_close(iha(features), target, rtol=0, atol=1e-12)
    # The 4-head MHA layer computes the same; so the 2-head IHA layer does with half its projections.
    mha = hand_set_mha_filter(adjacency, feature_size, head_dim=6)
    torch.testing.assert_close(mha(features), target, rtol=0, atol=1e-12)
    iha_projections = sum(p.numel() for name, p in iha.named_parameters() if "proj" in name)
    assert 2 * iha_projections == sum(p.numel() for name, p in mha.named_parameters() if "proj" in name)


def test_the_softmax_form_is_exact_up_to_e_to_the_minus_beta_on_a_permutation():
    num_tokens, feature_size = 6, 3
    adjacency = cycle(num_tokens)
    features = torch.randn(4, num_tokens, feature_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    target = filter_target(adjacency, features)
    torch.testing.assert_close(target[..., feature_size : 2 * feature_size], features.roll(-1, dims=1))
    errors = {}
    for beta in (4.0, 60.0):
        layer = hand_set_iha_filter(adjacency, feature_size, head_dim=6, beta=beta)
        assert layer.attention == "softmax"
        errors[beta] = (layer(features) - target).abs().max().item()
    assert errors[60.0] < 1e-12 < 1e-3 < errors[4.0]  # the construction needs sharp patterns, and gets them
    torch.testing.assert_close(
        hand_set_mha_filter(adjacency, feature_size, 6, beta=60.0)(features), target, rtol=0, atol=1e-12
    )


def test_two_mha_heads_with_position_only_patterns_cannot_compute_the_filter():
    # The filter's Kronecker rank is 4: no sum of 2 Kronecker products (2 MHA heads whose patterns read positions
    # only) gets closer than the floor, on average over Gaussian features.
    generator = torch.Generator().manual_seed(0)
    adjacency = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    assert kronecker_rank(adjacency) == 4 and kronecker_rank(torch.eye(5, dtype=torch.float64)) == 1
    floor_two, floor_four = mha_error_floor(adjacency, 2), mha_error_floor(adjacency, 4)
    assert floor_two > 0.05 and floor_four < 1e-12
    # A 2-head MHA layer whose patterns are two of the four powers, its values and output projection fitted by least
    # squares, does no better than the floor.
    features = torch.randn(4000, 5, 2, generator=generator, dtype=torch.float64)
    target = filter_target(adjacency, features)
    two_patterns = torch.cat([features, adjacency @ adjacency @ features], dim=-1).reshape(-1, 4)  # I and A^2
    solution = torch.linalg.lstsq(two_patterns, target.reshape(-1, 8)).solution
    error = torch.linalg.vector_norm(two_patterns @ solution - target.reshape(-1, 8)) / torch.linalg.vector_norm(target)
    assert error.item() >= floor_two * 0.97


def test_the_trained_comparison_learns_and_writes_its_report(tmp_path):
    config = PolynomialConfig(num_tokens=4, feature_size=2, head_dim=8, seeds=[0, 1], steps=60, eval_every=20)
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
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["summary"]["models"].keys() == summary["models"].keys()
    markdown = (tmp_path / "report.md").read_text()
    assert "| linear | MHA H=4 |" in markdown and "2-head MHA with position-only patterns" in markdown
    assert (tmp_path / "error.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "runs.partial.json").exists()
