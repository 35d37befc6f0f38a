"""Continuous batching of IHA against the base Llama model with the same dimensions and weights, side by side in one run.

    python benchmarks/bench_serving.py            # writes benchmarks/results/serving.md and serving.json
    python benchmarks/bench_serving.py --quick    # seconds-long smoke run: benchmarks/results/serving_quick.{md,json}

Eight requests with prompts of different lengths (`--prompt-lengths`) arrive together and are served by transformers'
continuous batching (`generate_batch`, a paged cache sized for them, prefill in chunks of `--max-batch-tokens`); each
decodes `--decode-tokens` greedy tokens. Decoding is measured as the difference of two runs of the same requests:
with `--decode-tokens` + 1 new tokens, and with 1 (prefill and the first token only), so the prefill cancels out.
The model is shaped like SmolLM2-135M with `--layers` layers (10 by default); the base model is a random
`LlamaForCausalLM` and the IHA model is converted from its weights (identity head mixing: the speed of a trained
model, which only has other numbers in the same tensors). Both run in float32 with one torch thread on CPU, timed in
the process's CPU time (the engine's own thread included); base and IHA take turns, every measurement repeated
(`--repeats`) and reported as the median.

The decode FLOP ratio is `model_flops` (benchmarks/flops.py) of one decoding step of every request in the middle of
its decoded tokens, IHA / base: an ideal kernel's matmul work, with the re-mixing of every read-back key and value that
the token cache costs. The target (issue 21, the same `generate()` meets): tok/s ratio x FLOP ratio >= 0.8. The
paged cache's bytes are read off the engine's cache tensor for both models. The base model attends with the engine's
dense block-diagonal mask over all requests, IHA layers request by request: the report says so next to the figures.
"""

import json
import math
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from bench_common import (  # noqa: E402
    QUICK_SHAPE,
    RESULTS_DIR,
    SMOLLM2_135M_SHAPE,
    alternate,
    base_model,
    converted_iha_model,
)
from flops import model_flops  # noqa: E402

import iha  # noqa: E402
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


TARGET = 0.8


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a seconds-long smoke run")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=["global", "hybrid"], choices=["global", "hybrid"])
    parser.add_argument(
        "--prompt-lengths", type=int, nargs="+", default=[96, 160, 224, 288, 352, 416, 480, 544], help="one per request"
    )
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--max-batch-tokens", type=int, default=512, help="most new tokens per forward (prefill chunks)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady CPU times on a shared machine)"
    )
    parser.add_argument("--name", help="report file names NAME.md and NAME.json (default serving, or serving_quick)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.prompt_lengths, args.decode_tokens, args.max_batch_tokens, args.repeats = (
            2,
            [8, 12, 16, 20, 24, 28, 32, 36],
            8,
            64,
            1,
        )
    return args


def paged_cache_config(prompt_lengths: list[int], new_tokens: int, max_batch_tokens: int):
    """A paged cache holding every request whole (no request waits for pages), in blocks of 256 tokens."""
    from transformers import ContinuousBatchingConfig

    page_size = 256
    blocks = sum(math.ceil((length + new_tokens) / page_size) for length in prompt_lengths)
    return ContinuousBatchingConfig(num_blocks=blocks + 2, page_size=page_size, max_batch_tokens=max_batch_tokens)


def serving_step(model, prompts, new_tokens, cache_config, record):
    """Serve every prompt with continuous batching, `new_tokens` greedy tokens each; checks they all came back."""
    from transformers import GenerationConfig

    generation_config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def step():
        outputs = model.generate_batch(
            prompts, generation_config=generation_config, continuous_batching_config=cache_config, progress_bar=False
        )
        lengths = [len(output.generated_tokens) for output in outputs.values()]
        if lengths != [new_tokens] * len(prompts):
            raise RuntimeError(f"continuous batching returned {lengths} tokens, not {new_tokens} for each request")
        record["tokens"] = [output.generated_tokens for output in outputs.values()]

    return step


