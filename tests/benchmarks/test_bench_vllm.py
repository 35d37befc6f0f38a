"""The vLLM benchmark's report (benchmarks/bench_vllm.py; the engines need `make vllm-env`): the committed report is
what its committed measurements say, and the per-round spread is read off the rounds the engines took in turn."""

import copy
import json
import sys

from testing_utils import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_vllm import markdown_report, ratios, speed_by_round  # noqa: E402


RESULTS = REPO_ROOT / "benchmarks" / "results"


def test_the_committed_report_is_what_its_json_says():
    run = json.loads((RESULTS / "vllm.json").read_text())
    rendered = markdown_report(run["meta"], run["rows"], run["kv_bytes_per_token"])
    assert rendered == (RESULTS / "vllm.md").read_text()


def test_the_rounds_pair_each_engine_with_the_same_round_of_the_base_model():
    row = copy.deepcopy(json.loads((RESULTS / "vllm.json").read_text())["rows"][0])
    for name, decode_seconds in (("base", [1.0, 2.0, 4.0]), ("iha", [2.0, 2.0, 2.0])):
        times = row["variants"][name]["times"]["cpu"]
        times["first_token_run"] = [0.5, 0.5, 0.5]
        times["full"] = [0.5 + seconds for seconds in decode_seconds]
    assert speed_by_round(row, "iha", "cpu") == [0.5, 1.0, 2.0]
    decode_flops = ratios(row, "iha", "cpu")["decode_flops"]
    assert ratios(row, "iha", "cpu")["speed_over_inverse_flops_by_round"] == [
        ratio * decode_flops for ratio in (0.5, 1.0, 2.0)
    ]


def test_the_committed_attention_report_is_what_its_json_says():
    from bench_vllm_attention import markdown_report as attention_report

    run = json.loads((RESULTS / "vllm_attention.json").read_text())
    assert attention_report(run["meta"], run["rows"]) == (RESULTS / "vllm_attention.md").read_text()
    # The split is the plugin's way of calling the kernel: it computed what the whole requests did, to bf16 rounding
    # (2^-8 relative) of outputs of size ~1.
    assert all(row["max_abs_split_minus_whole"] <= 2**-6 for row in run["rows"])


def test_the_committed_long_context_report_is_what_its_json_says():
    from bench_vllm_long_context import markdown_report as long_context_report

    run = json.loads((RESULTS / "vllm_long_context.json").read_text())
    assert long_context_report(run["meta"], run["workloads"]) == (RESULTS / "vllm_long_context.md").read_text()
    # The cached runs it takes the decode time from read the prompts from the prefix cache (all but the last block).
    measured = [model for workload in run["workloads"].values() for model in workload["models"].values()]
    assert any(r["cached_fraction"] > 0.9 for model in measured for r in model["rounds"])
