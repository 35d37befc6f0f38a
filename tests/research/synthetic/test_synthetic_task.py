"""The relation-composition task and its one-layer models (MHA, 2-simplicial, IHA): data, padding, batches,
loss and accuracy."""

import pytest
import torch
import torch.nn.functional as F

from research.synthetic import build_model
from research.synthetic.models import count_parameters
from research.synthetic.task import CompositionData, compose_relation, make_composition_data, valid_positions
from research.synthetic.train import evaluate, masked_loss


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


@pytest.mark.parametrize("group_by_m", [True, False])
def test_epoch_batches_cover_every_example_once_and_group_by_m(group_by_m):
    from research.synthetic.train import epoch_batches

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
    from research.synthetic.train import epoch_batches

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


def relation_probabilities(m: int, density: float) -> list[float]:
    """The probability of every m x m relation (each pair related independently with probability `density`)."""
    import itertools

    return [
        density ** sum(bits) * (1 - density) ** (m * m - sum(bits)) for bits in itertools.product((0, 1), repeat=m * m)
    ]


def test_independent_streams_share_no_draws_across_seeds_and_splits():
    from dataclasses import replace

    from research.synthetic.config import TINY
    from research.synthetic.relations import seen_in
    from research.synthetic.task import split_seeds
    from research.synthetic.train import comparison_data

    # Every (seed, task, split) draws from its own stream.
    streams = [split_seeds(seed, task, 0, "independent") for seed in range(3) for task in ("binary", "ternary")]
    generator_seeds = [seed for splits in streams for seed in splits.values()]
    assert len(set(generator_seeds)) == len(generator_seeds) == 18
    # At m = 8 (64 bits at density 0.325) two relations agree by chance with probability ~1e-17: whatever two seeds'
    # splits share was drawn twice from the same stream. Independent streams share nothing; shifted ones share
    # seed 0's test set as seed 1's validation set, which is what this check would catch.
    for streams_kind, shared_expected in (("independent", False), ("shifted", True)):
        config = replace(TINY, tasks=["binary"], m={"binary": [8, 8]}, num_train=512, num_val=128, num_test=128)
        data = {
            seed: comparison_data(replace(config, seed=seed, data_streams=streams_kind), "binary") for seed in (0, 1)
        }
        shared = {
            (split_a, split_b): int(seen_in(data[0][split_a], data[1][split_b]).sum())
            for split_a in data[0]
            for split_b in data[1]
        }
        if shared_expected:
            # ... and seed 0's validation stream is seed 1's training stream (offset by the draw of the sizes).
            assert shared[("test", "val")] == 128 and shared[("val", "train")] > 64
            assert sum(shared.values()) == shared[("test", "val")] + shared[("val", "train")]
        else:
            assert sum(shared.values()) == 0, shared


def test_shared_relations_at_small_m_are_the_natural_duplicates_of_the_relation_space():
    from dataclasses import replace

    from research.synthetic.config import TINY
    from research.synthetic.relations import seen_in
    from research.synthetic.train import comparison_data

    # At m = 3 relations repeat by chance. The share of seed 0's test relations found in seed 1's training set is
    # then what the relation space predicts for independent draws: sum_r p(r) (1 - (1 - p(r))^N).
    config = replace(TINY, tasks=["binary"], m={"binary": [3, 3]}, num_train=200, num_val=100, num_test=2000)
    seed_0, seed_1 = (comparison_data(replace(config, seed=seed), "binary") for seed in (0, 1))
    probabilities = relation_probabilities(3, 0.325)
    expected = sum(p * (1 - (1 - p) ** config.num_train) for p in probabilities)
    standard_error = (expected * (1 - expected) / config.num_test) ** 0.5
    for test, train in ((seed_0["test"], seed_1["train"]), (seed_0["test"], seed_0["train"])):
        observed = seen_in(test, train).float().mean().item()
        assert abs(observed - expected) < 4 * standard_error, (observed, expected)
    assert 0.3 < expected < 0.7  # a rate this check can tell from 0 and from 1


def test_duplicate_rates_per_preset():
    """Test relations present verbatim in the same seed's training set: about 10.5% for paper-ternary (m = 5), about
    1% for ternary at the paper's m ~ U{5..8} (its m = 5 quarter) and none for binary at m ~ U{6..10} (the numbers
    benchmarks/synthetic/README.md quotes)."""
    from research.synthetic import PRESETS
    from research.synthetic.relations import duplicate_rates

    paper_ternary = duplicate_rates(PRESETS["paper-ternary"])
    assert 0.095 < paper_ternary["ternary"] < 0.115
    paper = duplicate_rates(PRESETS["paper-regime"])
    assert 0.005 < paper["ternary"] < 0.015 and paper["binary"] < 0.001
