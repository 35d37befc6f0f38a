"""torch.compile against eager, for IHA and the base Llama model with the same weights, in one run.

    python benchmarks/bench_compile.py            # writes benchmarks/results/compile.md and compile.json
    python benchmarks/bench_compile.py --quick    # tiny shapes, seconds after compiling: compile_quick.{md,json}

Both models are shaped like SmolLM2-135M with fewer layers (`--layers`), the IHA model converted from the base
model's weights with every layer IHA at P = `--pseudo-heads` (`bench_common.converted_iha_model`). For each model the
same training step (`bench_common.train_step`: forward + backward with labels, as a trainer runs it, no optimizer
step) and inference forward (`bench_common.forward_step`, under `torch.inference_mode`) run eager and under
`torch.compile` (inductor), alternating and repeated, with the median reported. The report gives compiled / eager
per model, IHA / base eager and compiled, the compile time of each graph (first call), and the number of graph
breaks counted by dynamo (zero is what the tests require with `fullgraph=True`).

Device and dtype come from the machine (`bench_common.choose_device`): on CPU float32 with one thread, timed in CPU
time; on CUDA bfloat16, wall-clock after synchronizing. Nothing to edit for a GPU run.
"""

import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch._dynamo.utils import counters


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_text_atomic  # noqa: E402


QUICK_SHAPE = dict(bench_common.SMOLLM2_135M_SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


def first_call_seconds(step) -> float:
    """Wall-clock seconds of the first call: for a compiled model, tracing and code generation."""
    bench_common.synchronize()
    start = time.perf_counter()
    step()
    bench_common.synchronize()
    return time.perf_counter() - start


def measure(args, shape) -> dict:
    clock = "cpu" if bench_common.DEVICE.type == "cpu" else "wall"
    base = bench_common.base_model(shape, args.layers)
    models = {"base": base, "iha": bench_common.converted_iha_model(base, shape, args.pseudo_heads)}
    for model in models.values():
        model.train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, shape["vocab_size"], (args.batch_size, args.seq_len), generator=generator)
    input_ids = input_ids.to(bench_common.DEVICE)

    results = {"clock": clock, "compile_seconds": {}, "graph_breaks": {}}
    steps = {}
    torch._dynamo.reset()
    for name, model in models.items():
        counters.clear()
        compiled = torch.compile(model)
        for kind, make_step in (("train", bench_common.train_step), ("forward", bench_common.forward_step)):
            steps[f"{name} {kind} eager"] = make_step(model, input_ids)
            steps[f"{name} {kind} compiled"] = make_step(compiled, input_ids)
            first_call_seconds(steps[f"{name} {kind} eager"])
            results["compile_seconds"][f"{name} {kind}"] = first_call_seconds(steps[f"{name} {kind} compiled"])
            print(f"compiled {name} {kind}: {results['compile_seconds'][f'{name} {kind}']:.0f} s", flush=True)
        results["graph_breaks"][name] = sum(counters["graph_break"].values())

    # A warm-up round: any recompilation (say, for a changed grad mode) happens here, untimed.
    bench_common.alternate(steps, 1)
    times = bench_common.alternate(steps, args.repeats)
    results["median_seconds"] = {name: bench_common.median(value[clock]) for name, value in times.items()}
    results["all_seconds"] = {name: value[clock] for name, value in times.items()}
    return results


def markdown_report(meta: dict, results: dict) -> str:
    seconds = results["median_seconds"]
    lines = [
        "# torch.compile against eager: IHA and the base model",
        "",
        f"{meta['when']}, {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; "
        f"{meta['device']} {meta['dtype']}, {meta['threads']} thread(s); {results['clock']} time, median of "
        f"{meta['repeats']} alternating rounds.",
        f"Model: SmolLM2-135M's shape with {meta['layers']} layers; IHA: every layer, P = {meta['pseudo_heads']}, "
        f"converted from the base weights. Input: batch {meta['batch_size']} x {meta['seq_len']} tokens.",
        f"Command: `{meta['command']}`",
        "",
        "| step | model | eager | compiled | compiled / eager | graph breaks | compile time (first call) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind in ("train", "forward"):
        for name in ("base", "iha"):
            eager, compiled = seconds[f"{name} {kind} eager"], seconds[f"{name} {kind} compiled"]
            lines.append(
                f"| {kind} | {name} | {eager * 1e3:.1f} ms | {compiled * 1e3:.1f} ms | {compiled / eager:.2f}x | "
                f"{results['graph_breaks'][name]} | {results['compile_seconds'][f'{name} {kind}']:.0f} s |"
            )
    lines += ["", "| step | IHA / base, eager | IHA / base, compiled |", "|---|---:|---:|"]
    for kind in ("train", "forward"):
        eager_ratio = seconds[f"iha {kind} eager"] / seconds[f"base {kind} eager"]
        compiled_ratio = seconds[f"iha {kind} compiled"] / seconds[f"base {kind} compiled"]
        lines.append(f"| {kind} | {eager_ratio:.2f}x | {compiled_ratio:.2f}x |")
    lines += [
        "",
        "Times are for the whole step of one model (the absolute values depend on the machine; the ratios are the "
        "result). Every round is in `compile.json`.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a quick run of the whole script")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", help="cpu or cuda (default: cuda where present)")
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, for steady CPU times)")
    parser.add_argument("--output-dir", type=Path, default=bench_common.RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device, dtype = bench_common.use_device(args.device, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    shape = bench_common.SMOLLM2_135M_SHAPE
    if args.quick:
        shape, args.layers, args.seq_len, args.repeats = QUICK_SHAPE, 2, 32, 2
    results = measure(args, shape)
    import transformers

    meta = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/bench_compile.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        **{key: getattr(args, key) for key in ("layers", "seq_len", "batch_size", "pseudo_heads", "repeats")},
    }
    name = "compile_quick" if args.quick else "compile"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json.dumps({"meta": meta, **results}, indent=2) + "\n", args.output_dir / f"{name}.json")
    report = markdown_report(meta, results)
    write_text_atomic(report, args.output_dir / f"{name}.md")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
