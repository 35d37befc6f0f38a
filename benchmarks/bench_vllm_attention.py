"""vLLM's CPU paged-attention kernel on one decoding step: the base model's layer against an IHA layer's virtual
sequence handed over whole (P queries per request) and split (`attention.one_request_per_decoding_pseudo_query`:
each pseudo-query a request of its own, as the plugin hands it over). Runs in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python benchmarks/bench_vllm_attention.py          # results/vllm_attention.{md,json}
    .venv-vllm/bin/python benchmarks/bench_vllm_attention.py --quick  # a smoke run: results/vllm_attention_quick.*

The kernel alone, on SmolLM2-135M's attention shape (9 query heads over 3 KV heads of width 64), for 8 and 32
decoding requests with contexts of the engine benchmark's prompt lengths plus `--decoded` tokens
(benchmarks/bench_vllm.py): the base layer reads `context` cached keys per request, the IHA layer P * `context`
pseudo-keys with P pseudo-queries per request (the P^2 work of IHA's attention, P times the KV bytes). Keys and values
are random, written into the pages by vLLM's own cache writer (the kernel variant decides the pages' layout); every
one of `--layers` layers has pages of its own, so that a step reads more than the CPU's caches hold, as an engine's
does. The cases take turns within every round, medians over rounds of the mean CPU time of `--calls` steps; the
split's outputs are checked against the whole's.
"""

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RESULTS_DIR  # noqa: E402
from bench_vllm import PROMPT_LENGTHS  # noqa: E402

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few requests and calls: a smoke run")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=PROMPT_LENGTHS)
    parser.add_argument("--decoded", type=int, default=16, help="tokens decoded so far, added to every prompt")
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block (vLLM's CPU default)")
    parser.add_argument(
        "--layers", type=int, default=10, help="layers of pages per step (bench_vllm.py's model has 10)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="decoding steps timed per case and round")
    parser.add_argument("--name", help="report file names NAME.md and NAME.json")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.layers, args.rounds, args.calls = [4], 2, 1, 2
    args.name = args.name or ("vllm_attention_quick" if args.quick else "vllm_attention")
    return args


def kernel_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


def write_pages(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_cache, value_cache) -> None:
    """Keys and values [tokens, kv heads, d] into pages [blocks, kv heads, block size, d] at `slots`, in the layout
    the kernel variant reads."""
    from vllm.v1.attention.backends.cpu_attn import ops

    isa = kernel_isa(keys.dtype, key_cache.shape[2], keys.shape[2])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


class PagedAttention:
    """One call of vLLM's CPU kernel over given pages and requests, as the plugin's backend makes it (vLLM's own
    `CPUAttentionMetadataBuilder.build` and `CPUAttentionBackendImpl.forward`, which `iha.serving.vllm.attention.cpu`
    subclasses): the schedule made once, as the builder makes it once per step."""

    def __init__(self, query, key_cache, value_cache, query_start_loc, seq_lens, block_table):
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import ops

        num_heads, head_dim = query.shape[1], query.shape[2]
        self.isa = kernel_isa(query.dtype, key_cache.shape[2], head_dim)
        self.requests = query_start_loc, seq_lens, block_table
        self.pages = query, key_cache, value_cache, torch.empty_like(query)
        self.scale = head_dim**-0.5
        self.schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=num_heads,
            num_kv_heads=key_cache.shape[1],
            head_dim=head_dim,
            seq_lens=seq_lens,
            dtype=query.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        )

    def __call__(self) -> torch.Tensor:
        from vllm.v1.attention.backends.cpu_attn import ops

        query, key_cache, value_cache, output = self.pages
        query_start_loc, seq_lens, block_table = self.requests
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=output,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0,
            scheduler_metadata=self.schedule,
            s_aux=None,
        )
        return output


