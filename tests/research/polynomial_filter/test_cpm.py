"""The prefix-count task of `research.polynomial_filter.cpm` (our own, not the paper's CPM-3: prefix counts of a sequence of up to N_max symbols from
{0, 1, 2}, at a readout token): ceil(sqrt(N_max)) hard-attention IHA heads answer it exactly, as do N_max MHA heads,
and fewer than N_max MHA heads whose patterns read positions only cannot (float64, every input or thousands of drawn
ones)."""

import math

import pytest
import torch

from research.polynomial_filter.cpm import (
    EMPTY,
    all_sequences,
    cpm_inputs,
    cpm_kronecker_rank,
    cpm_operator,
    cpm_readout,
    cpm_target,
    hand_set_iha_cpm,
    hand_set_mha_cpm,
    random_sequences,
    slot_kronecker_factors,
    symbol_one_hots,
)


# These layers are tiny: one torch thread (conftest.py's `one_torch_thread`).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequences(max_length: int) -> torch.Tensor:
    """Every input up to N_max = 7 (3280 of them), else 2000 drawn ones (lengths uniform in 0 .. N_max)."""
    if max_length <= 7:
        return all_sequences(max_length)
    return random_sequences(2000, max_length, torch.Generator().manual_seed(max_length))


def test_the_target_is_the_table_of_prefix_counts_and_is_order_sensitive():
    slots = torch.tensor([[2, 0, 2, EMPTY], [0, 2, 2, EMPTY], [EMPTY] * 4])
    expected = torch.tensor(
        [
            [[0, 0, 1], [1, 0, 1], [1, 0, 2], [1, 0, 2]],  # 2 0 2: the empty slot counts nothing
            [[1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 0, 2]],  # the same symbols in another order
            [[0, 0, 0]] * 4,
        ],
        dtype=torch.float64,
    )
    target = cpm_target(slots)
    torch.testing.assert_close(target, expected.flatten(1), rtol=0, atol=0)
    # One head attending evenly to every slot reads the whole sequence's counts, the same for both orders.
    torch.testing.assert_close(symbol_one_hots(slots).sum(dim=1)[0], symbol_one_hots(slots).sum(dim=1)[1])
    assert not torch.equal(target[0], target[1])
    # The table determines the sequence: s_j is the symbol whose count rises at j.
    for max_length in (3, 5):
        every = all_sequences(max_length)
        assert len(every) == sum(3**length for length in range(max_length + 1))
        table = cpm_target(every).view(len(every), max_length, 3)
        rises = torch.diff(table, dim=1, prepend=torch.zeros_like(table[:, :1]))
        decoded = torch.where(rises.sum(dim=-1) > 0, rises.argmax(dim=-1), EMPTY)
        assert torch.equal(decoded, every)
    inputs = cpm_inputs(slots)
    assert inputs.shape == (3, 5, 3) and inputs[:, -1].abs().sum() == 0  # the readout token carries no symbol


@pytest.mark.parametrize("max_length", [1, 2, 3, 4, 5, 7, 9, 10, 16])
def test_ceil_sqrt_n_max_hard_attention_iha_heads_answer_cpm_3_exactly(max_length):
    slots = sequences(max_length)
    target = cpm_target(slots)
    iha = hand_set_iha_cpm(max_length)
    heads = math.ceil(math.sqrt(max_length))
    assert (iha.num_heads, iha.head_mixing.num_pseudo_heads, iha.attention) == (heads, heads, "hard")
    torch.testing.assert_close(cpm_readout(iha, slots), target, rtol=0, atol=1e-12)
    mha = hand_set_mha_cpm(max_length)
    assert (mha.num_heads, mha.head_mixing, mha.attention) == (max_length, None, "hard")
    torch.testing.assert_close(cpm_readout(mha, slots), target, rtol=0, atol=1e-12)
    # Same width (heads x head dim) at N_max = 9: 3 heads of 9 against 9 heads of 3.
    if max_length == 9:
        assert iha.num_heads * iha.head_dim == mha.num_heads * mha.head_dim == 27