def paged_cache_bytes(model, prompts, cache_config) -> int:
    """Bytes of the paged cache tensor the engine allocates for `model` (read off its `PagedAttentionCache`)."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    caches, original_init = [], PagedAttentionCache.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(self)

    PagedAttentionCache.__init__ = recording_init
    try:
        serving_step(model, prompts[:1], 1, cache_config, {})()
    finally:
        PagedAttentionCache.__init__ = original_init
    return caches[0].cache_tensor.nbytes


def layout_options(layout: str, num_layers: int, num_pseudo_heads: int, prompt_lengths: list[int]) -> dict:
    if layout == "global":
        return {}
    # The paper's window W = N / (2 P^2) for the longest prompt as N, over the last W * P virtual tokens.
    return iha.paper_hybrid_layout(num_layers, num_pseudo_heads, training_length=max(prompt_lengths))


def decode_step_flops(shape, attention_types, prompt_lengths, decode_tokens, **flop_kwargs) -> int:
    """FLOPs of one decoding step of every request, in the middle of its decoded tokens."""
    return sum(
        model_flops(shape, attention_types, 1, past_tokens=length + decode_tokens // 2, **flop_kwargs)["total"]
        for length in prompt_lengths
    )


def measure(args, shape, base, progress) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=generator).tolist() for n in args.prompt_lengths]
    cache_config = paged_cache_config(args.prompt_lengths, args.decode_tokens + 1, args.max_batch_tokens)
    rows = []
    for layout in args.layouts:
        progress.set_description(f"continuous batching, {layout} IHA P={args.pseudo_heads}")
        options = layout_options(layout, args.layers, args.pseudo_heads, args.prompt_lengths)
        model = converted_iha_model(base, shape, args.pseudo_heads, iha_position_mode="shared", **options)
        records = {name: {} for name in ("base_full", "iha_full", "base_prefill", "iha_prefill")}
        steps = {
            "base_full": serving_step(base, prompts, args.decode_tokens + 1, cache_config, records["base_full"]),
            "iha_full": serving_step(model, prompts, args.decode_tokens + 1, cache_config, records["iha_full"]),
            "base_prefill": serving_step(base, prompts, 1, cache_config, records["base_prefill"]),
            "iha_prefill": serving_step(model, prompts, 1, cache_config, records["iha_prefill"]),
        }
        for step in steps.values():  # warm-up, and the first tokens of every request
            step()
        times = alternate(steps, args.repeats)
        medians = {name: {clock: statistics.median(v) for clock, v in clocks.items()} for name, clocks in times.items()}
        decoded = len(prompts) * args.decode_tokens
        throughput = {
            name: {
                clock: decoded / (medians[f"{name}_full"][clock] - medians[f"{name}_prefill"][clock])
                for clock in ("cpu", "wall")
            }
            for name in ("base", "iha")
        }
        flop_kwargs = dict(num_pseudo_heads=args.pseudo_heads, sliding_window=options.get("sliding_window"))
        flops = {
            "base": decode_step_flops(shape, ["full_attention"] * args.layers, args.prompt_lengths, args.decode_tokens),
            "iha": decode_step_flops(
                shape, model.config.attention_types, args.prompt_lengths, args.decode_tokens, **flop_kwargs
            ),
        }
        rows.append(
            {
                "layout": layout,
                "P": args.pseudo_heads,
                "sliding_window": options.get("sliding_window"),
                "times": times,
                "decode_tokens_per_second": throughput,
                "decode_step_flops": flops,
                "cache_bytes": {
                    "base": paged_cache_bytes(base, prompts, cache_config),
                    "iha": paged_cache_bytes(model, prompts, cache_config),
                },
                "identical_tokens": records["iha_full"]["tokens"] == records["base_full"]["tokens"],
            }
        )
        progress.update(1)
        del model
    return rows


def decode_time_resolved(row: dict, clock: str) -> bool:
    """Whether both models' decode times on `clock` (full run minus prefill-only run) came out positive."""
    return all(row["decode_tokens_per_second"][name][clock] > 0 for name in ("base", "iha"))


def resolved(row: dict, clock: str, summary: dict, key: str) -> str:
    """`summary[key]` to two decimals, or "unresolved" where the clock's decode times are noise."""
    return f"{summary[key]:.2f}" if decode_time_resolved(row, clock) else "unresolved"


def summary_of(row: dict, clock: str) -> dict:
    throughput = row["decode_tokens_per_second"]
    ratio = throughput["iha"][clock] / throughput["base"][clock]
    flop_ratio = row["decode_step_flops"]["iha"] / row["decode_step_flops"]["base"]
    return {"ratio": ratio, "flop_ratio": flop_ratio, "speed_over_inverse_flops": ratio * flop_ratio}


