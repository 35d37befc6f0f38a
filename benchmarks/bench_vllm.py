"""vLLM serving IHA (the plugin, `iha.serving.vllm`) against the base Llama with the same dimensions and weights,
side by side in one run. Runs in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python benchmarks/bench_vllm.py           # writes benchmarks/results/vllm.md and vllm.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick   # seconds-long smoke run: results/vllm_quick.{md,json}
    python benchmarks/bench_vllm.py --from-json benchmarks/results/vllm.json   # the report again, from a run's JSON

Three engines live in this process at once: vLLM's own `LlamaForCausalLM` on a random Llama folder shaped like
SmolLM2-135M (`--layers` layers, its 49,152-token vocabulary), and the plugin on the IHA folder converted from those
weights (identity head mixing, shared positions: the converter's output, which a trained model differs from only in
the numbers in its tensors), once with the mixing folded into the projections (the default) and once explicit
(`hf_overrides={"iha_fold_mixing": False}`). For 8 and 32 concurrent requests (`--requests`; prompts of
`--prompt-lengths` tokens, repeated to the number of requests, arriving together) the engines take turns, the order
flipping every round, and every measurement is repeated (`--repeats`), the median reported:

- decode tokens/s: requests x `--decode-tokens` / (time of a run with `--decode-tokens` + 1 new tokens - time of a
  run with 1), so the prefill cancels out;
- time to first token: each request's, from the moment all were added, in the 1-token run (the engine is stepped by
  hand: vLLM prefills in chunks of `--max-batch-tokens`, so the requests' first tokens come one chunk after another).

Both in the process's CPU time (the engine runs in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`) and in wall-clock
time. The FLOP ratios are those of the very models benchmarked (benchmarks/flops.py's count of matmul work): one
decoding step of every request in the middle of its decoded tokens (attention over the P * (context) cached
pseudo-keys from P pseudo-queries per token, IHA's P^2 work, counted), and the prefill of every prompt; the folded
model's projections are P times wider and it mixes nothing, the explicit one projects like the base model and mixes
the new tokens' q, k and v. The target of issue 35 is decode tok/s ratio x decode FLOP ratio >= 0.8. KV-cache bytes
per token are read off each engine's cache tensors.
"""

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


# The engines run in this process; a 1 GiB KV cache each; OpenMP threads not bound to cores (a shared machine).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RESULTS_DIR, SMOLLM2_135M_SHAPE, base_model, converted_iha_model  # noqa: E402
from flops import model_flops  # noqa: E402

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


TARGET = 0.8
PROMPT_LENGTHS = [96, 160, 224, 288, 352, 416, 480, 544]
# The quick run's shape: head_dim 32, a head size vLLM's CPU kernel takes.
QUICK_VLLM_SHAPE = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
VARIANTS = {
    "base": "base Llama (vLLM's LlamaForCausalLM)",
    "iha": "IHA, mixing folded into the projections",
    "iha_explicit": "IHA, explicit mixing",
}


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a smoke run")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 32], help="concurrent requests per workload")
    parser.add_argument(
        "--prompt-lengths",
        type=int,
        nargs="+",
        default=PROMPT_LENGTHS,
        help="prompt lengths, repeated to the number of requests",
    )
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="most new tokens per step (prefill chunks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--name", help="report file names NAME.md and NAME.json (default vllm, or vllm_quick)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    parser.add_argument(
        "--from-json", type=Path, help="write the report again from a run's JSON (no engines start): NAME.md beside it"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.requests, args.prompt_lengths, args.decode_tokens, args.repeats = 2, [4], [40, 72], 8, 1
    return args


def build_folders(shape: dict, layers: int, num_pseudo_heads: int, root: Path) -> dict[str, Path]:
    """The base Llama's folder and the IHA folder converted from it (identity mixing, shared positions)."""
    base = base_model(shape, layers)
    base.save_pretrained(root / "base")
    converted_iha_model(base, shape, num_pseudo_heads, iha_position_mode="shared").save_pretrained(root / "iha")
    return {"base": root / "base", "iha": root / "iha", "iha_explicit": root / "iha"}


