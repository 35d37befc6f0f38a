"""The demo's work with one torch thread against torch's default (one per core), side by side in one process.

    python benchmarks/bench_threads.py            # writes benchmarks/results/threads.md and threads.json
    python benchmarks/bench_threads.py --quick    # seconds-long smoke run: benchmarks/results/threads_quick.{md,json}

`iha demo` spends its time in three kinds of work: greedy generation of a batch of held-out problems (`evaluate`), a
fine-tuning step (forward and backward of a few rows) and the conversion's verification (one forward of a short
sequence). Each is run here on an IHA model shaped like SmolLM2-135M (30 layers, P = 2, identity mixing: the speed of
the demo's converted model), with 1 thread and with torch's default, taking turns: every round runs each work with both
counts, back to back, the order flipped every round, so that both see the same load. Reported per work: the median
wall-clock and CPU seconds of each count, and the median and range over rounds of the ratio default / 1 thread, each
from the same round (a ratio above 1: one thread was faster). The load average is read before and after.

This is what `iha.cli.arguments.default_threads` rests on: on cores other work keeps busy, every parallel operation of
torch waits for its slowest thread, and a thread whose core another process holds waits for it.
"""

import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    QUICK_SHAPE,
    RESULTS_DIR,
    SMOLLM2_135M_SHAPE,
    alternate,
    base_model,
    converted_iha_model,
    forward_step,
    generation_step,
    train_step,
)

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.utils.atomic_files import write_json_atomic, write_text_atomic  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model: a seconds-long smoke run")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each running every work with both counts")
    parser.add_argument("--batch", type=int, default=12, help="problems generated together (the demo's 12)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each problem")
    parser.add_argument("--decode-tokens", type=int, default=4, help="greedy tokens per generation")
    parser.add_argument("--train-rows", type=int, default=2, help="rows per fine-tuning step")
    parser.add_argument("--train-tokens", type=int, default=256, help="tokens per fine-tuning row")
    parser.add_argument("--verify-tokens", type=int, default=129, help="tokens of the verification's forward")
    parser.add_argument("--name", help="report file names NAME.md and NAME.json (default threads, or threads_quick)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--machine-note", default="", help="a sentence on the machine's load, put into the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.prompt_tokens, args.train_tokens, args.verify_tokens = 2, 2, 16, 16, 16
    args.name = args.name or ("threads_quick" if args.quick else "threads")
    return args


def with_threads(step, threads: int):
    def run():
        torch.set_num_threads(threads)
        step()

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    default_threads = torch.get_num_threads()
    counts = sorted({1, default_threads})
    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    layers = 2 if args.quick else 30
    model = converted_iha_model(base_model(shape, layers), shape, num_pseudo_heads=2)
    generator = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompt = torch.randint(vocab, (args.batch, args.prompt_tokens), generator=generator)
    rows = torch.randint(vocab, (args.train_rows, args.train_tokens), generator=generator)
    sequence = torch.randint(vocab, (1, args.verify_tokens), generator=generator)
    trained = converted_iha_model(base_model(shape, layers), shape, num_pseudo_heads=2).train()
    work = {
        "evaluate (generation)": lambda record: generation_step(model, prompt, args.decode_tokens, record),
        "fine-tune (forward + backward)": lambda record: train_step(trained, rows),
        "verify (forward)": lambda record: forward_step(model, sequence),
    }
    steps = {}
    for name, make in work.items():
        for threads in counts:
            steps[(name, threads)] = with_threads(make({}), threads)
    for step in steps.values():  # warm-up: allocations, first-call dispatch
        step()
    load_before = os.getloadavg()
    times = alternate(steps, args.rounds)
    load_after = os.getloadavg()
    torch.set_num_threads(default_threads)

    results = []
    for name in work:
        entry = {"work": name}
        for threads in counts:
            entry[f"wall_s_{threads}t"] = statistics.median(times[(name, threads)]["wall"])
            entry[f"cpu_s_{threads}t"] = statistics.median(times[(name, threads)]["cpu"])
        if default_threads > 1:
            ratios = [
                default / one
                for default, one in zip(times[(name, default_threads)]["wall"], times[(name, 1)]["wall"], strict=True)
            ]
            entry["wall_ratio_default_over_1t"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        results.append(entry)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores; {args.machine_note}".rstrip("; "),
        "torch": torch.__version__,
        "default_threads": default_threads,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "settings": {key: value for key, value in vars(args).items() if key not in ("output_dir", "name")},
        "results": results,
        "times": {f"{name} / {threads}t": value for (name, threads), value in times.items()},
    }
    write_json_atomic(report, args.output_dir / f"{args.name}.json", default=str)
    write_text_atomic(render_markdown(report), args.output_dir / f"{args.name}.md")
    print(render_markdown(report))
    return 0


def render_markdown(report: dict) -> str:
    default = report["default_threads"]
    lines = [
        f"# The demo's work: {default} torch threads (torch's default) against 1",
        "",
        f"{report['date']}, {report['machine']}, torch {report['torch']}; {report['rounds']} rounds, each work run with "
        f"both counts back to back. Load average (1, 5, 15 min) before: "
        + ", ".join(f"{value:.1f}" for value in report["load_average_before"])
        + "; after: "
        + ", ".join(f"{value:.1f}" for value in report["load_average_after"])
        + ".",
        "",
        f"| work | wall s, 1 thread | wall s, {default} | CPU s, 1 thread | CPU s, {default} | "
        f"wall {default} / 1: median (range) |",
        "|---|---|---|---|---|---|",
    ]
    for entry in report["results"]:
        ratio = entry.get("wall_ratio_default_over_1t")
        ratio_text = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "n/a"
        lines.append(
            f"| {entry['work']} | {entry['wall_s_1t']:.2f} | {entry.get(f'wall_s_{default}t', 0):.2f} | "
            f"{entry['cpu_s_1t']:.2f} | {entry.get(f'cpu_s_{default}t', 0):.2f} | {ratio_text} |"
        )
    lines += [
        "",
        "A ratio above 1: one thread was faster. Medians over the rounds; the ratio pairs each round's two runs.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
