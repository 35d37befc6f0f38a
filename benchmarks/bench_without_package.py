"""What a converted folder costs when the `iha` package is not installed: its model with and without the package's
fast paths (`iha.attention`), side by side in one run.

    python benchmarks/bench_without_package.py            # writes benchmarks/results/without_package.{md,json}
    python benchmarks/bench_without_package.py --quick    # a seconds-long smoke run (without_package_quick.*)

A folder loaded with `trust_remote_code=True` where `iha` is not installed attends with transformers' own attention
functions; with the package imported, IHA layers take its exact fast paths, registered under `iha|sdpa`. This runs
the same model both ways in one process, by taking those entries out of transformers' registries for the steps
"without the package" (what a process without `iha` sees: tests/models/iha/test_remote_code.py checks that the
outputs agree), and reports the ratio of CPU time without / with, per round, for the work each path speeds up:

- the paper's hybrid (4 sliding IHA : 1 global MHA layer, W = N / (2 P^2)): forward and forward + backward at N tokens
  (blocked sliding windows, against SDPA over the dense (N * P)^2 mask);
- every layer IHA on a packed row (TRL's `--packing`: documents with restarting positions, no mask): forward +
  backward (attention per document, against the dense mask of the documents' block diagonal);
- decoding after a prompt, every layer IHA with GQA (SDPA sharing each KV head, against transformers' SDPA, which
  copies keys and values per query head whenever a mask is given): the decoding steps only, the prefill timed apart.

The model is shaped like SmolLM2-135M (`bench_common.SMOLLM2_135M_SHAPE`) with `--layers` layers, float32, one torch
thread, identity mixing converted from a random Llama; steps alternate (the order flips every round) so that load
from other processes falls on both sides, and the load average is recorded.
"""

import os
import platform
import statistics
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm


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

import iha  # noqa: E402
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.models.iha.masking_iha import INSTALLED_PATH_PREFIX  # noqa: E402
from iha.utils.atomic_files import write_json_atomic, write_text_atomic  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (%(default)s: one hybrid block)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens of the hybrid's row (%(default)s)")
    parser.add_argument("--documents", type=int, default=4, help="documents in the packed row (%(default)s)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens before decoding (%(default)s)")
    parser.add_argument("--decode", type=int, default=16, help="decoded tokens (%(default)s)")
    parser.add_argument("--pseudo-heads", type=int, default=2, help="P (%(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every step (%(default)s)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and short rows, for a smoke run")
    return parser.parse_args(argv)


