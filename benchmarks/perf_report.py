"""The report of `bench_perf.py`: medians and IHA / base ratios of its measurements, the targets, the markdown.

`summarize` adds a summary (medians, ratios, in CPU time and in wall-clock time) to every measured row and checks the
`TARGETS`; `markdown_report` writes the tables. `bench_perf.py --render RUN.json` rewrites a report from an earlier
run's measurements with these functions, without measuring.
"""

from bench_common import median


TARGETS = {
    "packed_train_time": 1.1,  # packed row of 4 x 512 tokens, global IHA, P=2: forward + backward <= 1.1 x base
    "forward_vs_flops": 1.15,  # global IHA, P=2, N=2048: forward time ratio <= 1.15 x FLOP ratio
    "hybrid_train_time": 1.2,  # hybrid, P=2, N=2048: forward + backward time <= 1.2 x base
    "decode_kv_bytes": 1.0,  # decode, P=2, global, 1024 context: KV bytes <= 1.0 x base (default cache mode)
    "decode_speed_vs_flops": 0.8,  # ... and decode tok/s ratio >= 0.8 x inverse decode-step FLOP ratio
}


def ratio(iha_value, base_value):
    return iha_value / base_value if iha_value is not None and base_value else None


def fmt(value, digits=2, suffix=""):
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def mib(value):
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def summarize(
    grid: list[dict], decoding: list[dict], decode_tokens: int, packed: list[dict] = (), clock: str = "cpu"
) -> dict:
    """Medians and ratios (IHA / base) per row, in CPU time and in wall-clock time; targets in the primary `clock`."""
    for row in grid:
        flops = row["flops"]
        generation = row["generation"]
        summary = {
            "forward_flop_ratio": ratio(flops["forward"]["iha"], flops["forward"]["base"]),
            "decode_flop_ratio": ratio(flops["decode_step"]["iha"], flops["decode_step"]["base"]),
            "kv_cache_bytes": {name: record["kv_cache_bytes"] for name, record in generation.items()},
        }
        for clock_name in ("cpu", "wall"):
            forward = {name: median(times[clock_name]) for name, times in row["forward_s"].items()}
            train = {name: median(times[clock_name]) for name, times in row["train_s"].items()}
            prefill = {
                name: row["N"] / median(record[f"prefill_{clock_name}_s"]) for name, record in generation.items()
            }
            decode = {
                name: decode_tokens / median(record[f"decode_{clock_name}_s"]) for name, record in generation.items()
            }
            summary[clock_name] = {
                "forward_ms": {name: value * 1e3 for name, value in forward.items()},
                "forward_time_ratio": ratio(forward["iha"], forward["base"]),
                "train_ms": {name: value * 1e3 for name, value in train.items()},
                "train_time_ratio": ratio(train["iha"], train["base"]),
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "decode_speed_ratio": ratio(decode["iha"], decode["base"]),
            }
        row["summary"] = summary
    for row in decoding:
        flop_ratio = ratio(row["decode_step_flops"]["iha"], row["decode_step_flops"]["base"])
        generation = row["generation"]
        kv = {name: record["kv_cache_bytes"] for name, record in generation.items()}
        summary = {
            "decode_flop_ratio": flop_ratio,
            "kv_cache_bytes": kv,
            "kv_bytes_ratio": ratio(kv["iha"], kv["base"]),
        }
        for clock_name in ("cpu", "wall"):
            decode = {
                name: decode_tokens / median(record[f"decode_{clock_name}_s"]) for name, record in generation.items()
            }
            summary[clock_name] = {
                "decode_tok_s": decode,
                "decode_speed_ratio": ratio(decode["iha"], decode["base"]),
                "speed_vs_inverse_flops": ratio(decode["iha"], decode["base"]) * flop_ratio,
            }
        row["summary"] = summary
    for row in packed:
        summary = {}
        for clock_name in ("cpu", "wall"):
            times = row["train_s"]
            by_round = [iha_s / base_s for iha_s, base_s in zip(times["iha"][clock_name], times["base"][clock_name])]
            summary[clock_name] = {
                "train_ms": {name: median(record[clock_name]) * 1e3 for name, record in times.items()},
                "ratio_by_round": by_round,
                "ratio_median": median(by_round),
                "ratio_min": min(by_round),
                "ratio_max": max(by_round),
            }
        row["summary"] = summary
    return check_targets(grid, decoding, packed, clock)