def markdown_report(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Continuous batching: IHA vs base Llama",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; "
        f"{meta['threads']} torch thread(s); float32; attention: sdpa.  ",
        f"Model: {meta['shape_note']}, **{meta['layers']} layers**, random weights; the IHA model is converted from the "
        "base model's weights (identity head mixing, shared positions, flat causal mask, per-head collapse; token cache "
        "mode). Hybrid layout = the paper's 4 sliding IHA : 1 global MHA, W = N / (2 P^2) tokens with N the longest "
        "prompt, its IHA layers attending to the paper's flat window of the last W * P virtual tokens.  ",
        f"Workload: {len(meta['prompt_lengths'])} requests arriving together, prompts of {meta['prompt_lengths']} "
        f"tokens, {meta['decode_tokens']} greedy tokens each, `generate_batch` with a paged cache of "
        f"{meta['cache_blocks']} blocks of 256 tokens and at most {meta['max_batch_tokens']} new tokens per forward.  ",
        f"Times: medians of {meta['repeats']} runs, base and IHA alternating, in **CPU time** of the process (the "
        "engine's thread included; wall-clock ratios in parentheses, all raw times in the JSON). Decode tok/s = "
        "requests x decoded tokens / (time of the full run - time of a prefill-only run of the same requests). "
        f"{meta['machine_note']}",
        "",
        "Decode FLOP ratio: `model_flops` of one decoding step of every request in the middle of its decoded tokens, "
        "IHA / base (ideal kernel, token cache mode's re-mixing of every read-back key and value included). "
        "`speed / inverse FLOPs` = tok/s ratio x FLOP ratio: 1.0 means IHA decodes exactly as much slower as its FLOPs "
        f"say; the target is >= {TARGET}. Kernels differ: the base model's layers run the engine's attention, one "
        "dense masked product over all requests' keys (block-diagonal mask, every pair across requests computed and "
        "thrown away), while IHA layers attend request by request (`per_request_attention` in iha/attention/continuous_batching.py). "
        "Part of IHA's ratio is therefore the engine's waste on the base model's side, not IHA's own cost; the "
        "paged cache, projections, MLP and LM head are the same code for both.",
        "",
        "| layout | P | decode tok/s base / IHA | tok/s ratio | decode FLOP ratio | speed / inverse FLOPs | paged cache "
        "MiB base / IHA | same tokens as base |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cpu, wall = summary_of(row, "cpu"), summary_of(row, "wall")
        throughput = row["decode_tokens_per_second"]
        wall_ratio, wall_speed = (
            resolved(row, "wall", wall, "ratio"),
            resolved(row, "wall", wall, "speed_over_inverse_flops"),
        )
        layout = "global IHA" if row["layout"] == "global" else f"hybrid (W = {row['sliding_window']})"
        cache = row["cache_bytes"]
        lines.append(
            f"| {layout} | {row['P']} | {throughput['base']['cpu']:.1f} / {throughput['iha']['cpu']:.1f} | "
            f"{resolved(row, 'cpu', cpu, 'ratio')} ({wall_ratio}) | {cpu['flop_ratio']:.2f} | "
            f"{resolved(row, 'cpu', cpu, 'speed_over_inverse_flops')} ({wall_speed}) | "
            f"{cache['base'] / 2**20:.1f} / {cache['iha'] / 2**20:.1f} | {'yes' if row['identical_tokens'] else 'no'} |"
        )
    target_rows = [row for row in rows if row["layout"] == "global"]
    if target_rows:
        row = target_rows[0]
        cpu, wall = summary_of(row, "cpu"), summary_of(row, "wall")
        met = (
            decode_time_resolved(row, "cpu")
            and cpu["speed_over_inverse_flops"] >= TARGET
            and row["cache_bytes"]["iha"] <= row["cache_bytes"]["base"]
        )
        lines += [
            "",
            "## Target of issue 21 (CPU-time ratios; wall-clock in parentheses)",
            "",
            f"Every layer global IHA, P = {row['P']}, 8 concurrent requests under continuous batching: tok/s ratio >= "
            f"{TARGET} x the inverse decode FLOP ratio, paged cache bytes <= base: tok/s ratio "
            f"{resolved(row, 'cpu', cpu, 'ratio')} (wall {resolved(row, 'wall', wall, 'ratio')}), inverse FLOP ratio "
            f"{1 / cpu['flop_ratio']:.2f}: {resolved(row, 'cpu', cpu, 'speed_over_inverse_flops')} x (wall "
            f"{resolved(row, 'wall', wall, 'speed_over_inverse_flops')} x); paged cache "
            f"{row['cache_bytes']['iha'] / 2**20:.1f} MiB "
            f"vs {row['cache_bytes']['base'] / 2**20:.1f} MiB -> **{'met' if met else 'not met'}**",
        ]
    lines += [
        "",
        "A ratio reads *unresolved* where a clock's prefill-only run took as long as the full run or longer (the "
        "decode time, their difference, is then noise: a loaded machine's wall clock). "
        "Identity mixing makes the global IHA model compute the base model's function, so both decode the same "
        "tokens (last column: a check that the runs did the same work); the hybrid layout adds sliding windows the "
        "base model does not have, so its tokens differ.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    bench_common.use_device("cpu", "float32")
    bench_common.ALLOCATOR.for_timing()
    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    base = base_model(shape, args.layers)
    load_at_start = os.getloadavg()[0]
    with tqdm(total=len(args.layouts), unit="layout") as progress:
        rows = measure(args, shape, base, progress)
    cache_config = paged_cache_config(args.prompt_lengths, args.decode_tokens + 1, args.max_batch_tokens)
    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "shape_note": ("a tiny smoke-test shape" if args.quick else "SmolLM2-135M's shape")
        + " ("
        + ", ".join(f"{k} {v}" for k, v in shape.items() if k != "rope_parameters")
        + ")",
        "prompt_lengths": args.prompt_lengths,
        "decode_tokens": args.decode_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "cache_blocks": cache_config.num_blocks,
        "repeats": args.repeats,
        "machine_note": (
            f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the run "
            f"on {os.cpu_count()} cores. {args.machine_note}"
        ).strip(),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("serving_quick" if args.quick else "serving")
    report = markdown_report(meta, rows)
    write_text_atomic(report, args.output_dir / f"{stem}.md")
    write_text_atomic(json.dumps({"meta": meta, "rows": rows}, indent=1), args.output_dir / f"{stem}.json")
    print(report)
    print(f"wrote {args.output_dir / f'{stem}.md'} and {stem}.json")


if __name__ == "__main__":
    main()