def start_engines(folders: dict[str, Path], args, max_len: int) -> dict:
    from vllm import LLM
    from vllm.platforms import current_platform

    settings = dict(
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=max(args.requests),
        max_num_batched_tokens=args.max_batch_tokens,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,  # every run prefills its prompts again
        seed=0,
    )
    if current_platform.is_cuda():
        # The three engines share one GPU in this process: vLLM's default would reserve 92% of its memory for the
        # first, and the next would find too little free to start. A 1 GiB KV cache each, as on the CPU.
        settings.update(gpu_memory_utilization=0.25, kv_cache_memory_bytes=2**30)
    overrides = {"iha": {"iha_fold_mixing": True}, "iha_explicit": {"iha_fold_mixing": False}}
    return {name: LLM(str(folder), hf_overrides=overrides.get(name), **settings) for name, folder in folders.items()}


def kv_bytes_per_token(llm) -> int:
    """KV-cache bytes one token takes over all layers, read off the engine's cache tensors (one block per layer)."""

    def per_layer(model):
        total = 0
        for layer in model.model.layers:
            attention = layer.self_attn.attn
            cache = attention.kv_cache[0] if isinstance(attention.kv_cache, list) else attention.kv_cache
            block = cache[
                0
            ]  # [kv heads, block size, 2 * head size] (the logical shape of the CPU and FlashAttention pages)
            total += block.numel() * block.element_size() // block.shape[1]
        return total

    return llm.apply_model(per_layer)[0]