def test_the_iha_construction_needs_its_hard_patterns():
    # Each pseudo-query averages evenly over the slots of its H prefixes; with the patterns' logits softened, the
    # shares of the matching slots drift and the counts are off.
    slots = all_sequences(5)
    iha = hand_set_iha_cpm(5)
    iha.attention = "softmax"
    assert (cpm_readout(iha, slots) - cpm_target(slots)).abs().max() > 0.1


@pytest.mark.parametrize("max_length", [2, 4, 5, 9, 16])
def test_fewer_than_n_max_mha_heads_with_position_only_patterns_cannot_answer_cpm_3(max_length):
    # The answer's linear part over the slots has Kronecker rank N_max ...
    assert cpm_kronecker_rank(max_length) == max_length
    factors = slot_kronecker_factors(cpm_operator(max_length), max_length)
    singular_values = torch.linalg.svdvals(factors)
    # The best N_max - 1 Kronecker terms miss that map by its smallest singular value, about sqrt(3) / 2 counts.
    assert singular_values[-1] > 0.5
    # ... the hand-set MHA layer's readout is exactly that map, and its factors are one rank-1 term per head ...
    mha = hand_set_mha_cpm(max_length)
    every_single = torch.full((3 * max_length, max_length), EMPTY)
    for slot in range(max_length):
        for symbol in range(3):
            row = slot * 3 + symbol
            every_single[row, :slot] = 0 if symbol else 1  # a prefix of another symbol, then this one
            every_single[row, slot] = symbol
    one_hot_inputs = symbol_one_hots(every_single).flatten(1)
    torch.testing.assert_close(
        cpm_readout(mha, every_single), one_hot_inputs @ cpm_operator(max_length).T, rtol=0, atol=1e-12
    )
    # ... and the inputs' differences span every (slot, symbol) direction, so an affine layer exact on every input
    # has that linear part: H heads with position-only patterns give rank <= H < N_max when H < N_max.
    every = sequences(max_length)
    differences = symbol_one_hots(every).flatten(1) - symbol_one_hots(every[:1]).flatten(1)
    assert torch.linalg.matrix_rank(differences) == 3 * max_length


@pytest.mark.parametrize("max_length", [4, 5, 9])
def test_the_best_affine_readout_of_fewer_mha_heads_misses_some_input(max_length):
    # With N_max - 1 position-only patterns at the readout (the N_max - 1 shortest prefixes, or random weights), the
    # layer's readout output is an affine function of the N_max - 1 pattern-weighted one-hot sums; the best affine
    # fit over every input is still wrong on some input by more than half a count.
    every = sequences(max_length)
    one_hots, target = symbol_one_hots(every), cpm_target(every)
    generator = torch.Generator().manual_seed(max_length)
    pattern_sets = {
        "prefixes": torch.tril(torch.ones(max_length, max_length, dtype=torch.float64))[:-1],
        "random": torch.rand(max_length - 1, max_length, generator=generator, dtype=torch.float64),
    }
    for name, patterns in pattern_sets.items():
        pattern_sums = torch.einsum("hi,bis->bhs", patterns, one_hots).flatten(1)
        design = torch.cat([pattern_sums, torch.ones(len(every), 1, dtype=torch.float64)], dim=1)
        solution = torch.linalg.lstsq(design, target).solution
        worst = (design @ solution - target).abs().max().item()
        assert worst > 0.5, name
    # N_max such patterns (all prefixes) are enough: the fit is exact.
    patterns = torch.tril(torch.ones(max_length, max_length, dtype=torch.float64))
    pattern_sums = torch.einsum("hi,bis->bhs", patterns, one_hots).flatten(1)
    solution = torch.linalg.lstsq(pattern_sums, target).solution
    torch.testing.assert_close(pattern_sums @ solution, target, rtol=0, atol=1e-9)
