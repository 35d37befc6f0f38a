"""The benchmark's analytic FLOP counter, against brute-force mask counts and a hand count on a tiny config."""

import importlib.util

import pytest
import torch
from conftest import REPO_ROOT
from reference_iha import reference_mask


spec = importlib.util.spec_from_file_location("bench_perf", REPO_ROOT / "benchmarks" / "bench_perf.py")
bench_perf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_perf)


@pytest.mark.parametrize("num_pseudo", [1, 2, 3])
@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("window", [None, 1, 4])
def test_attention_pairs_equal_the_reference_mask_count(num_pseudo, mask_mode, window):
    seq_len = 11
    allowed = reference_mask(seq_len, num_pseudo, mask_mode, window, padding_mask=None)[0]
    assert bench_perf.attention_pairs(seq_len, num_pseudo, mask_mode, window) == allowed.sum().item()
    # Decoding the last 3 tokens after 8 cached ones scores the last 3 * P rows of the same mask.
    decode_rows = allowed[(seq_len - 3) * num_pseudo :]
    assert bench_perf.attention_pairs(3, num_pseudo, mask_mode, window, past_tokens=8) == decode_rows.sum().item()


TINY_SHAPE = dict(
    vocab_size=10, hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4
)


def test_model_flops_of_a_tiny_llama_by_hand():
    # 1 layer, N = 3 tokens, hidden 8, 2 heads and 1 KV head of dim 4, MLP 16, vocabulary 10.
    flops = bench_perf.model_flops(TINY_SHAPE, ["full_attention"], num_tokens=3)
    assert flops["projections"] == 2 * 3 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8)  # q, k, v, o
    assert flops["mlp"] == 2 * 3 * (8 * 16 * 3)  # gate, up, down
    assert flops["attention"] == 2 * 2 * 2 * 4 * (1 + 2 + 3)  # (q.k + w.v) x 2 heads x d 4 x causal pairs
    assert flops["mixing"] == 0
    assert flops["lm_head"] == 2 * 3 * 8 * 10
    assert flops["total"] == 1152 + 2304 + 192 + 480


def test_model_flops_of_a_tiny_iha_layer_by_hand():
    # The same layer as IHA with P = 2, flat causal: 6 virtual tokens, 6 * 7 / 2 = 21 causal pairs per head.
    flops = bench_perf.model_flops(TINY_SHAPE, ["iha_full_attention"], num_tokens=3, num_pseudo_heads=2)
    assert flops["attention"] == 2 * 2 * 2 * 4 * 21
    mix_queries = 2 * 3 * 2 * 2 * 4 * 2  # N x P x H outputs of dim d, each a sum over H source heads
    mix_keys_values = 2 * 2 * 3 * 2 * 1 * 4 * 1  # keys and values: N x P x H_kv outputs, sums over H_kv
    collapse = 2 * 3 * 2 * 2 * 4  # per head: N x H outputs of dim d, each a sum over P
    assert flops["mixing"] == mix_queries + mix_keys_values + collapse
    # A decoding step after 5 tokens: the token cache re-mixes all 6 tokens' keys and values, the pseudo cache 1.
    token_step = bench_perf.model_flops(TINY_SHAPE, ["iha_full_attention"], 1, past_tokens=5, num_pseudo_heads=2)
    pseudo_step = bench_perf.model_flops(
        TINY_SHAPE, ["iha_full_attention"], 1, past_tokens=5, num_pseudo_heads=2, cache_mode="pseudo"
    )
    assert token_step["mixing"] - pseudo_step["mixing"] == 2 * 2 * 5 * 2 * 1 * 4 * 1
    assert token_step["attention"] == 2 * 2 * 2 * 4 * (2 * 10 + 1 + 2)  # 2 queries x 10 earlier keys + own token


def test_peak_memory_sees_an_allocation():
    allocated = 64 * 2**20
    peak = bench_perf.peak_memory_of(lambda: torch.ones(allocated // 4).sum())
    if peak is None:
        pytest.skip("no /proc/self/clear_refs on this system")
    assert allocated * 0.9 <= peak <= allocated * 2
