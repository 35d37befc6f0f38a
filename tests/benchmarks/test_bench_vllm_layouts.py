"""The real-model vLLM benchmark's parts that need no engine (benchmarks/bench_vllm_layouts.py; the engines need
`make vllm-env`): its bound of a request's KV bytes, the concurrency workload it sends, and its report, which for the
committed run is what the committed JSON says."""

import json
import sys
from types import SimpleNamespace

import pytest
from testing_utils import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_vllm_layouts import (  # noqa: E402
    cached_line,
    cell_loads_line,
    concurrency_table,
    concurrency_workload,
    kv_bytes_needed,
    markdown_report,
    speed_kv_bytes,
)


RESULTS = REPO_ROOT / "benchmarks" / "results"


def tiny_args(**overrides):
    values = dict(
        layers=5,
        global_every=5,
        window=4,
        pseudo_heads=2,
        block_size=2,
        max_batch_tokens=8,
        dtype="bfloat16",
        requests=[3],
        concurrency_decode_tokens=2,
        max_num_seqs=100,
        shape={"num_key_value_heads": 1, "head_dim": 4},
    )
    return SimpleNamespace(**{**values, **overrides})


def test_the_kv_bound_counts_blocks_by_hand():
    args = tiny_args()
    per_token = 2 * 1 * 4 * 2  # keys and values, 1 KV head of dim 4, bf16
    # 20 tokens: a global layer holds 10 blocks of 2 and one more; the base has 5 of them.
    assert kv_bytes_needed(args, "base", 20) == 5 * 11 * 2 * per_token
    # Global+Local's sliding layers keep P^2 W = 16 tokens and a block while decoding: 9 blocks and one more.
    assert kv_bytes_needed(args, "global_local", 20) == (4 * 10 + 11) * 2 * per_token
    # The hybrid's sliding IHA layers keep W + 1 = 5 tokens and a block, P = 2 pseudo-keys each: 4 blocks, one more.
    assert kv_bytes_needed(args, "hybrid", 20) == (4 * 5 * 2 + 11) * 2 * per_token
    # While prefilling, a sliding layer also holds a chunk of 8 tokens: min(20, 5 + 8) = 13 tokens, 7 blocks + 1.
    assert kv_bytes_needed(args, "hybrid", 20, prefilling=True) == (4 * 8 * 2 + 11) * 2 * per_token
    # A prompt shorter than the window: the sliding layers hold it all, as a global one does.
    assert kv_bytes_needed(args, "global_local", 6) == kv_bytes_needed(args, "base", 6)


def test_the_speed_engines_hold_the_largest_workload_with_a_tenth_to_spare():
    args = tiny_args(requests=[2, 3])
    need = 2 * kv_bytes_needed(args, "hybrid", 20) + kv_bytes_needed(args, "hybrid", 20, prefilling=True)
    assert speed_kv_bytes(args, "hybrid", 20) == int(1.1 * need)


def test_the_concurrency_workload_sends_more_requests_than_the_budget_holds():
    args = tiny_args()
    budget = 40 * kv_bytes_needed(args, "base", 4 + 2)
    count, length, new_tokens = concurrency_workload(args, "base", 1, budget)
    assert (count, length) == (64, 4)  # 1.5 x 40 + 4
    # Decoding long enough that the last request's prefill, at half the step budget, ends before the first stops.
    assert new_tokens == -(-64 * 4 // 4) + 2
    assert concurrency_workload(args, "base", 1, 10**12)[0] == args.max_num_seqs


def test_the_concurrency_table_compares_with_the_base_at_each_length():
    entry = {
        "submitted": 30,
        "most_decoding": 10,
        "prompt_length": 16,
        "new_tokens": 4,
        "vllm_implied": 7.5,
        "preempted_requests": 0,
        "vllm_capacity": {"num_blocks": 100},
    }
    part = {"budget_bytes": 2**20, "results": {"base": {"4": entry}, "hybrid": {"4": {**entry, "most_decoding": 25}}}}
    rows = [line for line in concurrency_table(part) if line.startswith("| 16 + 4")]
    assert rows[0].split(" | ")[3:5] == ["10", "1.00"]
    assert rows[1].split(" | ")[3:5] == ["25", "2.50"]


def test_each_speed_cell_says_the_load_it_was_measured_under():
    def rounds(*loads):
        return {"rounds": [{"load_average": load} for load in loads]}

    workloads = {
        "8x1": {"models": {"base": rounds(8.5), "hybrid": rounds(9.46)}},
        "32x16": {"models": {"base": rounds(3.2)}},
    }
    assert cell_loads_line(workloads) == (
        "Load average (1 min) after each cell's measurements: 8 requests at 1x W: 8.5-9.5; 32 requests at 16x W: 3.2-3.2."
    )
    assert cell_loads_line({"8x1": {"models": {"base": {"rounds": []}}}}) == ""


def test_the_report_says_how_much_of_each_models_prompts_the_prefix_cache_held():
    """A model whose cached runs read less of a prompt prefills the rest again on every repeated prompt."""

    def model(*fractions):
        clock = {"ttft": 1.0, "full_cached": 2.0, "first_token_cached": 1.0}
        rounds = [{"cpu": clock, "kv_bytes_per_token": 1.0, "cached_fraction": share} for share in fractions]
        return {"requests": 8, "decode_tokens": 4, "rounds": rounds}

    workloads = {"8x1": {"requests": 8, "multiple": 1, "models": {"base": model(0.5, 0.5), "hybrid": model(0.0, 0.25)}}}
    line = cached_line(workloads)
    assert line.endswith(": 8 requests at 1x W: base 50% / hybrid 0%.")  # the least any round read
    assert cached_line({"8x1": {"requests": 8, "multiple": 1, "models": {"base": {"rounds": []}}}}) == ""


def test_the_committed_report_is_what_its_json_says():
    path = RESULTS / "vllm_layouts.json"
    if not path.is_file():
        pytest.skip("benchmarks/bench_vllm_layouts.py has not been run on the real model yet")
    assert markdown_report(json.loads(path.read_text())) == path.with_suffix(".md").read_text()