def check_targets(grid: list[dict], decoding: list[dict], packed: list[dict] = (), clock: str = "cpu") -> dict:
    def find(rows, **where):
        return next((row for row in rows if all(row.get(k) == v for k, v in where.items())), None)

    other_clock = "wall" if clock == "cpu" else "cpu"
    results = {}
    row = find(packed, layout="global", P=2, documents=4, document_len=512)
    if row:
        primary, other = row["summary"][clock], row["summary"][other_clock]
        results["packed"] = {
            "target": "packed row of 4 x 512 tokens, every layer global IHA, P = 2, forward + backward: time <= 1.1 x "
            "base",
            "measured": f"{primary['ratio_median']:.2f} x base (median of {len(primary['ratio_by_round'])} rounds, "
            f"range {primary['ratio_min']:.2f} to {primary['ratio_max']:.2f}; {other_clock} "
            f"{other['ratio_median']:.2f} x)",
            "met": primary["ratio_median"] <= TARGETS["packed_train_time"],
        }
    row = find(grid, layout="global", P=2, N=2048)
    if row:
        flop_ratio = row["summary"]["forward_flop_ratio"]
        time_ratio = row["summary"][clock]["forward_time_ratio"]
        wall_ratio = row["summary"][other_clock]["forward_time_ratio"]
        results["1"] = {
            "target": "every layer global IHA, P = 2, N = 2048, forward: time ratio <= 1.15 x FLOP ratio",
            "measured": f"time ratio {time_ratio:.2f} ({other_clock} {wall_ratio:.2f}), FLOP ratio {flop_ratio:.2f}: "
            f"{time_ratio / flop_ratio:.2f} x the FLOP ratio ({other_clock} {wall_ratio / flop_ratio:.2f} x)",
            "met": time_ratio / flop_ratio <= TARGETS["forward_vs_flops"],
        }
    row = find(grid, layout="hybrid", P=2, N=2048)
    if row:
        time_ratio = row["summary"][clock]["train_time_ratio"]
        wall_ratio = row["summary"][other_clock]["train_time_ratio"]
        results["2"] = {
            "target": "paper's hybrid layout, P = 2, N = 2048, forward + backward: time <= 1.2 x base",
            "measured": f"{time_ratio:.2f} x base ({other_clock} {wall_ratio:.2f} x)",
            "met": time_ratio <= TARGETS["hybrid_train_time"],
        }
    row = find(decoding, layout="global", P=2, cache_mode="token", context=1024)
    if row:
        s = row["summary"]
        speed = s[clock]["speed_vs_inverse_flops"]
        results["3"] = {
            "target": "decoding, P = 2, every layer global IHA, 1024 tokens of context, default (token) cache mode: "
            "KV bytes <= 1.0 x base and tok/s ratio >= 0.8 x inverse decode-step FLOP ratio",
            "measured": f"KV bytes {s['kv_bytes_ratio']:.2f} x base; tok/s ratio {s[clock]['decode_speed_ratio']:.2f} "
            f"({other_clock} {s[other_clock]['decode_speed_ratio']:.2f}), inverse FLOP ratio "
            f"{1 / s['decode_flop_ratio']:.2f}: {speed:.2f} x ({other_clock} "
            f"{s[other_clock]['speed_vs_inverse_flops']:.2f} x)",
            "met": s["kv_bytes_ratio"] <= TARGETS["decode_kv_bytes"] and speed >= TARGETS["decode_speed_vs_flops"],
        }
        pseudo_row = find(decoding, layout="global", P=2, cache_mode="pseudo", context=1024)
        if pseudo_row:
            # Stricter reading: the FLOPs of the cheapest decode step (pseudo mode, no re-mixing) as the yardstick.
            minimal_flop_ratio = pseudo_row["summary"]["decode_flop_ratio"]
            results["3"]["measured"] += (
                f"; against the FLOPs of a step without re-mixing (ratio {minimal_flop_ratio:.2f}): "
                f"{s[clock]['decode_speed_ratio'] * minimal_flop_ratio:.2f} x"
            )
    return results


