"""The served-speed figures of the vLLM benchmarks, read from their JSON: medians over rounds and the ratios of one
model to another. No engine, no torch and no environment variables here, so that the reports and the docs' decision
table (`benchmarks/layout_decision.py`) can read results without starting vLLM."""

import statistics


def workload_key(num_requests: int, multiple: int) -> str:
    return f"{num_requests}x{multiple}"


def summarize(entry: dict, clock: str) -> dict:
    """Medians over rounds: TTFT, decode tokens/s, and the KV bytes per token of context."""
    rounds = entry["rounds"]
    decoded = entry["requests"] * entry["decode_tokens"]
    decode_seconds = [r[clock]["full_cached"] - r[clock]["first_token_cached"] for r in rounds]
    return {
        "ttft": statistics.median(r[clock]["ttft"] for r in rounds),
        "decode_tokens_per_second": decoded / statistics.median(decode_seconds),
        "decode_seconds_by_round": decode_seconds,
        "kv_bytes_per_token": statistics.median(r["kv_bytes_per_token"] for r in rounds),
        "cached_fraction": min(r["cached_fraction"] for r in rounds),
    }


def ratio_row(workload: dict, name: str, over: str, clock: str) -> dict:
    mine, theirs = workload["models"][name], workload["models"][over]
    speed = summarize(mine, clock)["decode_tokens_per_second"] / summarize(theirs, clock)["decode_tokens_per_second"]
    decode_flops = mine["flops"]["decode_step"] / theirs["flops"]["decode_step"]
    by_round = [
        theirs_seconds / mine_seconds * decode_flops
        for mine_seconds, theirs_seconds in zip(
            summarize(mine, clock)["decode_seconds_by_round"], summarize(theirs, clock)["decode_seconds_by_round"]
        )
    ]
    resolved = all(summarize(entry, clock)["decode_tokens_per_second"] > 0 for entry in (mine, theirs))
    return {
        "resolved": resolved,
        "speed": speed,
        "decode_flops": decode_flops,
        "speed_over_inverse_flops": speed * decode_flops,
        "by_round": by_round,
        "ttft": summarize(mine, clock)["ttft"] / summarize(theirs, clock)["ttft"],
        "prefill_flops": mine["flops"]["prefill"] / theirs["flops"]["prefill"],
        "kv": summarize(mine, clock)["kv_bytes_per_token"] / summarize(theirs, clock)["kv_bytes_per_token"],
    }


def measured_rounds(workloads: dict) -> list[int]:
    """How many rounds each measured model of each cell has (cells not measured left out)."""
    return sorted({len(m["rounds"]) for w in workloads.values() for m in w["models"].values() if m["rounds"]})


def rounds_text(workloads: dict) -> str:
    counts = measured_rounds(workloads)
    if not counts:
        return "none yet"
    return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
