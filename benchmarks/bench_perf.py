"""Speed and memory of IHA against the base Llama model with the same dimensions and weights, in one run.

    python benchmarks/bench_perf.py            # full run: writes benchmarks/results/perf.md and perf.json
    python benchmarks/bench_perf.py --quick    # seconds-long smoke run: benchmarks/results/perf_quick.{md,json}

The model is shaped like SmolLM2-135M (hidden 576, 9 heads, 3 KV heads, head dim 64, MLP 1536, vocabulary 49152,
tied embeddings) with fewer layers (`--layers`, 10 by default) to keep the run short. The base model is a random
`LlamaForCausalLM`; every IHA model is converted from its weights (same state dict, identity head mixing), so both
sides compute with the same parameters. Everything runs in float32. Base and IHA are timed alternately, every
measurement repeated (`--repeats`) and reported as the median, so that load from other processes falls on both.

For every sequence length N, number of pseudo-heads P and layout (every layer global IHA, or the paper's hybrid:
4 sliding IHA layers with window N / (2 P^2) tokens, i.e. the last W * P virtual tokens, to 1 global MHA layer) the report gives forward and forward + backward
time, prefill and decode speed, peak memory and KV-cache bytes, each next to the model FLOP ratio IHA / base
(`model_flops`: analytic counts of the matmul work). A second table decodes with 1024 tokens of context in both
cache modes (`iha_cache_mode="token"`, the default, and `"pseudo"`). A third table trains on packed rows, as TRL's
`--packing` sends them (`--packed DOCUMENTS LENGTH`: one row of DOCUMENTS documents of LENGTH tokens with restarting
position ids and no mask), and gives the ratio of every round with the median and spread. The targets are checked at
the end of the report.

The device and dtype come from the machine: on CPU float32 with one torch thread, timed in the process's CPU time;
on a CUDA device bfloat16 (`--dtype` to change it), timed in wall-clock time after synchronizing, with peak memory
from the CUDA allocator. `--attn-implementation` runs SDPA (default), flex attention or FlashAttention (the hybrid's
sliding IHA layers take the paper's window in virtual units, which FlashAttention's own window computes).
"""

import json
import os
import platform
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
    forward_step,
    generation_step,
    peak_memory_of,
    train_step,
)
from flops import model_flops  # noqa: E402
from perf_report import markdown_report, summarize  # noqa: E402

import iha  # noqa: E402
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


def layout_options(layout: str, num_layers: int, num_pseudo_heads: int, seq_len: int) -> dict:
    if layout == "global":
        return {"attention_types": ["iha_full_attention"] * num_layers}
    # The paper's hybrid: its sliding IHA layers windowed over the last W * P virtual tokens.
    return iha.paper_hybrid_layout(num_layers, num_pseudo_heads, training_length=seq_len)


def flop_settings(num_pseudo_heads: int, options: dict) -> dict:
    """The `model_flops` settings of an IHA model built with `layout_options`."""
    return dict(num_pseudo_heads=num_pseudo_heads, sliding_window=options.get("sliding_window"))


# --- the run --------------------------------------------------------------------------------------------------------


