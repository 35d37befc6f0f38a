"""Long-context serving on vLLM: the paper's hybrid (4 sliding IHA layers with the flat window, then a standard global
layer) against its base model with every layer global and the paper's Global+Local baseline (the same 4:1 layout with
standard sliding layers), side by side in one run. Runs in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python benchmarks/bench_vllm_long_context.py          # results/vllm_long_context.{md,json}
    .venv-vllm/bin/python benchmarks/bench_vllm_long_context.py --quick  # a smoke run: results/vllm_long_context_quick.*
    python benchmarks/bench_vllm_long_context.py --from-json benchmarks/results/vllm_long_context.json  # the report

Resumable: every measurement is written to the JSON as it is taken, and a run started again with the same settings
skips the measurements already there (the engines start again; the report is written after every measurement).

Three engines in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as benchmarks/bench_vllm.py): vLLM's own
`LlamaForCausalLM` on a random folder shaped like SmolLM2-135M (`--layers` layers, all global: the base), the same
weights with `layer_types` making 4 of every 5 layers sliding with a window of P^2 * W tokens (Global+Local: the
FLOP-matched window, the same attention work per layer as the hybrid's IHA layers), and the plugin on the IHA hybrid
converted from the same weights (identity mixing, shared positions, the paper's window of W * P
virtual tokens; the training length 2 * P^2 * W). For 8 and 32 requests with prompts of 1x, 4x and 16x the window W,
the engines take turns, the order flipping every round. Each round takes fresh prompts, so that nothing is cached:

- time to first token: each request's, from the moment all were added (a run of 1 new token, prefix caching on);
- decode tokens/s: the same prompts again, now read from the prefix cache, once for 1 new token and once for
  `--decode-tokens` + 1: requests x decoded tokens / the difference, so the (cached) prefill cancels out;
- KV bytes per token of context: the bytes of the blocks the engine's KV-cache manager holds for the requests (every
  group's blocks times its page bytes and layers), over their tokens, at the step with the most tokens of context.

The FLOP ratios count the matmul work of these very models (benchmarks/flops.py): one decoding step of every request
in the middle of its decoded tokens, and the prefill of every prompt; the hybrid's IHA layers fold the mixing into
projections P times wider (the plugin's default) and attend over the flat window.
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


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # 32 requests of 4,096 tokens in the base model: ~1 GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RESULTS_DIR, SMOLLM2_135M_SHAPE, base_model, converted_iha_model  # noqa: E402
from bench_vllm import QUICK_VLLM_SHAPE  # noqa: E402
from flops import model_flops  # noqa: E402
from served_ratios import ratio_row, summarize, workload_key  # noqa: E402, F401

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


TARGET = 0.8
MODELS = {
    "base": "base model, every layer global (vLLM's LlamaForCausalLM)",
    "global_local": "Global+Local: 4 standard sliding layers (window P^2 W) then 1 global (vLLM's LlamaForCausalLM)",
    "hybrid": "IHA hybrid: 4 sliding IHA layers (flat window W * P virtual tokens) then 1 standard global (the plugin)",
}


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a smoke run")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256, help="the hybrid's window W in tokens")
    parser.add_argument("--global-every", type=int, default=5, help="every this many layers, one is global")
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 4, 16], help="prompt lengths in windows")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="most new tokens per step")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per KV-cache block (vLLM's CPU default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--name", help="report file names NAME.md and NAME.json")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    parser.add_argument("--from-json", type=Path, help="write the report again from a run's JSON (no engines start)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.window, args.multiples, args.requests = 5, 32, [1, 4], [4]
        args.decode_tokens, args.repeats, args.max_batch_tokens, args.block_size = 8, 1, 64, 32
    args.name = args.name or ("vllm_long_context_quick" if args.quick else "vllm_long_context")
    return args


def layer_types(args, sliding: str) -> list[str]:
    """`global_every - 1` sliding layers, then a global one (the paper's 4:1 for the default 5)."""
    return ["full_attention" if (index + 1) % args.global_every == 0 else sliding for index in range(args.layers)]


def global_local_window(args) -> int:
    return args.pseudo_heads**2 * args.window


def build_folders(shape: dict, args, root: Path) -> dict[str, Path]:
    base = base_model(shape, args.layers)
    base.save_pretrained(root / "base")
    base.config.layer_types = layer_types(args, "sliding_attention")
    base.config.sliding_window = global_local_window(args)
    base.save_pretrained(root / "global_local")
    hybrid = converted_iha_model(
        base,
        shape,
        args.pseudo_heads,
        iha_position_mode="shared",
        attention_types=layer_types(args, "iha_sliding_attention"),
        sliding_window=args.window,
    )
    hybrid.save_pretrained(root / "hybrid")
    return {name: root / name for name in MODELS}


def start_engines(folders: dict[str, Path], args) -> dict:
    from vllm import LLM

    settings = dict(
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        max_model_len=max(args.multiples) * args.window + args.decode_tokens + 8,
        max_num_seqs=max(args.requests),
        max_num_batched_tokens=args.max_batch_tokens,
        block_size=args.block_size,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        seed=0,
    )
    return {name: LLM(str(folder), **settings) for name, folder in folders.items()}


def kv_bytes_held(engine) -> tuple[int, int]:
    """(bytes of the KV-cache blocks held for the running requests, their tokens of context) right now."""
    scheduler = engine.engine_core.engine_core.scheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    groups = scheduler.kv_cache_config.kv_cache_groups
    held = 0
    for manager, group in zip(managers, groups):
        blocks = sum(not block.is_null for blocks in manager.req_to_blocks.values() for block in blocks)
        held += blocks * group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    tokens = sum(request.num_computed_tokens for request in scheduler.running)
    return held, tokens


class Run:
    """One batch of requests, the engine stepped by hand: times, time to each request's first token, prefix-cache
    hits, and the KV bytes per token of context at the step with the most context."""

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
        first_token, cached, finished = {}, {}, set()
        self.kv_bytes_per_token, most_context = None, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            held, context = kv_bytes_held(engine)
            if context > most_context:
                most_context, self.kv_bytes_per_token = context, held / context
            for output in outputs:
                if output.request_id not in first_token and output.outputs and output.outputs[0].token_ids:
                    first_token[output.request_id] = (time.perf_counter() - start_wall, time.process_time() - start_cpu)
                if output.finished:
                    finished.add(output.request_id)
                    cached[output.request_id] = output.num_cached_tokens or 0
        self.wall = time.perf_counter() - start_wall
        self.cpu = time.process_time() - start_cpu
        self.ttft_wall = statistics.mean(first_token[request_id][0] for request_id in ids)
        self.ttft_cpu = statistics.mean(first_token[request_id][1] for request_id in ids)
        self.cached_fraction = sum(cached.values()) / sum(len(prompt) for prompt in prompts)
        if finished != set(ids):
            raise RuntimeError(f"{len(ids) - len(finished)} requests did not finish")


def measure_once(llm, prompts: list[list[int]], args) -> dict:
    first = Run(llm, prompts, 1)  # fresh prompts: the prefill, nothing cached
    first_cached = Run(llm, prompts, 1)
    full_cached = Run(llm, prompts, args.decode_tokens + 1)
    return {
        clock: {
            "ttft": getattr(first, f"ttft_{clock}"),
            "first_token_run": getattr(first, clock),
            "first_token_cached": getattr(first_cached, clock),
            "full_cached": getattr(full_cached, clock),
        }
        for clock in ("cpu", "wall")
    } | {
        "cached_fraction": full_cached.cached_fraction,
        "kv_bytes_per_token": full_cached.kv_bytes_per_token,
    }


def model_layers(args, name: str) -> tuple[list[str], int | None]:
    if name == "base":
        return ["full_attention"] * args.layers, None
    if name == "global_local":
        return layer_types(args, "sliding_attention"), global_local_window(args)
    return layer_types(args, "iha_sliding_attention"), args.window


def forward_flops(shape, args, name: str, num_tokens: int, past_tokens: int, logits_tokens=None) -> int:
    """One forward's FLOPs; the hybrid's IHA layers with the mixing folded (projections P times wider, no mixing)."""
    attention_types, window = model_layers(args, name)
    total = 0
    for attention_type in attention_types:
        flops = model_flops(
            shape,
            [attention_type],
            num_tokens,
            past_tokens,
            num_pseudo_heads=args.pseudo_heads,
            sliding_window=window,
            cache_mode="pseudo",
            logits_tokens=0,
        )
        total += flops["total"]
        if attention_type.startswith("iha_"):
            total += (args.pseudo_heads - 1) * flops["projections"] - flops["mixing"]
    logits = num_tokens if logits_tokens is None else logits_tokens
    return total + 2 * logits * shape["hidden_size"] * shape["vocab_size"]


def workload_flops(shape, args, name: str, prompt_length: int, num_requests: int) -> dict[str, int]:
    past = prompt_length + args.decode_tokens // 2
    return {
        "decode_step": num_requests * forward_flops(shape, args, name, 1, past),
        "prefill": num_requests * forward_flops(shape, args, name, prompt_length, 0, logits_tokens=1),
    }


def fully_measured(workload: dict) -> bool:
    """Every model of the comparison ran at least one round of this workload."""
    return set(workload["models"]) == set(MODELS) and all(model["rounds"] for model in workload["models"].values())


def speed_table(workloads: dict) -> list[str]:
    """The speed table's lines: each fully measured workload's models against the base (CPU time, wall in
    parentheses)."""
    lines = [
        "| requests | prompt (x W) | model | decode tok/s | tok/s vs base | decode FLOPs vs base | speed / inverse "
        "FLOPs (rounds) | TTFT s | TTFT vs base | KV bytes / token | KV vs base |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in workloads.values():
        if not fully_measured(workload):
            continue
        for name in MODELS:
            summary = summarize(workload["models"][name], "cpu")
            row = f"| {workload['requests']} | {workload['prompt_length']} ({workload['multiple']}) | {name} | "
            row += f"{summary['decode_tokens_per_second']:.1f} | "
            if name == "base":
                row += f"1 | 1 | - | {summary['ttft']:.2f} | 1 | {summary['kv_bytes_per_token']:,.0f} | 1 |"
            else:
                cpu, wall = ratio_row(workload, name, "base", "cpu"), ratio_row(workload, name, "base", "wall")
                wall_speed = f"{wall['speed']:.2f}" if wall["resolved"] else "unresolved"
                row += (
                    f"{cpu['speed']:.2f} ({wall_speed}) | {cpu['decode_flops']:.2f} | "
                    f"{cpu['speed_over_inverse_flops']:.2f} ({min(cpu['by_round']):.2f} to {max(cpu['by_round']):.2f}) | "
                    f"{summary['ttft']:.2f} | {cpu['ttft']:.2f} ({wall['ttft']:.2f}) | "
                    f"{summary['kv_bytes_per_token']:,.0f} | {cpu['kv']:.2f} |"
                )
            lines.append(row)
    return lines


def target_lines(meta: dict, workloads: dict, missing: str) -> list[str]:
    """Each workload against the targets (CPU-time ratios); `missing`: what a workload not fully measured reads."""
    lines = []
    for workload in workloads.values():
        if not fully_measured(workload):
            lines.append(f"- {workload['requests']} requests, {workload['multiple']} x W: **{missing}**")
            continue
        for name in ("hybrid", "global_local"):
            cpu = ratio_row(workload, name, "base", "cpu")
            met = cpu["speed_over_inverse_flops"] >= TARGET
            lines.append(
                f"- {workload['requests']} requests, {workload['multiple']} x W, {name}: decode at "
                f"{cpu['speed_over_inverse_flops']:.2f} of the inverse FLOP ratio ({1 / cpu['decode_flops']:.2f}) -> "
                f"**{'met' if met else 'not met'}**"
            )
        if workload["multiple"] == max(meta["multiples"]):
            cpu = ratio_row(workload, "hybrid", "base", "cpu")
            lines.append(
                f"- {workload['requests']} requests, {workload['multiple']} x W: the hybrid decodes at "
                f"{cpu['speed']:.2f} x the base's speed (target >= 1: **{'met' if cpu['speed'] >= 1 else 'not met'}**) "
                f"and holds {cpu['kv']:.2f} x its KV bytes (target <= 0.5: **{'met' if cpu['kv'] <= 0.5 else 'not met'}**)"
            )
    return lines


def markdown_report(meta: dict, workloads: dict) -> str:
    window = meta["window"]
    lines = [
        "# vLLM at long context: the paper's IHA hybrid vs its all-global base and Global+Local",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; vLLM {meta['vllm']} ({meta['vllm_build']}), torch "
        f"{meta['torch']}; {meta['dtype']}; enforce_eager; the engines inside the benchmark's process.  ",
        f"Models: {meta['shape_note']}, **{meta['layers']} layers**, random weights shared by all three; "
        + "; ".join(f"*{name}*: {text}" for name, text in MODELS.items())
        + f". W = {window} tokens, P = {meta['P']} (the paper's window for a training length of "
        f"{2 * meta['P'] ** 2 * window}: W * P = {window * meta['P']} virtual tokens); Global+Local's window "
        f"{meta['P'] ** 2 * window} tokens.  ",
        f"Workloads: {meta['requests']} requests arriving together, prompts of {meta['multiples']} x W tokens (each "
        f"round fresh random tokens), {meta['decode_tokens']} greedy decoded tokens, prefill chunks of at most "
        f"{meta['max_batch_tokens']} tokens, KV blocks of {meta['block_size']} tokens, prefix caching on.  ",
        f"Times: medians over the rounds (engines in turn; {meta['rounds_done']}), in **CPU time** of the process "
        "(wall clock in parentheses). TTFT: mean over requests of the time to the first token of the uncached run. "
        "Decode tok/s: requests x decoded tokens / (the cached full run - the cached 1-token run); a clock's ratio "
        "reads *unresolved* where that difference was not positive (noise larger than the decode time). KV bytes per "
        "token: the blocks the KV-cache manager holds for the requests over their tokens of context, at the step "
        f"with the most context. {meta['machine_note']}",
        "",
        "FLOP ratios count the matmul work of these very models (benchmarks/flops.py; decode: one step of every "
        "request in the middle of its decoded tokens). `speed / inverse FLOPs` = tok/s ratio x decode FLOP ratio "
        f"(target >= {TARGET} at every context).",
        "",
        *speed_table(workloads),
        "",
        "## Targets (CPU-time ratios)",
        "",
        *target_lines(meta, workloads, missing="not measured"),
    ]
    cached = [
        summarize(model, "cpu")["cached_fraction"]
        for workload in workloads.values()
        for model in workload["models"].values()
        if model["rounds"]
    ]
    lines += [
        "",
        f"The cached runs read {min(cached):.0%} to {max(cached):.0%} of their prompt tokens from the prefix cache (vLLM "
        "computes a prompt's last block again; the decode time is "
        "the difference of two runs over the same cached prompts). The hybrid's IHA layers keep W + 1 tokens of "
        "cache each (the first pseudo-query of a token reaches back into the token W before it); vLLM's "
        "sliding-window cache manager frees the blocks that leave the window, so their KV bytes per token of context "
        "fall as the context grows, while the global layers' stay constant.",
        "",
    ]
    return "\n".join(lines)


def save(path: Path, meta: dict, workloads: dict) -> None:
    write_text_atomic(json.dumps({"meta": meta, "workloads": workloads}, indent=1) + "\n", path)
    write_text_atomic(markdown_report(meta, workloads), path.with_suffix(".md"))


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        run = json.loads(args.from_json.read_text())
        write_text_atomic(markdown_report(run["meta"], run["workloads"]), args.from_json.with_suffix(".md"))
        return
    import vllm

    torch.set_num_threads(1)
    shape = QUICK_VLLM_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    path = args.output_dir / f"{args.name}.json"
    settings = {key: getattr(args, key) for key in ("layers", "window", "global_every", "decode_tokens", "dtype")}
    settings |= {"P": args.pseudo_heads, "block_size": args.block_size, "max_batch_tokens": args.max_batch_tokens}
    workloads, meta = {}, None
    if path.exists():
        saved = json.loads(path.read_text())
        if all(saved["meta"].get(key) == value for key, value in settings.items()):
            workloads, meta = saved["workloads"], saved["meta"]
            print(
                f"resuming {path}: {sum(len(m['rounds']) for w in workloads.values() for m in w['models'].values())} "
                "measurements there"
            )
    load_at_start = os.getloadavg()[0]
    meta = meta or {
        **settings,
        "command": " ".join(
            ["python benchmarks/bench_vllm_long_context.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "vllm": vllm.__version__,
        "vllm_build": "CPU build",
        "torch": torch.__version__,
        "shape_note": ("a tiny smoke-test shape" if args.quick else "SmolLM2-135M's shape")
        + " ("
        + ", ".join(f"{k} {v}" for k, v in shape.items() if k != "rope_parameters")
        + ")",
        "requests": args.requests,
        "multiples": args.multiples,
        "load_averages": [],
    }
    meta["requests"], meta["multiples"] = args.requests, args.multiples
    for num_requests in args.requests:
        for multiple in args.multiples:
            key = workload_key(num_requests, multiple)
            workloads.setdefault(
                key,
                {
                    "requests": num_requests,
                    "multiple": multiple,
                    "prompt_length": multiple * args.window,
                    "models": {
                        name: {
                            "requests": num_requests,
                            "decode_tokens": args.decode_tokens,
                            "rounds": [],
                            "flops": workload_flops(shape, args, name, multiple * args.window, num_requests),
                        }
                        for name in MODELS
                    },
                },
            )
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        engines = start_engines(build_folders(shape, args, Path(root)), args)
        # Round by round over the workloads, so that an interrupted run has measured every workload at least once.
        for round_index in range(args.repeats):
            for key, workload in workloads.items():
                # Fresh prompts every round (drawn even for rounds already measured, so a resumed run draws the same).
                lengths = [workload["prompt_length"]] * workload["requests"]
                prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
                names = list(MODELS) if round_index % 2 == 0 else list(MODELS)[::-1]
                for name in names:
                    model = workload["models"][name]
                    if len(model["rounds"]) > round_index:
                        continue
                    model["rounds"].append(measure_once(engines[name], prompts, args))
                    counts = [len(m["rounds"]) for w in workloads.values() for m in w["models"].values()]
                    meta["rounds_done"] = f"{min(counts)} to {max(counts)} of {args.repeats} rounds per workload"
                    meta["load_averages"].append(round(os.getloadavg()[0], 1))
                    loads = meta["load_averages"]
                    meta["machine_note"] = (
                        f"Load average (1 min) {load_at_start:.1f} at the start, from {min(loads):.1f} to "
                        f"{max(loads):.1f} after the measurements, on {os.cpu_count()} cores. {args.machine_note}"
                    ).strip()
                    save(path, meta, workloads)
                    print(f"{key} round {round_index} {name}: {model['rounds'][-1]['cpu']}", flush=True)
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
