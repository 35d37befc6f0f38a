"""The paper's layout served by vLLM on the real model: SmolLM2-135M-Instruct (30 layers, its own weights) as the base
(every layer global), the paper's IHA hybrid converted from it (4 sliding IHA layers with the flat window of W * P
virtual tokens, then a standard global layer; the plugin) and Global+Local (the same pattern with standard sliding
layers and the FLOP-matched window P^2 * W; vLLM's own LlamaForCausalLM reading `layer_types`), side by side in one
run (issue 54). Runs in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python benchmarks/bench_vllm_layouts.py                  # results/vllm_layouts.{md,json}
    .venv-vllm/bin/python benchmarks/bench_vllm_layouts.py --quick          # a smoke run on a tiny random model
    python benchmarks/bench_vllm_layouts.py --from-json benchmarks/results/vllm_layouts.json   # the report again

Two parts, each resumable (every measurement is written to the JSON as it is taken; a run started again with the same
settings skips what is there):

1. **Speed** (`benchmarks/bench_vllm_long_context.py`'s measurement, on the real weights): for 8 and 32 requests with
   prompts of 1x, 4x and 16x W, the three engines take turns (the order flipping every round, fresh random prompts
   every round): time to first token, decode tokens/s (the cached full run minus the cached 1-token run), KV bytes
   per token of context (the blocks the KV-cache manager holds, at the step with the most context). Each engine's
   KV cache is sized to hold all 32 requests at 16x W.
2. **Concurrency under one KV budget**: three engines with the same KV cache bytes (`--kv-budget-mib`); for each
   prompt length, more requests than the budget can hold arrive at once (`--concurrency-decode-tokens` new tokens
   each), and the measure is the largest number of requests decoding at the same step (every prompt token computed),
   with the preemptions counted. Beside it, what vLLM's own capacity figure implies: its logged "KV cache size in
   tokens" over the tokens of one request (which counts every group's blocks for a whole `max_model_len` request and
   so understates what sliding layers free).

`--profile` adds a torch profile of the hybrid's and the base's decoding at 1x W with 32 requests (the short-context
case), written next to the report as `<name>_profile.txt`.
"""

import json
import math
import os
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RESULTS_DIR  # noqa: E402
from bench_vllm import QUICK_VLLM_SHAPE  # noqa: E402
from bench_vllm_long_context import (  # noqa: E402
    TARGET,
    Run,
    kv_bytes_held,
    layer_types,
    measure_once,
    speed_table,
    target_lines,
    workload_flops,
)
from served_ratios import round_loads, rounds_text, summarize, workload_key  # noqa: E402

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


# Every engine gets its KV cache size in bytes (`kv_cache_memory_bytes`); vLLM's CPU platform would replace it with
# VLLM_CPU_KVCACHE_SPACE's whole GiB where that is set (the benchmarks imported above set it by default).
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