class Run:
    """One batch of requests served by hand-stepping the engine: its times and the tokens it returned."""

    counter = 0

    def __init__(self, llm, prompts: list[list[int]], new_tokens: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = llm.llm_engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
        ids = [f"r{Run.counter + index}" for index in range(len(prompts))]
        Run.counter += len(prompts)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        first_token = {}
        self.tokens = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id not in first_token and output.outputs and output.outputs[0].token_ids:
                    first_token[output.request_id] = (time.perf_counter() - start_wall, time.process_time() - start_cpu)
                if output.finished:
                    self.tokens[output.request_id] = list(output.outputs[0].token_ids)
        self.wall = time.perf_counter() - start_wall
        self.cpu = time.process_time() - start_cpu
        self.ttft_wall = statistics.mean(first_token[request_id][0] for request_id in ids)
        self.ttft_cpu = statistics.mean(first_token[request_id][1] for request_id in ids)
        self.tokens = [self.tokens[request_id] for request_id in ids]
        if any(len(tokens) != new_tokens for tokens in self.tokens):
            raise RuntimeError(f"the engine returned {[len(t) for t in self.tokens]} tokens, not {new_tokens} each")


def folded_flops(shape, attention_types, num_tokens, past_tokens, num_pseudo_heads, logits_tokens=None) -> int:
    """FLOPs of the folded IHA model: projections P times wider, attention over the pseudo-tokens, no mixing."""
    flops = model_flops(
        shape,
        attention_types,
        num_tokens,
        past_tokens=past_tokens,
        num_pseudo_heads=num_pseudo_heads,
        cache_mode="pseudo",
        logits_tokens=logits_tokens,
    )
    return flops["total"] - flops["mixing"] + (num_pseudo_heads - 1) * flops["projections"]


def variant_flops(variant, shape, layers, num_pseudo_heads, num_tokens, past_tokens, logits_tokens=None) -> int:
    if variant == "base":
        return model_flops(shape, ["full_attention"] * layers, num_tokens, past_tokens, logits_tokens=logits_tokens)[
            "total"
        ]
    attention_types = ["iha_full_attention"] * layers
    if variant == "iha":
        return folded_flops(shape, attention_types, num_tokens, past_tokens, num_pseudo_heads, logits_tokens)
    return model_flops(
        shape,
        attention_types,
        num_tokens,
        past_tokens,
        num_pseudo_heads=num_pseudo_heads,
        cache_mode="pseudo",
        logits_tokens=logits_tokens,
    )["total"]


def workload_flops(variant, shape, args, prompt_lengths) -> dict[str, int]:
    """One decoding step of every request in the middle of its decoded tokens, and the prefill of every prompt."""
    count = (variant, shape, args.layers, args.pseudo_heads)
    return {
        "decode_step": sum(
            variant_flops(*count, 1, past_tokens=length + args.decode_tokens // 2) for length in prompt_lengths
        ),
        "prefill": sum(variant_flops(*count, length, 0, logits_tokens=1) for length in prompt_lengths),
    }


def measure(args, shape, engines) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for num_requests in args.requests:
        lengths = [args.prompt_lengths[index % len(args.prompt_lengths)] for index in range(num_requests)]
        prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
        runs = {name: {"full": [], "first": []} for name in engines}
        for llm in engines.values():  # warm-up
            Run(llm, prompts, 2)
        names = list(engines)
        for round_index in range(args.repeats):
            for name in names if round_index % 2 == 0 else names[::-1]:
                runs[name]["full"].append(Run(engines[name], prompts, args.decode_tokens + 1))
                runs[name]["first"].append(Run(engines[name], prompts, 1))
        row = {"requests": num_requests, "prompt_lengths": lengths, "variants": {}}
        for name in engines:
            full, first = runs[name]["full"], runs[name]["first"]
            decoded = num_requests * args.decode_tokens
            row["variants"][name] = {
                "times": {
                    clock: {
                        "full": [getattr(run, clock) for run in full],
                        "first_token_run": [getattr(run, clock) for run in first],
                        "ttft": [getattr(run, f"ttft_{clock}") for run in first],
                    }
                    for clock in ("cpu", "wall")
                },
                "decode_tokens_per_second": {
                    clock: decoded
                    / (
                        statistics.median(getattr(r, clock) for r in full)
                        - statistics.median(getattr(r, clock) for r in first)
                    )
                    for clock in ("cpu", "wall")
                },
                "ttft_seconds": {
                    clock: statistics.median(getattr(run, f"ttft_{clock}") for run in first)
                    for clock in ("cpu", "wall")
                },
                "flops": workload_flops(name, shape, args, lengths),
                "same_tokens_as_base": full[-1].tokens == runs["base"]["full"][-1].tokens,
            }
        rows.append(row)
    return rows


def ratios(row: dict, variant: str, clock: str) -> dict:
    base, iha = row["variants"]["base"], row["variants"][variant]
    speed = iha["decode_tokens_per_second"][clock] / base["decode_tokens_per_second"][clock]
    decode_flops = iha["flops"]["decode_step"] / base["flops"]["decode_step"]
    return {
        "speed": speed,
        "decode_flops": decode_flops,
        "speed_over_inverse_flops": speed * decode_flops,
        "ttft": iha["ttft_seconds"][clock] / base["ttft_seconds"][clock],
        "prefill_flops": iha["flops"]["prefill"] / base["flops"]["prefill"],
        "resolved": all(row["variants"][name]["decode_tokens_per_second"][clock] > 0 for name in ("base", variant)),
        "speed_over_inverse_flops_by_round": [speed * decode_flops for speed in speed_by_round(row, variant, clock)],
    }


def speed_by_round(row: dict, variant: str, clock: str) -> list[float]:
    """The decode tok/s ratio IHA / base of each round alone (the engines took turns within a round): its spread is
    the measurement's uncertainty."""

    def decode_times(name):
        times = row["variants"][name].get("times", {}).get(clock, {"full": [], "first_token_run": []})
        return [full - first for full, first in zip(times["full"], times["first_token_run"])]

    return [base / iha for base, iha in zip(decode_times("base"), decode_times(variant))]


def markdown_report(meta: dict, rows: list[dict], kv_bytes: dict[str, int]) -> str:
    lines = [
        "# vLLM: IHA (the plugin) vs the base Llama",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; vLLM {meta['vllm']} ({meta['vllm_build']}), torch "
        f"{meta['torch']}, transformers {meta['transformers']}; {meta['dtype']}; {meta['attention']}; enforce_eager "
        "(no torch.compile, no CUDA graphs); the engines inside the benchmark's process.  ",
        f"Model: {meta['shape_note']}, **{meta['layers']} layers**, random weights; IHA converted from the base "
        f"model's weights (P = {meta['P']}, identity head mixing, shared positions, flat causal mask, per-head "
        "collapse), served by the plugin folded (the default) and with the explicit mixing.  ",
        f"Workloads: {' and '.join(str(row['requests']) for row in rows)} requests arriving together, prompts of "
        f"{meta['prompt_lengths']} tokens (repeated to the number of requests), {meta['decode_tokens']} greedy decoded "
        f"tokens each, prefill in chunks of at most {meta['max_batch_tokens']} tokens per step, prefix caching off.  ",
        f"Times: medians of {meta['repeats']} runs, engines taking turns, in **CPU time** of the process (wall-clock "
        "ratios in parentheses; raw times in the JSON). Decode tok/s = requests x decoded tokens / (full run - "
        "first-token-only run); TTFT = mean over requests of the time to its first token, all added at once. "
        f"{meta['machine_note']}",
        "",
        "Ratios are IHA / base. FLOP ratios count the matmul work of these very models (benchmarks/flops.py): decode = "
        "one step of every request in the middle of its decoded tokens (attention over P x context cached "
        "pseudo-keys from P pseudo-queries: IHA's P^2 work), prefill = every prompt once. `speed / inverse FLOPs` = "
        f"tok/s ratio x decode FLOP ratio (target >= {TARGET}: IHA decodes no slower than its FLOPs say, to 20%).",
        "",
        "| requests | IHA | decode tok/s base / IHA | tok/s ratio | decode FLOP ratio | speed / inverse FLOPs | "
        "TTFT s base / IHA | TTFT ratio | prefill FLOP ratio | same tokens as base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = row["variants"]["base"]
        for variant in ("iha", "iha_explicit"):
            if variant not in row["variants"]:
                continue
            iha = row["variants"][variant]
            cpu, wall = ratios(row, variant, "cpu"), ratios(row, variant, "wall")

            def shown(summary, key):
                return f"{summary[key]:.2f}" if summary["resolved"] else "unresolved"

            lines.append(
                f"| {row['requests']} | {'folded' if variant == 'iha' else 'explicit'} | "
                f"{base['decode_tokens_per_second']['cpu']:.1f} / {iha['decode_tokens_per_second']['cpu']:.1f} | "
                f"{shown(cpu, 'speed')} ({shown(wall, 'speed')}) | {cpu['decode_flops']:.2f} | "
                f"{shown(cpu, 'speed_over_inverse_flops')} ({shown(wall, 'speed_over_inverse_flops')}) | "
                f"{base['ttft_seconds']['cpu']:.2f} / {iha['ttft_seconds']['cpu']:.2f} | {cpu['ttft']:.2f} "
                f"({wall['ttft']:.2f}) | {cpu['prefill_flops']:.2f} | {'yes' if iha['same_tokens_as_base'] else 'no'} |"
            )
    lines += [
        "",
        f"KV-cache bytes per token (all layers): base {kv_bytes['base']:,}, IHA {kv_bytes['iha']:,} "
        f"({kv_bytes['iha'] / kv_bytes['base']:.2f}x: the cache holds the P mixed pseudo-streams of every KV head).",
        "",
        "## Target of issue 35 (CPU-time ratios; wall-clock in parentheses)",
        "",
    ]
    for row in rows:
        cpu, wall = ratios(row, "iha", "cpu"), ratios(row, "iha", "wall")
        met = cpu["resolved"] and cpu["speed_over_inverse_flops"] >= TARGET
        by_round = cpu["speed_over_inverse_flops_by_round"]
        lines.append(
            f"- {row['requests']} requests, folded: decode tok/s ratio {cpu['speed']:.2f} (wall {wall['speed']:.2f}) "
            f"against an inverse FLOP ratio of {1 / cpu['decode_flops']:.2f}: {cpu['speed_over_inverse_flops']:.2f} x "
            f"(wall {wall['speed_over_inverse_flops']:.2f} x"
            + (f"; {min(by_round):.2f} to {max(by_round):.2f} over the {len(by_round)} rounds" if by_round else "")
            + f") -> **{'met' if met else 'not met'}**"
        )
    lines += [
        "",
        "Identity mixing with shared positions makes the IHA model compute the base model's function, so in float32 "
        "both decode the same tokens (last column: a check that the runs did the same work); in bfloat16 the "
        "different summation orders may part them after some tokens. A ratio reads *unresolved* where a clock's "
        "first-token-only run took as long as the full run (the decode time, their difference, is then noise).",
    ]
    return "\n".join(lines) + "\n"


def report_again(saved: Path) -> None:
    """Write `saved`'s markdown report again from its measurements (after a change to how the report reads them)."""
    run = json.loads(saved.read_text())
    report = markdown_report(run["meta"], run["rows"], run["kv_bytes_per_token"])
    write_text_atomic(report, saved.with_suffix(".md"))
    print(report)
    print(f"wrote {saved.with_suffix('.md')}")


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        report_again(args.from_json)
        return
    import transformers
    import vllm
    from vllm.platforms import current_platform

    torch.set_num_threads(1)
    on_cuda = current_platform.is_cuda()
    shape = QUICK_VLLM_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        folders = build_folders(shape, args.layers, args.pseudo_heads, Path(root))
        max_len = max(args.prompt_lengths) + args.decode_tokens + 8
        engines = start_engines(folders, args, max_len)
        kv_bytes = {name: kv_bytes_per_token(llm) for name, llm in engines.items()}
        kernel_variants = sorted(
            set(
                engines["iha"].apply_model(
                    lambda model: [getattr(layer.self_attn.attn, "isa", "?") for layer in model.model.layers]
                )[0]
            )
        )
        rows = measure(args, shape, engines)
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    for row in rows:
        variants = [variant for variant in row["variants"] if variant != "base"]
        row["ratios"] = {
            variant: {clock: ratios(row, variant, clock) for clock in ("cpu", "wall")} for variant in variants
        }
    if on_cuda:
        machine = f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
        attention = "IHA layers on FlashAttention"
    else:
        machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
        attention = f"CPU attention kernel variant {', '.join(kernel_variants)}"
    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "vllm": vllm.__version__,
        "vllm_build": "CUDA build" if on_cuda else "CPU build",
        "attention": attention,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "kernel_variants": ", ".join(kernel_variants),
        "layers": args.layers,
        "P": args.pseudo_heads,
        "shape_note": ("a tiny smoke-test shape" if args.quick else "SmolLM2-135M's shape")
        + " ("
        + ", ".join(f"{k} {v}" for k, v in shape.items() if k != "rope_parameters")
        + ")",
        "prompt_lengths": args.prompt_lengths,
        "decode_tokens": args.decode_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "repeats": args.repeats,
        "machine_note": (
            f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the run "
            f"on {os.cpu_count()} cores. {args.machine_note}"
        ).strip(),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("vllm_quick" if args.quick else "vllm")
    report = markdown_report(meta, rows, kv_bytes)
    write_text_atomic(report, args.output_dir / f"{stem}.md")
    write_text_atomic(
        json.dumps({"meta": meta, "kv_bytes_per_token": kv_bytes, "rows": rows}, indent=1),
        args.output_dir / f"{stem}.json",
    )
    print(report)
    print(f"wrote {args.output_dir / f'{stem}.md'} and {stem}.json")


if __name__ == "__main__":
    main()