def decoding_layer(args, contexts: list[int], num_pseudo_heads: int, generator):
    """A layer's pages and one decoding step's queries: every request's `context` tokens cached, P pseudo-tokens per
    token in blocks of P * block_size virtual slots. The kernel calls on them, whole and split (P = 1, the base
    layer: whole only)."""
    from iha.serving.vllm.attention.cpu import one_request_per_decoding_pseudo_query

    dtype = getattr(torch, args.dtype)
    block_size = args.block_size * num_pseudo_heads
    lengths = [context * num_pseudo_heads for context in contexts]
    blocks_each = [-(-length // block_size) for length in lengths]
    shuffled = torch.randperm(sum(blocks_each), generator=generator).to(torch.int32)
    block_table = torch.zeros(len(contexts), max(blocks_each), dtype=torch.int32)
    key_cache = torch.zeros(sum(blocks_each), args.kv_heads, block_size, args.head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    used = 0
    for request, (length, count) in enumerate(zip(lengths, blocks_each)):
        block_table[request, :count] = shuffled[used : used + count]
        used += count
        blocks = block_table[request, :count].long()
        slots = (blocks.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(count))[:length]
        keys, values = (torch.randn(length, args.kv_heads, args.head_dim, generator=generator).to(dtype) for _ in "kv")
        write_pages(keys, values, slots, key_cache, value_cache)
    query = torch.randn(len(contexts) * num_pseudo_heads, args.heads, args.head_dim, generator=generator).to(dtype)
    query_start_loc = torch.arange(len(contexts) + 1, dtype=torch.int32) * num_pseudo_heads
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    whole = PagedAttention(query, key_cache, value_cache, query_start_loc, seq_lens, block_table)
    if num_pseudo_heads == 1:
        return whole, None
    requests = one_request_per_decoding_pseudo_query(query_start_loc, seq_lens, block_table, num_pseudo_heads)
    split = PagedAttention(
        query, key_cache, value_cache, requests.query_start_loc, requests.seq_lens, requests.block_table
    )
    return whole, split


class Step:
    """One decoding step's attention: a kernel call per layer, each layer on pages of its own (the pages of all
    layers together outgrow the CPU's caches, as in an engine)."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self) -> list[torch.Tensor]:
        return [call() for call in self.calls]


def measure(args) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for num_requests in args.requests:
        contexts = [args.prompt_lengths[i % len(args.prompt_lengths)] + args.decoded for i in range(num_requests)]
        base = [decoding_layer(args, contexts, 1, generator)[0] for _ in range(args.layers)]
        iha = [decoding_layer(args, contexts, args.pseudo_heads, generator) for _ in range(args.layers)]
        cases = {"base": Step(base), "iha_whole": Step([w for w, _ in iha]), "iha_split": Step([s for _, s in iha])}
        difference = max(
            (split.float() - whole.float()).abs().max().item()
            for split, whole in zip(cases["iha_split"](), cases["iha_whole"]())
        )
        seconds = {name: [] for name in cases}
        wall_seconds = {name: [] for name in cases}
        names = list(cases)
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                cases[name]()  # warm-up
                start, start_wall = time.process_time(), time.perf_counter()
                for _ in range(args.calls):
                    cases[name]()
                seconds[name].append((time.process_time() - start) / args.calls)
                wall_seconds[name].append((time.perf_counter() - start_wall) / args.calls)
        medians = {name: statistics.median(times) for name, times in seconds.items()}
        wall_medians = {name: statistics.median(times) for name, times in wall_seconds.items()}
        rows.append(
            {
                "requests": num_requests,
                "contexts": contexts,
                "seconds_per_step": seconds,
                "median_seconds_per_step": medians,
                "wall_seconds_per_step": wall_seconds,
                "median_wall_seconds_per_step": wall_medians,
                "max_abs_split_minus_whole": difference,
            }
        )
        print(
            f"{num_requests} requests: base {medians['base'] * 1e6:.0f} us, IHA whole "
            f"{medians['iha_whole'] * 1e6:.0f} us, split {medians['iha_split'] * 1e6:.0f} us",
            flush=True,
        )
    return rows


def spread(row: dict, case: str, over: str = "base") -> tuple[float, float]:
    """The smallest and largest ratio over the rounds (each round's cases ran side by side)."""
    by_round = [a / b for a, b in zip(row["seconds_per_step"][case], row["seconds_per_step"][over])]
    return min(by_round), max(by_round)


def markdown_report(meta: dict, rows: list[dict]) -> str:
    num_pseudo = meta["pseudo_heads"]
    lines = [
        "# vLLM's CPU attention kernel: one decoding step, base layer vs IHA whole vs IHA split",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; vLLM {meta['vllm']} (CPU build), torch {meta['torch']}; "
        f"{meta['dtype']}; kernel variant {meta['isa']} (base) / {meta['isa_iha']} (IHA).  ",
        f"Layer: {meta['heads']} query heads over {meta['kv_heads']} KV heads of width {meta['head_dim']} "
        f"(SmolLM2-135M's), P = {num_pseudo}, blocks of {meta['block_size']} tokens ({meta['block_size']} x P "
        "virtual slots for IHA).  ",
        f"Contexts: the prompt lengths of benchmarks/bench_vllm.py plus {meta['decoded']} decoded tokens, repeated to "
        "the number of requests.  ",
        f"Times: one decoding step's attention, a kernel call on each of {meta['layers']} layers' pages; medians over "
        f"{meta['rounds']} rounds (cases in turn) of the mean CPU time of {meta['calls']} steps (the wall clock's "
        "split / whole beside it). " + meta["machine_note"],
        "",
        f"IHA's attention does P^2 = {num_pseudo**2}x the base layer's work over P = {num_pseudo}x its KV bytes. "
        "*Whole* hands the kernel P queries per request; *split* hands it each pseudo-query as a request of one "
        "query with the virtual length it may see, which is how the plugin calls it "
        "(`iha.serving.vllm.attention.cpu.one_request_per_decoding_pseudo_query`), through vLLM's own schedule "
        "and kernel call (vLLM's `VLLM_CPU_ATTN_SPLIT_KV` as set: "
        f"{meta['split_kv']}).",
        "",
        "| requests | base us / step | IHA whole us (x base) | IHA split us (x base) | split / whole (rounds) | "
        "split / whole, wall clock | max abs split - whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        medians = row["median_seconds_per_step"]
        base, whole, split = (medians[name] for name in ("base", "iha_whole", "iha_split"))
        wall = row["median_wall_seconds_per_step"]
        low, high = spread(row, "iha_split", over="iha_whole")
        lines.append(
            f"| {row['requests']} | {base * 1e6:.0f} | {whole * 1e6:.0f} ({whole / base:.2f}) | "
            f"{split * 1e6:.0f} ({split / base:.2f}) | {split / whole:.2f} ({low:.2f} to {high:.2f}) | "
            f"{wall['iha_split'] / wall['iha_whole']:.2f} | {row['max_abs_split_minus_whole']:.1e} |"
        )
    lines += [
        "",
        "The split computes the same attention (last column: the largest difference of any output element between "
        "the two; zero where the kernel keeps every request's keys on one thread, within the dtype's rounding where "
        "it splits them). On a CUDA GPU the plugin runs FlashAttention instead, which hands over whole requests; this "
        "benchmark does not measure it.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.cpu._init_amx()  # the AMX kernel variant needs the process's permission to use AMX tiles
    import vllm
    from vllm import envs

    dtype = getattr(torch, args.dtype)
    meta = {
        "command": " ".join(["python benchmarks/bench_vllm_attention.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "isa": kernel_isa(dtype, args.block_size, args.head_dim),
        "isa_iha": kernel_isa(dtype, args.block_size * args.pseudo_heads, args.head_dim),
        "machine_note": args.machine_note,
        "split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
        **{key: getattr(args, key) for key in ("pseudo_heads", "heads", "kv_heads", "head_dim", "block_size")},
        **{key: getattr(args, key) for key in ("decoded", "layers", "rounds", "calls")},
    }
    load_at_start = os.getloadavg()[0]
    rows = measure(args)
    meta["machine_note"] = (
        f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the run on "
        f"{os.cpu_count()} cores. {args.machine_note}"
    ).strip()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", args.output_dir / f"{args.name}.json")
    write_text_atomic(markdown_report(meta, rows), args.output_dir / f"{args.name}.md")
    print(f"wrote {args.output_dir / args.name}.md and .json")


if __name__ == "__main__":
    main()
