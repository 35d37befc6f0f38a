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
    mine, theirs = summarize(workload["models"][name], clock), summarize(workload["models"][over], clock)
    speed = mine["decode_tokens_per_second"] / theirs["decode_tokens_per_second"]
    decode_flops = workload["models"][name]["flops"]["decode_step"] / workload["models"][over]["flops"]["decode_step"]
    speed_by_round = [
        theirs_seconds / mine_seconds
        for mine_seconds, theirs_seconds in zip(mine["decode_seconds_by_round"], theirs["decode_seconds_by_round"])
    ]
    prefill_flops = workload["models"][name]["flops"]["prefill"] / workload["models"][over]["flops"]["prefill"]
    return {
        "resolved": all(entry["decode_tokens_per_second"] > 0 for entry in (mine, theirs)),
        "speed": speed,
        "decode_flops": decode_flops,
        "speed_over_inverse_flops": speed * decode_flops,
        "speed_by_round": speed_by_round,
        "by_round": [ratio * decode_flops for ratio in speed_by_round],
        "ttft": mine["ttft"] / theirs["ttft"],
        "prefill_flops": prefill_flops,
        "kv": mine["kv_bytes_per_token"] / theirs["kv_bytes_per_token"],
    }


def round_loads(workloads: dict) -> list[tuple[str, int, float]]:
    """(cell, round number from 1, load average) of every speed round that recorded its load: one reader for the
    reports that group them by cell, by round or not at all."""
    return [
        (key, number, record["load_average"])
        for key, workload in workloads.items()
        for model in workload["models"].values()
        for number, record in enumerate(model["rounds"], start=1)
        if "load_average" in record
    ]


def measured_rounds(workloads: dict) -> list[int]:
    """How many rounds each measured model of each cell has (cells not measured left out)."""
    return sorted({len(m["rounds"]) for w in workloads.values() for m in w["models"].values() if m["rounds"]})


def rounds_text(workloads: dict) -> str:
    counts = measured_rounds(workloads)
    if not counts:
        return "none yet"
    return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