def markdown_report(meta: dict, grid: list[dict], decoding: list[dict], targets: dict, packed: list[dict] = ()) -> str:
    clock = meta.get("clock", "cpu")
    other_clock = "wall" if clock == "cpu" else "cpu"
    clock_text = {"cpu": "CPU time", "wall": "wall-clock time"}
    lines = [
        "# IHA vs base Llama: speed and memory",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}; {meta['threads']} torch thread(s); {meta.get('dtype', 'float32')} on "
        f"{meta.get('device', 'cpu')}, attention `{meta.get('attn_implementation', 'sdpa')}`.  ",
        f"Model: {meta['shape_name']} ({meta['shape_note']}) with **{meta['layers']} layers**, random weights; the "
        "IHA model is converted from the base model's weights. IHA options: "
        f"`iha_position_mode={meta['position_mode']!r}`, flat causal mask, per-head collapse. "
        f"Hybrid layout = the paper's 4 sliding IHA : 1 global MHA (layers {meta['global_layers_note']}), window "
        "W = N / (2 P^2) tokens"
        + (
            ", its IHA layers attending to the paper's flat window of the last W * P virtual tokens.  "
            if meta.get("window_unit") == "virtual"
            else ".  "
        ),
        f"Times: medians of {meta['repeats']} runs, base and IHA alternating, in **{clock_text[clock]}** "
        f"({clock_text[other_clock]} ratios in parentheses; all raw times in the JSON). {meta['machine_note']}",
        "",
        "Ratios are IHA / base. FLOP ratios come from `model_flops` (matmul work of an ideal kernel: attention counts "
        "only the (query, key) pairs the mask allows; the LM head is "
        f"{meta['lm_head_share']} of the base model's forward FLOPs at N = {meta['lm_head_share_at']}). A time ratio "
        "close to the FLOP ratio means the IHA kernels waste little. Prefill: the N-token prompt into an empty cache "
        f"(last logits only); decode: {meta['decode_tokens']} greedy tokens after it (batch 1). Peak memory: rise of "
        "the process's resident memory during one step, above the loaded model. KV cache: after prefill + decode.",
    ]
    if grid:
        lines += [
            "",
            "| layout | P | N | forward ms base / IHA | time ratio | FLOP ratio | fwd+bwd ms base / IHA | time ratio "
            "| prefill tok/s base / IHA | decode tok/s base / IHA | decode ratio | decode FLOP ratio "
            "| peak MiB fwd base / IHA | peak MiB fwd+bwd base / IHA | KV cache MiB base / IHA |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for row in grid:
        s, cpu, wall = row["summary"], row["summary"][clock], row["summary"][other_clock]
        layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
        lines.append(
            f"| {layout} | {row['P']} | {row['N']} "
            f"| {cpu['forward_ms']['base']:.0f} / {cpu['forward_ms']['iha']:.0f} "
            f"| {fmt(cpu['forward_time_ratio'])} ({fmt(wall['forward_time_ratio'])}) | {fmt(s['forward_flop_ratio'])} "
            f"| {cpu['train_ms']['base']:.0f} / {cpu['train_ms']['iha']:.0f} "
            f"| {fmt(cpu['train_time_ratio'])} ({fmt(wall['train_time_ratio'])}) "
            f"| {cpu['prefill_tok_s']['base']:.0f} / {cpu['prefill_tok_s']['iha']:.0f} "
            f"| {cpu['decode_tok_s']['base']:.1f} / {cpu['decode_tok_s']['iha']:.1f} "
            f"| {fmt(cpu['decode_speed_ratio'])} ({fmt(wall['decode_speed_ratio'])}) | {fmt(s['decode_flop_ratio'])} "
            f"| {mib(row['peak_memory_forward']['base'])} / {mib(row['peak_memory_forward']['iha'])} "
            f"| {mib(row['peak_memory_train']['base'])} / {mib(row['peak_memory_train']['iha'])} "
            f"| {mib(s['kv_cache_bytes']['base'])} / {mib(s['kv_cache_bytes']['iha'])} |"
        )
    if decoding:
        lines += [
            "",
            f"## Decoding with {meta['decode_context']} tokens of context: the two cache modes",
            "",
            '`iha_cache_mode="token"` (default) caches the un-mixed keys and values (the base model\'s memory) and '
            're-mixes them every step; `"pseudo"` caches the mixed pseudo keys and values (P x the memory on IHA layers) '
            "and mixes only the new token. The decode-step FLOP ratio counts each mode's own work (token mode includes "
            "the re-mixing); `speed / inverse FLOPs` = (tok/s ratio) x (FLOP ratio): 1.0 means IHA decodes exactly as "
            "much slower as its FLOPs say, more means its extra work runs more efficiently than the base model's.",
            "",
            "| layout | P | cache mode | decode tok/s base / IHA | tok/s ratio | decode-step FLOP ratio "
            "| speed / inverse FLOPs | KV cache MiB base / IHA | KV ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for row in decoding:
        s, cpu, wall = row["summary"], row["summary"][clock], row["summary"][other_clock]
        layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
        lines.append(
            f"| {layout} | {row['P']} | {row['cache_mode']} "
            f"| {cpu['decode_tok_s']['base']:.1f} / {cpu['decode_tok_s']['iha']:.1f} "
            f"| {fmt(cpu['decode_speed_ratio'])} ({fmt(wall['decode_speed_ratio'])}) | {fmt(s['decode_flop_ratio'])} "
            f"| {fmt(cpu['speed_vs_inverse_flops'])} ({fmt(wall['speed_vs_inverse_flops'])}) "
            f"| {mib(s['kv_cache_bytes']['base'])} / {mib(s['kv_cache_bytes']['iha'])} | {fmt(s['kv_bytes_ratio'])} |"
        )
    if packed:
        lines += [
            "",
            "## Training on packed rows",
            "",
            "One row of documents with restarting position ids and no attention mask (what TRL's `--packing` sends), "
            "forward + backward. IHA layers attend within each document (per document on SDPA); the base model's "
            "SDPA runs over the row with the documents' block-diagonal mask. Ratio of every round (base and IHA timed "
            "back to back, the order flipped each round), their median and range.",
            "",
            f"| layout | P | row | fwd+bwd ms base / IHA | ratio median | range | by round | {other_clock} ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in packed:
            primary, other = row["summary"][clock], row["summary"][other_clock]
            layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
            lines.append(
                f"| {layout} | {row['P']} | {row['documents']} x {row['document_len']} "
                f"| {primary['train_ms']['base']:.0f} / {primary['train_ms']['iha']:.0f} "
                f"| **{primary['ratio_median']:.3f}** | {primary['ratio_min']:.3f} - {primary['ratio_max']:.3f} "
                f"| {', '.join(f'{value:.3f}' for value in primary['ratio_by_round'])} "
                f"| {other['ratio_median']:.3f} |"
            )
    lines += ["", f"## Targets ({clock_text[clock]} ratios; {clock_text[other_clock]} in parentheses)", ""]
    if not targets:
        lines.append("(not evaluated in this run: the grid does not contain the targets' settings)")
    for number, target in targets.items():
        verdict = "**met**" if target["met"] else "**not met**"
        lines.append(f"{number}. {target['target']}: {target['measured']} -> {verdict}")
    return "\n".join(lines) + "\n"