def measure_grid(args, shape, base, progress) -> list[dict]:
    rows = []
    for seq_len in args.seq_lens:
        input_ids = torch.randint(0, shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
        input_ids = input_ids.to(base.device)
        for layout in args.layouts:
            for num_pseudo in args.pseudo_heads:
                progress.set_description(f"N={seq_len} P={num_pseudo} {layout}")
                options = layout_options(layout, args.layers, num_pseudo, seq_len)
                model = converted_iha_model(base, shape, num_pseudo, iha_position_mode=args.position_mode, **options)
                models = {"base": base, "iha": model}
                row = {"layout": layout, "P": num_pseudo, "N": seq_len, "sliding_window": options.get("sliding_window")}
                row["attention_types"] = model.config.attention_types
                flop_kwargs = flop_settings(num_pseudo, options)
                base_types = ["full_attention"] * args.layers
                row["flops"] = {
                    "forward": {
                        "base": model_flops(shape, base_types, seq_len)["total"],
                        "iha": model_flops(shape, model.config.attention_types, seq_len, **flop_kwargs)["total"],
                    },
                    "decode_step": {
                        "base": model_flops(shape, base_types, 1, past_tokens=seq_len)["total"],
                        "iha": model_flops(shape, model.config.attention_types, 1, past_tokens=seq_len, **flop_kwargs)[
                            "total"
                        ],
                    },
                }
                # The memory runs double as warm-up.
                row["peak_memory_forward"] = {
                    name: peak_memory_of(forward_step(m, input_ids)) for name, m in models.items()
                }
                row["forward_s"] = alternate({n: forward_step(m, input_ids) for n, m in models.items()}, args.repeats)
                progress.update(1)
                row["peak_memory_train"] = {
                    name: peak_memory_of(train_step(m, input_ids)) for name, m in models.items()
                }
                row["train_s"] = alternate({n: train_step(m, input_ids) for n, m in models.items()}, args.repeats)
                progress.update(1)
                generation = {name: {} for name in models}
                steps = {n: generation_step(m, input_ids, args.decode_tokens, generation[n]) for n, m in models.items()}
                for step in steps.values():
                    step()  # warm-up
                for record in generation.values():
                    record.clear()
                alternate(steps, args.repeats)
                row["generation"] = generation
                progress.update(1)
                rows.append(row)
                del model, models
    return rows


def measure_decoding(args, shape, base, progress) -> list[dict]:
    rows = []
    context = args.decode_context
    prompt = torch.randint(0, shape["vocab_size"], (1, context), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(base.device)
    for layout in args.layouts:
        for num_pseudo in args.pseudo_heads:
            options = layout_options(layout, args.layers, num_pseudo, context)
            flop_kwargs = flop_settings(num_pseudo, options)
            for cache_mode in ("token", "pseudo"):
                progress.set_description(f"decode P={num_pseudo} {layout} {cache_mode}")
                model = converted_iha_model(
                    base,
                    shape,
                    num_pseudo,
                    iha_position_mode=args.position_mode,
                    iha_cache_mode=cache_mode,
                    **options,
                )
                generation = {"base": {}, "iha": {}}
                steps = {
                    name: generation_step(m, prompt, args.decode_tokens, generation[name])
                    for name, m in (("base", base), ("iha", model))
                }
                for step in steps.values():
                    step()
                for record in generation.values():
                    record.clear()
                alternate(steps, args.repeats)
                # FLOPs of the step in the middle of the decoded tokens.
                past = context + args.decode_tokens // 2
                flops = {
                    "base": model_flops(shape, ["full_attention"] * args.layers, 1, past_tokens=past)["total"],
                    "iha": model_flops(
                        shape, model.config.attention_types, 1, past_tokens=past, cache_mode=cache_mode, **flop_kwargs
                    )["total"],
                }
                rows.append(
                    {
                        "layout": layout,
                        "P": num_pseudo,
                        "cache_mode": cache_mode,
                        "context": context,
                        "sliding_window": options.get("sliding_window"),
                        "generation": generation,
                        "decode_step_flops": flops,
                    }
                )
                progress.update(1)
                del model
    return rows


def measure_packed(args, shape, base, progress) -> list[dict]:
    """Forward + backward on one packed row (restarting position ids, no mask), base and IHA alternating."""
    rows = []
    num_documents, document_len = args.packed
    seq_len = num_documents * document_len
    input_ids = torch.randint(0, shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(3))
    input_ids = input_ids.to(base.device)
    position_ids = torch.arange(document_len, device=base.device).repeat(num_documents)[None]
    for layout in args.layouts:
        for num_pseudo in args.pseudo_heads:
            progress.set_description(f"packed {num_documents}x{document_len} P={num_pseudo} {layout}")
            # The hybrid window follows the training length, the packed row's.
            options = layout_options(layout, args.layers, num_pseudo, seq_len)
            model = converted_iha_model(base, shape, num_pseudo, iha_position_mode=args.position_mode, **options)
            steps = {name: train_step(m, input_ids, position_ids) for name, m in (("base", base), ("iha", model))}
            for step in steps.values():
                step()  # warm-up
            times = alternate(steps, args.repeats)
            rows.append(
                {
                    "layout": layout,
                    "P": num_pseudo,
                    "documents": num_documents,
                    "document_len": document_len,
                    "sliding_window": options.get("sliding_window"),
                    "train_s": times,
                }
            )
            progress.update(1)
            del model
    return rows


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths: a seconds-long smoke run")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--pseudo-heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["global", "hybrid"], choices=["global", "hybrid"])
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--position-mode", default="virtual", choices=["virtual", "shared"])
    parser.add_argument(
        "--packed",
        type=int,
        nargs=2,
        default=[4, 512],
        metavar=("DOCUMENTS", "LENGTH"),
        help="packed-row table: one row of DOCUMENTS documents of LENGTH tokens each",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["grid", "decoding", "packed"],
        choices=["grid", "decoding", "packed"],
        help="tables to measure (default all)",
    )
    parser.add_argument("--name", help="report file names NAME.md and NAME.json (default perf, or perf_quick)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda where present)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "eager"],
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a machine shared with other jobs, every parallel op of a 2-thread run "
        "waits for a second free core, which swamps the timings)",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, help="rewrite the report from this JSON of an earlier run, no measuring")
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.seq_lens, args.pseudo_heads = 5, [64, 128], [2]
        args.decode_context, args.decode_tokens, args.repeats, args.packed = 64, 4, 1, [2, 64]
    if min(args.packed) < 1:
        parser.error("--packed needs at least 1 document of at least 1 token")
    if args.layers < 1 or args.repeats < 1 or args.decode_tokens < 1:
        parser.error("--layers, --repeats and --decode-tokens must be at least 1")
    return args


def render(json_path: Path):
    """Rewrite the markdown report next to `json_path` from its measurements (no measuring)."""
    payload = json.loads(json_path.read_text())
    packed = payload.get("packed", [])
    meta = payload["meta"]
    targets = summarize(payload["grid"], payload["decoding"], meta["decode_tokens"], packed, meta.get("clock", "cpu"))
    payload["targets"] = targets
    write_text_atomic(json.dumps(payload, indent=1, default=str), json_path)
    report = markdown_report(meta, payload["grid"], payload["decoding"], targets, packed)
    write_text_atomic(report, json_path.with_suffix(".md"))
    print(report)


def main(argv=None):
    args = parse_args(argv)
    if args.render is not None:
        return render(args.render)
    device, dtype = bench_common.use_device(args.device, args.dtype)
    # CPU time measures a CPU run's own work on a shared machine; on a GPU it measures only the host's launches.
    clock = "wall" if device.type == "cuda" else "cpu"
    bench_common.ALLOCATOR.for_timing()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    base = base_model(shape, args.layers, args.attn_implementation)
    load_at_start = os.getloadavg()[0]

    per_layout = len(args.layouts) * len(args.pseudo_heads)
    total = {"grid": 3 * len(args.seq_lens) * per_layout, "decoding": 2 * per_layout, "packed": per_layout}
    with tqdm(total=sum(total[section] for section in args.sections), unit="measurement") as progress:
        grid = measure_grid(args, shape, base, progress) if "grid" in args.sections else []
        decoding = measure_decoding(args, shape, base, progress) if "decoding" in args.sections else []
        packed = measure_packed(args, shape, base, progress) if "packed" in args.sections else []
    targets = summarize(grid, decoding, args.decode_tokens, packed, clock)

    n_ref = 2048 if 2048 in args.seq_lens else max(args.seq_lens)
    base_flops = model_flops(shape, ["full_attention"] * args.layers, n_ref)
    hybrid_types = iha.paper_hybrid_layout(args.layers, 2, 64)["attention_types"]
    hybrid_globals = [i for i, attention_type in enumerate(hybrid_types) if attention_type == "full_attention"]
    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": args.attn_implementation,
        "clock": clock,
        "layers": args.layers,
        "shape_note": ", ".join(f"{k} {v}" for k, v in shape.items() if k != "rope_parameters"),
        "position_mode": args.position_mode,
        "global_layers_note": ", ".join(str(i) for i in hybrid_globals) + " global",
        "window_unit": "virtual",  # the hybrid's sliding IHA layers (hybrid_options)
        "repeats": args.repeats,
        "machine_note": (
            f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the run "
            f"on {os.cpu_count()} cores. {args.machine_note}"
        ).strip(),
        "decode_tokens": args.decode_tokens,
        "decode_context": args.decode_context,
        "lm_head_share": f"{base_flops['lm_head'] / base_flops['total']:.0%}",
        "lm_head_share_at": n_ref,
        "shape_name": "a tiny smoke-test shape" if args.quick else "SmolLM2-135M's shape (30 layers in the original)",
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("perf_quick" if args.quick else "perf")
    report = markdown_report(meta, grid, decoding, targets, packed)
    write_text_atomic(report, args.output_dir / f"{stem}.md")
    payload = {"meta": meta, "grid": grid, "decoding": decoding, "packed": packed, "targets": targets}
    write_text_atomic(json.dumps(payload, indent=1, default=str), args.output_dir / f"{stem}.json")
    print(report)
    print(f"wrote {args.output_dir / f'{stem}.md'} and {stem}.json")


if __name__ == "__main__":
    main()
