"""The speed benchmark's parts: its analytic FLOP counter (against brute-force mask counts and a hand count on a tiny
config), its memory probe, its packed-row summary and report, and its choice of device."""

import sys

import pytest
import torch
from testing_utils import REPO_ROOT

from iha.models.iha.naive_iha import reference_mask


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_common import choose_device, peak_memory_of  # noqa: E402
from flops import attention_pairs, model_flops  # noqa: E402
from perf_report import markdown_report, summarize  # noqa: E402


@pytest.mark.parametrize("num_pseudo", [1, 2, 3])
@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("window", [None, 1, 4])
def test_attention_pairs_equal_the_reference_mask_count(num_pseudo, mask_mode, window):
    seq_len = 11
    allowed = reference_mask(seq_len, num_pseudo, mask_mode, window, padding_mask=None)[0]
    assert attention_pairs(seq_len, num_pseudo, mask_mode, window) == allowed.sum().item()
    # Decoding the last 3 tokens after 8 cached ones scores the last 3 * P rows of the same mask.
    decode_rows = allowed[(seq_len - 3) * num_pseudo :]
    assert attention_pairs(3, num_pseudo, mask_mode, window, past_tokens=8) == decode_rows.sum().item()


@pytest.mark.parametrize("num_pseudo", [2, 3])
@pytest.mark.parametrize("window", [1, 4])
def test_attention_pairs_of_the_flat_window_equal_a_mask_count(num_pseudo, window):
    """The paper's window: virtual query i sees virtual keys i - W * P < j <= i."""
    virtual = torch.arange(11 * num_pseudo)
    allowed = (virtual[None, :] <= virtual[:, None]) & (virtual[None, :] > virtual[:, None] - window * num_pseudo)
    assert attention_pairs(11, num_pseudo, "flat_causal", window) == allowed.sum().item()
    decode_rows = allowed[8 * num_pseudo :]
    assert attention_pairs(3, num_pseudo, "flat_causal", window, 8) == decode_rows.sum().item()


TINY_SHAPE = dict(
    vocab_size=10, hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4
)


def test_model_flops_of_a_tiny_llama_by_hand():
    # 1 layer, N = 3 tokens, hidden 8, 2 heads and 1 KV head of dim 4, MLP 16, vocabulary 10.
    flops = model_flops(TINY_SHAPE, ["full_attention"], num_tokens=3)
    assert flops["projections"] == 2 * 3 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8)  # q, k, v, o
    assert flops["mlp"] == 2 * 3 * (8 * 16 * 3)  # gate, up, down
    assert flops["attention"] == 2 * 2 * 2 * 4 * (1 + 2 + 3)  # (q.k + w.v) x 2 heads x d 4 x causal pairs
    assert flops["mixing"] == 0
    assert flops["lm_head"] == 2 * 3 * 8 * 10
    assert flops["total"] == 1152 + 2304 + 192 + 480


def test_model_flops_of_a_tiny_iha_layer_by_hand():
    # The same layer as IHA with P = 2, flat causal: 6 virtual tokens, 6 * 7 / 2 = 21 causal pairs per head.
    flops = model_flops(TINY_SHAPE, ["iha_full_attention"], num_tokens=3, num_pseudo_heads=2)
    assert flops["attention"] == 2 * 2 * 2 * 4 * 21
    mix_queries = 2 * 3 * 2 * 2 * 4 * 2  # N x P x H outputs of dim d, each a sum over H source heads
    mix_keys_values = 2 * 2 * 3 * 2 * 1 * 4 * 1  # keys and values: N x P x H_kv outputs, sums over H_kv
    collapse = 2 * 3 * 2 * 2 * 4  # per head: N x H outputs of dim d, each a sum over P
    assert flops["mixing"] == mix_queries + mix_keys_values + collapse
    # A decoding step after 5 tokens: the token cache re-mixes all 6 tokens' keys and values, the pseudo cache 1.
    token_step = model_flops(TINY_SHAPE, ["iha_full_attention"], 1, past_tokens=5, num_pseudo_heads=2)
    pseudo_step = model_flops(
        TINY_SHAPE, ["iha_full_attention"], 1, past_tokens=5, num_pseudo_heads=2, cache_mode="pseudo"
    )
    assert token_step["mixing"] - pseudo_step["mixing"] == 2 * 2 * 5 * 2 * 1 * 4 * 1
    assert token_step["attention"] == 2 * 2 * 2 * 4 * (2 * 10 + 1 + 2)  # 2 queries x 10 earlier keys + own token


def test_peak_memory_sees_an_allocation():
    allocated = 64 * 2**20
    peak = peak_memory_of(lambda: torch.ones(allocated // 4).sum())
    if peak is None:
        pytest.skip("no /proc/self/clear_refs on this system")
    assert allocated * 0.9 <= peak <= allocated * 2


def packed_row(base_cpu, iha_cpu, base_wall, iha_wall):
    times = {"base": {"cpu": base_cpu, "wall": base_wall}, "iha": {"cpu": iha_cpu, "wall": iha_wall}}
    return {"layout": "global", "P": 2, "documents": 4, "document_len": 512, "sliding_window": None, "train_s": times}


def test_packed_rows_give_the_ratio_of_every_round_its_median_and_range_and_the_target():
    row = packed_row([1.0, 2.0, 1.0], [1.05, 2.4, 1.0], [3.0, 3.0, 3.0], [6.0, 6.0, 6.0])
    targets = summarize([], [], 1, [row], clock="cpu")
    cpu = row["summary"]["cpu"]
    assert cpu["ratio_by_round"] == pytest.approx([1.05, 1.2, 1.0])
    assert (cpu["ratio_median"], cpu["ratio_min"], cpu["ratio_max"]) == pytest.approx((1.05, 1.0, 1.2))
    assert targets["packed"]["met"] and "1.05 x base" in targets["packed"]["measured"]
    # On a GPU the wall clock is the measure: 2.0 x base misses the 1.1 x target.
    assert not summarize([], [], 1, [row], clock="wall")["packed"]["met"]
    meta = {**dict.fromkeys(["command", "date", "machine", "torch", "transformers", "threads", "layers"], "-")}
    meta.update(dict.fromkeys(["shape_name", "shape_note", "position_mode", "global_layers_note", "repeats"], "-"))
    meta.update(machine_note="", lm_head_share="-", lm_head_share_at="-", decode_tokens=1, decode_context=1)
    report = markdown_report(meta, [], [], targets, [row])
    assert (
        "| global IHA | 2 | 4 x 512 | 1000 / 1050 | **1.050** | 1.000 - 1.200 | 1.050, 1.200, 1.000 | 2.000 |" in report
    )


def test_device_and_dtype_follow_the_machine_unless_given():
    assert choose_device("cpu", None) == (torch.device("cpu"), torch.float32)
    assert choose_device("cuda", None) == (torch.device("cuda"), torch.bfloat16)
    assert choose_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert choose_device(None, None)[0].type == expected