MODELS = {
    "base": "SmolLM2-135M-Instruct as it is, every layer global (vLLM's LlamaForCausalLM)",
    "global_local": "Global+Local: the same weights, 4 standard sliding layers (window P^2 W) then 1 global "
    "(vLLM's LlamaForCausalLM with `layer_types`)",
    "hybrid": "the paper's IHA hybrid converted from it (`iha-convert --layers hybrid`): 4 sliding IHA layers "
    "(flat window W * P virtual tokens) then 1 standard global (the plugin)",
}
GIB = 1024**3
MIB = 1024**2


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model and short prompts: a smoke run")
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256, help="the hybrid's window W in tokens")
    parser.add_argument("--global-every", type=int, default=5, help="every this many layers, one is global")
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 4, 16], help="prompt lengths in windows")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the speed part")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="most new tokens per step")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per KV-cache block (vLLM's CPU default)")
    parser.add_argument("--kv-budget-mib", type=int, default=1024, help="the concurrency part's KV cache, per engine")
    parser.add_argument("--concurrency-decode-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=512, help="the concurrency engines' request limit")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--parts", nargs="+", default=["speed", "concurrency"], choices=["speed", "concurrency"])
    parser.add_argument(
        "--profile", action="store_true", help="profile decoding at 1x W with the most --requests (a speed part's)"
    )
    parser.add_argument("--name", help="report file names NAME.md and NAME.json")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    parser.add_argument("--from-json", type=Path, help="write the report again from a run's JSON (no engines start)")
    args = parser.parse_args(argv)
    if args.profile and "speed" not in args.parts:
        parser.error("--profile runs with the speed part's engines: add speed to --parts")
    if args.quick:
        args.window, args.multiples, args.requests, args.decode_tokens = 32, [1, 4], [4], 8
        args.repeats, args.max_batch_tokens, args.block_size, args.kv_budget_mib = 1, 64, 32, 16
        args.concurrency_decode_tokens, args.max_num_seqs = 4, 64
    args.name = args.name or ("vllm_layouts_quick" if args.quick else "vllm_layouts")
    return args


# --------------------------------------------------------------------------------------------------------------------
# The three folders
# --------------------------------------------------------------------------------------------------------------------


def source_model(args):
    """The base model: the built-in SmolLM2-135M-Instruct, or for --quick a tiny random Llama of 5 layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.quick:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**QUICK_VLLM_SHAPE, num_hidden_layers=5)).eval()
    from iha.conversion.builtin import smollm2_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()


def build_folders(args, root: Path) -> dict[str, Path]:
    from iha.conversion import llama_to_iha

    base = source_model(args)
    args.layers = base.config.num_hidden_layers
    args.shape = {
        key: getattr(base.config, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    base.save_pretrained(root / "base")
    hybrid = llama_to_iha(
        base,
        num_pseudo_heads=args.pseudo_heads,
        layers="hybrid",
        training_length=2 * args.pseudo_heads**2 * args.window,
    )
    hybrid.save_pretrained(root / "hybrid")
    base.config.layer_types = layer_types(args, "sliding_attention")
    base.config.sliding_window = args.pseudo_heads**2 * args.window
    base.save_pretrained(root / "global_local")
    return {name: root / name for name in MODELS}


def kv_bytes_needed(args, name: str, tokens: int, prefilling: bool = False) -> int:
    """The KV bytes one request of `tokens` tokens holds at most: every global layer all its tokens, a sliding layer
    its window and one block more (while it decodes) or a chunk of prefill more (while it prefills: `prefilling`),
    IHA layers P pseudo-keys per token (the plugin's cache), rounded up to whole blocks."""
    per_token = 2 * args.shape["num_key_value_heads"] * args.shape["head_dim"] * (2 if args.dtype == "bfloat16" else 4)
    total = 0
    for kind in model_layer_types(args, name):
        kept = tokens
        if "sliding" in kind:
            window = args.window + 1 if kind.startswith("iha_") else args.pseudo_heads**2 * args.window
            kept = min(tokens, window + (args.max_batch_tokens if prefilling else args.block_size))
        blocks = math.ceil(kept / args.block_size) + 1
        total += blocks * args.block_size * per_token * (args.pseudo_heads if kind.startswith("iha_") else 1)
    return total


def speed_kv_bytes(args, name: str, max_length: int) -> int:
    """A KV cache that holds every request of the largest workload at once, one of them prefilling, with a tenth to
    spare."""
    requests = max(args.requests)
    need = (requests - 1) * kv_bytes_needed(args, name, max_length) + kv_bytes_needed(args, name, max_length, True)
    return int(1.1 * need)


def model_layer_types(args, name: str) -> list[str]:
    if name == "base":
        return ["full_attention"] * args.layers
    return layer_types(args, "sliding_attention" if name == "global_local" else "iha_sliding_attention")


def engine_settings(args, max_model_len: int, max_num_seqs: int, kv_bytes: int) -> dict:
    return dict(
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_batch_tokens,
        block_size=args.block_size,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
    )


def start_engine(folder: Path, settings: dict):
    from vllm import LLM

    return LLM(str(folder), **settings)


def stop_engines(engines: dict) -> None:
    import gc

    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()


# --------------------------------------------------------------------------------------------------------------------
# Concurrency under one KV budget
# --------------------------------------------------------------------------------------------------------------------


def vllm_capacity(engine) -> dict:
    """vLLM's own capacity figures for this engine: its KV cache size in tokens and the concurrency it logs for
    `max_model_len` tokens per request."""
    cache_config = engine.llm_engine.vllm_config.cache_config
    return {
        "kv_cache_size_tokens": cache_config.kv_cache_size_tokens,
        "max_concurrency_at_max_model_len": cache_config.kv_cache_max_concurrency,
        "num_blocks": engine.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks,
    }


def measure_concurrency(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """All `prompts` arrive at once; the engine steps until they are done. Returns the most requests decoding at one
    step (all their prompt tokens computed), the most running, the preemptions and the steps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
    ids = [f"c{Run.counter + index}" for index in range(len(prompts))]
    Run.counter += len(prompts)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    most_decoding = most_running = steps = 0
    preempted = set()
    most_kv = (0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = scheduler.running
        decoding = sum(request.num_computed_tokens >= request.num_prompt_tokens for request in running)
        most_decoding, most_running = max(most_decoding, decoding), max(most_running, len(running))
        preempted |= {request.request_id for request in running if getattr(request, "num_preemptions", 0)}
        held, context = kv_bytes_held(engine)
        if context > most_kv[1]:
            most_kv = (held, context)
    return {
        "submitted": len(prompts),
        "most_decoding": most_decoding,
        "most_running": most_running,
        "preempted_requests": len(preempted),
        "steps": steps,
        "kv_bytes_per_token_at_most_context": most_kv[0] / most_kv[1] if most_kv[1] else None,
    }


def concurrency_workload(args, name: str, multiple: int, budget: int) -> tuple[int, int, int]:
    """(requests sent, prompt tokens, new tokens each) for one model and prompt length: half again as many requests as
    the budget holds by `kv_bytes_needed`'s bound, each decoding long enough that the last one's prefill (at
    `--max-batch-tokens` per step) ends before the first one's decoding: so that the requests pile up until the KV
    budget, not the prefill, stops the engine from taking more."""
    length = multiple * args.window
    estimate = budget // kv_bytes_needed(args, name, length + args.concurrency_decode_tokens)
    count = min(args.max_num_seqs, max(4, int(1.5 * estimate) + 4))
    # Decoding takes one token of each step's budget per running request: count at most half the budget as prefill.
    prefill_per_step = max(args.max_batch_tokens - count, args.max_batch_tokens // 2)
    new_tokens = math.ceil(count * length / prefill_per_step) + args.concurrency_decode_tokens
    return count, length, new_tokens


def concurrency_part(args, folders: dict, run: dict, save_run, generator) -> None:
    part = run.setdefault("concurrency", {"budget_bytes": args.kv_budget_mib * MIB, "results": {}})
    for name in MODELS:
        todo = [multiple for multiple in args.multiples if str(multiple) not in part["results"].get(name, {})]
        if not todo:
            continue
        workloads = {multiple: concurrency_workload(args, name, multiple, part["budget_bytes"]) for multiple in todo}
        max_length = max(length + new_tokens for _, length, new_tokens in workloads.values()) + 8
        settings = engine_settings(args, max_length, args.max_num_seqs, part["budget_bytes"])
        engine = start_engine(folders[name], settings)
        capacity = vllm_capacity(engine)
        for multiple, (count, length, new_tokens) in workloads.items():
            prompts = [
                torch.randint(3, args.shape["vocab_size"], (length,), generator=generator).tolist()
                for _ in range(count)
            ]
            print(f"concurrency {name} {multiple} x W: {count} requests of {length} + {new_tokens} tokens", flush=True)
            result = measure_concurrency(engine, prompts, new_tokens)
            result["vllm_implied"] = capacity["kv_cache_size_tokens"] / (length + new_tokens)
            result["vllm_capacity"] = capacity
            result["prompt_length"] = length
            result["new_tokens"] = new_tokens
            result["load_average"] = round(os.getloadavg()[0], 1)
            part["results"].setdefault(name, {})[str(multiple)] = result
            save_run()
            print(
                f"  most decoding at once: {result['most_decoding']} (vLLM's figure implies "
                f"{result['vllm_implied']:.1f}); preempted {result['preempted_requests']}",
                flush=True,
            )
        stop_engines({name: engine})


# --------------------------------------------------------------------------------------------------------------------
# Speed
# --------------------------------------------------------------------------------------------------------------------


def speed_part(args, folders: dict, run: dict, save_run, generator) -> None:
    workloads = run.setdefault("workloads", {})
    # Only the workloads asked for now run: a resumed run with fewer `--requests` / `--multiples` measures those
    # cells and keeps the others as they are.
    chosen = [workload_key(count, multiple) for count in args.requests for multiple in args.multiples]
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
                            "flops": workload_flops(args.shape, args, name, multiple * args.window, num_requests),
                        }
                        for name in MODELS
                    },
                },
            )
    # Every round measured: the engines start only for a profile still asked for.
    if all(len(m["rounds"]) >= args.repeats for key in chosen for m in workloads[key]["models"].values()):
        if not args.profile:
            return
    max_length = max(args.multiples) * args.window + args.decode_tokens + 8
    longest = max(args.requests)
    engines = {}
    for name in MODELS:
        kv_bytes = speed_kv_bytes(args, name, max_length)
        engines[name] = start_engine(folders[name], engine_settings(args, max_length, longest, kv_bytes))
        run.setdefault("speed_kv_bytes", {})[name] = kv_bytes
    # Fresh prompts every round, drawn even for rounds already measured, so that a resumed run draws the same.
    for round_index in range(args.repeats):
        for key in chosen:
            workload = workloads[key]
            lengths = [workload["prompt_length"]] * workload["requests"]
            prompts = [torch.randint(3, args.shape["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
            names = list(MODELS) if round_index % 2 == 0 else list(MODELS)[::-1]
            for name in names:
                model = workload["models"][name]
                if len(model["rounds"]) > round_index:
                    continue
                model["rounds"].append(measure_once(engines[name], prompts, args))
                model["rounds"][-1]["load_average"] = round(os.getloadavg()[0], 1)
                save_run()
                print(f"{key} round {round_index} {name}: {model['rounds'][-1]['cpu']}", flush=True)
    if args.profile:
        profile_decode(args, engines, generator)
    stop_engines(engines)


def profile_decode(args, engines: dict, generator) -> None:
    """Where decoding at 1x W spends its CPU time, the hybrid against the base, with the most requests asked for (32
    by default): torch's profiler around the cached full run, top operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [
        torch.randint(3, args.shape["vocab_size"], (args.window,), generator=generator).tolist()
        for _ in range(max(args.requests))
    ]
    sections = []
    for name in ("base", "hybrid"):
        Run(engines[name], prompts, 1)  # prefill into the prefix cache
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            run = Run(engines[name], prompts, args.decode_tokens + 1)
        table = profiler.key_averages(group_by_input_shape=False).table(sort_by="self_cpu_time_total", row_limit=30)
        # What the prefix cache did not hold is prefilled inside the profile: say how much, since it differs by model.
        sections.append(
            f"## {name}: {len(prompts)} requests, {args.window} prompt tokens ({run.cached_fraction:.0%} of them read "
            f"from the prefix cache, the rest prefilled inside this profile), {args.decode_tokens + 1} new tokens"
            f"\n\n```\n{table}\n```\n"
        )
    path = args.output_dir / f"{args.name}_profile.txt"
    write_text_atomic("\n".join(sections), path)
    print(f"wrote {path}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def loads_of(run: dict) -> list[float]:
    loads = [load for _, _, load in round_loads(run.get("workloads", {}))]
    loads += [r["load_average"] for m in run.get("concurrency", {}).get("results", {}).values() for r in m.values()]
    return loads


def cell_loads_line(workloads: dict) -> str:
    """The 1-minute load average after each speed cell's rounds (its engines in turn), cell by cell: the cells were
    measured by different calls, beside different work."""
    by_cell = {}
    for key, _, load in round_loads(workloads):
        by_cell.setdefault(key, []).append(load)
    cells = []
    for key, loads in by_cell.items():
        requests, multiple = key.split("x")
        cells.append(f"{requests} requests at {multiple}x W: {min(loads):.1f}-{max(loads):.1f}")
    return "Load average (1 min) after each cell's measurements: " + "; ".join(cells) + "." if cells else ""


def concurrency_table(part: dict) -> list[str]:
    results = part.get("results", {})
    if not results:
        return ["Not measured yet."]
    lines = [
        f"KV cache of {part['budget_bytes'] / MIB:,.0f} MiB per engine. Most requests decoding at one step (all "
        "prompt tokens computed), against the base; vLLM's figure = its logged KV cache size in tokens / the tokens "
        "of one request.",
        "",
        "| prompt + new tokens (x W) | model | requests sent | most decoding at once | vs base | vLLM's figure | "
        "preempted | "
        "KV blocks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    multiples = sorted({int(m) for entries in results.values() for m in entries})
    for multiple in multiples:
        base = results.get("base", {}).get(str(multiple))
        for name in MODELS:
            entry = results.get(name, {}).get(str(multiple))
            if entry is None:
                continue
            versus = f"{entry['most_decoding'] / base['most_decoding']:.2f}" if base and base["most_decoding"] else "-"
            lines.append(
                f"| {entry['prompt_length']} + {entry['new_tokens']} ({multiple}) | {name} | {entry['submitted']} | "
                f"{entry['most_decoding']} | "
                f"{versus} | {entry['vllm_implied']:.1f} | {entry['preempted_requests']} | "
                f"{entry['vllm_capacity']['num_blocks']} |"
            )
    return lines


NOTES_PER_CALL = "What ran beside the benchmark is in each call's `--machine-note` above, for the cells it measured."


def cached_line(workloads: dict) -> str:
    """How much of each model's prompts the cached runs read from vLLM's prefix cache, cell by cell: the decode time
    is the difference of two runs over the same prompts, so what is computed again cancels out of it, but a model
    that caches less of a prompt pays that again on every repeated prompt."""
    cells = []
    for workload in workloads.values():
        fractions = {
            name: summarize(model, "cpu")["cached_fraction"]
            for name, model in workload["models"].items()
            if model["rounds"]
        }
        if fractions:
            shares = " / ".join(f"{name} {fraction:.0%}" for name, fraction in fractions.items())
            cells.append(f"{workload['requests']} requests at {workload['multiple']}x W: {shares}")
    if not cells:
        return ""
    return (
        "Prompt tokens the cached runs read from vLLM's prefix cache (vLLM computes a prompt's last block again; where a "
        "model reads less, the rest is prefilled again in both cached runs): " + "; ".join(cells) + "."
    )


def markdown_report(run: dict) -> str:
    meta = run["meta"]
    loads = loads_of(run)
    load_text = (
        f"Load average (1 min) {meta['load_at_start']:.1f} at the start, {min(loads):.1f} to {max(loads):.1f} "
        f"after the measurements, on {meta['cores']} cores."
        if loads
        else ""
    )
    lines = [
        "# vLLM on the real model: the paper's IHA hybrid vs its all-global base and Global+Local",
        "",
        f"Command: `{meta['command']}`  ",
        *(f"Resumed with: `{command}` ({date})  " for command, date in meta.get("resumed_with", [])),
        f"Date: {meta['date']}; machine: {meta['machine']}; vLLM {meta['vllm']} (CPU build), torch {meta['torch']}; "
        f"{meta['dtype']}; enforce_eager; the engines inside the benchmark's process, one torch thread.  ",
        f"Models: {meta['model_note']}; "
        + "; ".join(f"*{name}*: {text}" for name, text in MODELS.items())
        + f". W = {meta['window']} tokens, P = {meta['P']} (the paper's window for a training length of "
        f"{2 * meta['P'] ** 2 * meta['window']:,}); Global+Local's window {meta['P'] ** 2 * meta['window']} tokens.  ",
        # A resumed run's calls each carry their own note (in their commands above): no one note speaks for all.
        f"{load_text} {meta['machine_note'] if not meta.get('resumed_with') else NOTES_PER_CALL}".strip(),
        "",
        "## Speed",
        "",
        f"{meta['requests']} requests arriving together, prompts of {meta['multiples']} x W tokens (fresh random "
        f"tokens every round), {meta['decode_tokens']} greedy decoded tokens, prefill chunks of at most "
        f"{meta['max_batch_tokens']} tokens, KV blocks of {meta['block_size']} tokens, prefix caching on; medians "
        f"over the rounds measured ({rounds_text(run.get('workloads', {}))} per cell), engines in turn, **CPU time** of the process (wall clock in parentheses). "
        "TTFT: the mean over requests of the time to the first token of the uncached run. Decode tok/s: requests x "
        "decoded tokens / (the cached full run - the cached 1-token run). KV bytes per token: the blocks the "
        "KV-cache manager holds over the tokens of context, at the step with the most context. FLOP ratios count "
        "these models' matmul work (benchmarks/flops.py); `speed / inverse FLOPs` = tok/s ratio x decode FLOP "
        f"ratio (target >= {TARGET}).",
        "",
        *speed_table(run.get("workloads", {})),
        "",
        cell_loads_line(run.get("workloads", {})),
        "",
        cached_line(run.get("workloads", {})),
        "",
        "### Targets (CPU-time ratios)",
        "",
        *target_lines(meta, run.get("workloads", {}), missing="not measured yet"),
        "",
        "## Concurrency under one KV budget",
        "",
        *concurrency_table(run.get("concurrency", {})),
        "",
    ]
    return "\n".join(lines)


def save(path: Path, run: dict) -> None:
    write_text_atomic(json.dumps(run, indent=1) + "\n", path)
    write_text_atomic(markdown_report(run), path.with_suffix(".md"))


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        run = json.loads(args.from_json.read_text())
        write_text_atomic(markdown_report(run), args.from_json.with_suffix(".md"))
        return
    import vllm

    torch.set_num_threads(1)
    path = args.output_dir / f"{args.name}.json"
    settings = {
        key: getattr(args, key)
        for key in (
            "window",
            "global_every",
            "decode_tokens",
            "dtype",
            "block_size",
            "max_batch_tokens",
            "kv_budget_mib",
            "concurrency_decode_tokens",
        )
    }
    settings["P"] = args.pseudo_heads
    run = None
    saved_run = False
    if path.exists():
        saved = json.loads(path.read_text())
        if all(saved["meta"].get(key) == value for key, value in settings.items()):
            run = saved
            saved_run = True
            print(f"resuming {path}")
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        folders = build_folders(args, Path(root))
        run = run or {
            "meta": {
                **settings,
                "command": " ".join(
                    ["python benchmarks/bench_vllm_layouts.py", *(sys.argv[1:] if argv is None else argv)]
                ),
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
                "cores": os.cpu_count(),
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "load_at_start": os.getloadavg()[0],
                "model_note": (
                    "a tiny random Llama (smoke run)"
                    if args.quick
                    else "SmolLM2-135M-Instruct's own weights (the built-in offline copy), 30 layers"
                ),
            }
        }
        if saved_run:
            command = " ".join(["python benchmarks/bench_vllm_layouts.py", *(sys.argv[1:] if argv is None else argv)])
            date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            run["meta"].setdefault("resumed_with", []).append([command, date])
        run["meta"].update(
            # Every cell the JSON holds, this call's and a resumed run's earlier ones.
            requests=sorted(set(args.requests) | set(run["meta"].get("requests", []))),
            multiples=sorted(set(args.multiples) | set(run["meta"].get("multiples", []))),
            machine_note=run["meta"].get("machine_note") or args.machine_note,
        )
        run["meta"].pop("repeats", None)  # the rounds each cell has are in its records, whichever calls took them
        run["meta"]["layers"] = args.layers
        run["meta"]["shape"] = args.shape

        def save_run():
            save(path, run)

        if "speed" in args.parts:
            speed_part(args, folders, run, save_run, generator)
        if "concurrency" in args.parts:
            concurrency_part(args, folders, run, save_run, generator)
        save_run()
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