@contextmanager
def without_the_package():
    """transformers' registries as a process without `iha` has them: no `iha|...` entries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    removed = []
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        for name in [name for name in registry if name.startswith(INSTALLED_PATH_PREFIX)]:
            removed.append((registry, name, registry.pop(name)))
    try:
        yield
    finally:
        for registry, name, function in removed:
            registry[name] = function


def both_ways(step) -> dict:
    def without():
        with without_the_package():
            step()

    return {"with": step, "without": without}


def measure(args, progress) -> list[dict]:
    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M_SHAPE
    base = base_model(shape, args.layers)
    generator = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    row = torch.randint(3, vocab, (1, args.seq_len), generator=generator)
    document_len = args.seq_len // args.documents
    packed_positions = torch.arange(document_len).repeat(args.documents)[None]
    prompt = torch.randint(3, vocab, (1, args.prompt), generator=generator)
    hybrid = converted_iha_model(
        base,
        shape,
        args.pseudo_heads,
        iha_position_mode="shared",
        **iha.paper_hybrid_layout(args.layers, args.pseudo_heads, training_length=args.seq_len),
    )
    every_layer = converted_iha_model(base, shape, args.pseudo_heads, iha_position_mode="shared")
    decode_records = {"with": {}, "without": {}}
    cases = {
        "hybrid forward": both_ways(forward_step(hybrid, row)),
        "hybrid forward + backward": both_ways(train_step(hybrid, row)),
        "packed rows forward + backward (every layer IHA)": both_ways(train_step(every_layer, row, packed_positions)),
        # Timed inside the step: the decoding steps apart from the prefill (`bench_common.generation_step`).
        "decoding (every layer IHA, GQA)": {
            "with": generation_step(every_layer, prompt, args.decode, decode_records["with"]),
            "without": both_ways(generation_step(every_layer, prompt, args.decode, decode_records["without"]))[
                "without"
            ],
        },
    }
    rows = []
    for name, steps in cases.items():
        progress.set_description(name)
        model = hybrid if name.startswith("hybrid") else every_layer
        model.train(name.endswith("backward"))
        for run in steps.values():  # warm-up
            run()
        times = alternate(steps, args.repeats)
        if name.startswith("decoding"):  # the decoding steps only, without the warm-up's
            times = {side: {"cpu": decode_records[side]["decode_cpu_s"][1:]} for side in steps}
        ratios = [without / with_ for with_, without in zip(times["with"]["cpu"], times["without"]["cpu"])]
        rows.append(
            {
                "case": name,
                "with_cpu_s": times["with"]["cpu"],
                "without_cpu_s": times["without"]["cpu"],
                "ratio_per_round": ratios,
                "ratio_median": statistics.median(ratios),
            }
        )
        progress.update(1)
    return rows


def markdown(result: dict) -> str:
    regime = result["regime"]
    lines = [
        "# A folder without the `iha` package: what it costs",
        "",
        f"`{result['command']}`, {result['date']}: {regime['machine']}, torch {regime['torch']}, transformers "
        f"{regime['transformers']}, float32, {regime['torch_threads']} torch thread, {regime['layers']} layers of the "
        f"{regime['shape']} shape, P = {regime['pseudo_heads']}, {regime['repeats']} alternating rounds; load average "
        f"{regime['load_before']} before, {regime['load_after']} after (2 cores shared with other work).",
        "",
        "CPU time without the package / with it (the same model, the same inputs; > 1: the folder alone is slower).",
        "",
        "| work | ratio (median) | per round | with (s, median) | without (s, median) |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        per_round = ", ".join(f"{ratio:.2f}" for ratio in row["ratio_per_round"])
        lines.append(
            f"| {row['case']} | {row['ratio_median']:.2f} | {per_round} | {statistics.median(row['with_cpu_s']):.2f} "
            f"| {statistics.median(row['without_cpu_s']):.2f} |"
        )
    lines += [
        "",
        f"The hybrid's row: {regime['seq_len']} tokens; the packed row: {regime['documents']} documents of "
        f"{regime['seq_len'] // regime['documents']} tokens; decoding: {regime['decode']} tokens after a "
        f"{regime['prompt']}-token prompt (`generate`, greedy). KV-cache bytes are equal either way: the folder's own "
        "code builds the sliding caches (`masking_iha.fit_sliding_caches`). Continuous batching is refused without the "
        "package.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.layers, args.seq_len, args.prompt, args.decode, args.repeats = 5, 256, 64, 4, 2
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with tqdm(total=4, desc="bench_without_package") as progress:
        rows = measure(args, progress)
    import transformers

    regime = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "shape": "tiny" if args.quick else "SmolLM2-135M",
        "layers": args.layers,
        "pseudo_heads": args.pseudo_heads,
        "repeats": args.repeats,
        "seq_len": args.seq_len,
        "documents": args.documents,
        "prompt": args.prompt,
        "decode": args.decode,
        "load_before": round(load_before, 1),
        "load_after": round(os.getloadavg()[0], 1),
    }
    command = "python benchmarks/bench_without_package.py" + (" --quick" if args.quick else "")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    result = {"command": command, "date": date, "regime": regime, "rows": rows}
    stem = "without_package_quick" if args.quick else "without_package"
    write_json_atomic(result, RESULTS_DIR / f"{stem}.json")
    write_text_atomic(markdown(result), RESULTS_DIR / f"{stem}.md")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
