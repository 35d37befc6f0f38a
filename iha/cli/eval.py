"""`iha-eval`: math evaluation (GSM8K, MATH-500), the needle task, and side-by-side reports.

    iha-eval math --model base=HuggingFaceTB/SmolLM2-135M-Instruct --model iha=./smollm2-iha \\
        --dataset gsm8k --dataset math500 --preset paper --output_dir runs/eval
    iha-eval math --model iha=./smollm2-iha --dataset gsm8k=my_gsm8k_test.jsonl --limit 16
    iha-eval needle --model iha=./smollm2-iha --lengths 1024 2048 4096 --num_keys 1 --num_distractors 3
    iha-eval compare runs/eval/base_gsm8k.json runs/eval/iha_gsm8k.json --output report.md

`--dataset gsm8k` / `math500` read the Hub datasets openai/gsm8k / HuggingFaceH4/MATH-500;
`--dataset gsm8k=FILE.jsonl` reads your own copy with the same columns.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..evaluation.needle import evaluate_needle
from ..evaluation.report import math_report, needle_report
from ..evaluation.settings import BENCHMARKS, PRESETS, SamplingConfig, sampling_preset
from ..utils.atomic_files import write_json_atomic, write_text_atomic
from ..utils.atomic_folders import check_output_folder
from ..utils.model_source import check_model_source
from .arguments import (
    ArgumentParser,
    HelpFormatter,
    add_dataclass_arguments,
    add_threads_argument,
    dataclass_values,
    non_negative_int,
    positive_int,
    set_threads,
)
from .running import run_command


def _named(value: str, what: str) -> tuple[str, str]:
    """`NAME=VALUE` -> (NAME, VALUE); a bare VALUE is named after its last path component."""
    if "=" in value:
        name, _, rest = value.partition("=")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise argparse.ArgumentTypeError(f"{what} name {name!r} may use only letters, digits, '_', '.', '-'.")
        return name, rest
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(value.rstrip("/")).name) or what
    return name, value


NEEDLE_DESCRIPTION = """RULER-style multi-key needle in a haystack, greedy decoding, exact match.

Cost: every example is a full forward pass over its context. The defaults (50 examples at 1024, 2048 and 4096
tokens) take about 45 minutes for a 135M model on 2 CPU cores; `--num_examples 5 --lengths 1024` takes a few
minutes. A progress bar per context length shows how far it is."""


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="[NAME=]PATH",
        help="model folder or Hub id; repeat for a side-by-side report (the first is the reference)",
    )
    parser.add_argument("--gguf-file", default=None, help="load PATH/GGUF_FILE (dequantized) instead of safetensors")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights dtype"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow code from the model folder")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="prompts per generate call")
    parser.add_argument("--no-chat-template", action="store_true", help="plain 'Question: ... Answer:' prompts")
    add_threads_argument(parser)


def make_parser(prog: str = "iha-eval") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    math = commands.add_parser(
        "math",
        help="GSM8K / MATH-500: pass@1 and majority vote",
        description="GSM8K / MATH-500: pass@1 and majority vote over samples, answers compared with math-verify.",
        formatter_class=HelpFormatter,
    )
    _add_model_arguments(math)
    math.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="BENCHMARK[=SOURCE]",
        help=f"benchmark in {sorted(BENCHMARKS)}: alone it reads the Hub dataset ("
        + ", ".join(f"{name}: {spec.hub_id}" for name, spec in BENCHMARKS.items())
        + "); =FILE.jsonl reads your own copy, =ORG/NAME another Hub dataset with the same columns; repeatable",
    )
    math.add_argument("--split", default=None, help="Hub split (default: test)")
    math.add_argument("--limit", type=positive_int, default=None, help="evaluate the first N problems only")
    math.add_argument("--preset", default="greedy", choices=sorted(PRESETS), help="sampling settings")
    add_dataclass_arguments(math, SamplingConfig, "sampling", from_preset=dict(sorted(PRESETS.items())))
    math.add_argument("--system-prompt", default=None, help="system message (default: the chat template's own)")
    math.add_argument(
        "--output-dir", default="runs/eval", help="writes MODEL_BENCHMARK.json, report.md and report.json"
    )

    needle = commands.add_parser(
        "needle",
        help="RULER-style multi-key needle in a haystack",
        description=NEEDLE_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    _add_model_arguments(needle)
    needle.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096], help="context lengths (tokens)"
    )
    needle.add_argument("--num-keys", type=positive_int, default=1, help="needles asked about per example")
    needle.add_argument("--num-distractors", type=non_negative_int, default=3, help="needles not asked about")
    needle.add_argument("--num-examples", type=positive_int, default=50, help="examples per context length")
    needle.add_argument("--seed", type=non_negative_int, default=0, help="seed of the generated examples")
    needle.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens generated per answer")
    needle.add_argument("--output-dir", default="runs/needle", help="writes needle_MODEL.json, needle_report.md")

    compare = commands.add_parser(
        "compare",
        help="side-by-side markdown report from result JSON files",
        description="A side-by-side markdown report from the result files of `iha-eval math`.",
        formatter_class=HelpFormatter,
    )
    compare.add_argument("results", nargs="+", help="MODEL_BENCHMARK.json files written by `iha-eval math`")
    compare.add_argument("--output", default=None, help="markdown file (default: print)")
    compare.add_argument("--title", default="Math evaluation", help="report heading")
    return parser


def _named_models(args) -> list[tuple[str, str]]:
    """(name, folder or Hub id) of every --model, each checked before any is loaded."""
    models = [_named(spec, "model") for spec in args.model]
    for _, path in models:
        check_model_source(path)
    return models


def _run_math(args) -> int:
    # Imported here: scoring loads math-verify, which `iha eval compare` and `--help` do not need.
    from ..evaluation.math_eval import evaluate_math, load_model_and_tokenizer, load_problems

    sampling = sampling_preset(args.preset, **dataclass_values(args, SamplingConfig))
    models = _named_models(args)
    output_dir = check_output_folder(args.output_dir)  # a file in its way is said now, not after the evaluation
    datasets = []
    for spec in args.dataset:
        benchmark, _, source = spec.partition("=")
        if benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {benchmark!r} in --dataset; choose from {sorted(BENCHMARKS)}")
        problems = load_problems(source or benchmark, benchmark=benchmark, split=args.split, limit=args.limit)
        datasets.append((benchmark, source or BENCHMARKS[benchmark].hub_id, problems))
    results = []
    for name, path in models:
        model, tokenizer = load_model_and_tokenizer(
            path, args.dtype, args.device, args.trust_remote_code, args.gguf_file
        )
        for benchmark, source, problems in datasets:
            result = evaluate_math(
                model,
                tokenizer,
                problems,
                sampling,
                batch_size=args.batch_size,
                model_name=name,
                benchmark=benchmark,
                source=source,
                system_prompt=args.system_prompt,
                use_chat_template=not args.no_chat_template,
            ).to_dict()
            result["model_path"] = path
            write_json_atomic(result, output_dir / f"{name}_{benchmark}.json")
            results.append(result)
            print(f"{name} / {benchmark}: " + ", ".join(f"{k} {100 * v:.1f}" for k, v in result["metrics"].items()))
        del model
    report = math_report(results)
    write_text_atomic(report, output_dir / "report.md")
    summary = [{key: value for key, value in result.items() if key != "problems"} for result in results]
    write_json_atomic(summary, output_dir / "report.json")
    print(report)
    return 0


def _run_needle(args) -> int:
    # Imported here: the loader's module loads math-verify, which `iha eval compare` and `--help` do not need.
    from ..evaluation.math_eval import load_model_and_tokenizer

    models = _named_models(args)
    output_dir = check_output_folder(args.output_dir)  # a file in its way is said now, not after the evaluation
    print(
        f"needle: {args.num_examples} examples at each of {len(args.lengths)} context lengths "
        f"({', '.join(map(str, args.lengths))} tokens) per model, {args.batch_size} per batch; results in {output_dir}",
        flush=True,
    )
    results = []
    for name, path in models:
        model, tokenizer = load_model_and_tokenizer(
            path, args.dtype, args.device, args.trust_remote_code, args.gguf_file
        )
        result = evaluate_needle(
            model,
            tokenizer,
            args.lengths,
            num_keys=args.num_keys,
            num_distractors=args.num_distractors,
            num_examples=args.num_examples,
            seed=args.seed,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            model_name=name,
            use_chat_template=not args.no_chat_template,
        )
        write_json_atomic(result, output_dir / f"needle_{name}.json")
        results.append(result)
        del model
    report = needle_report(results)
    write_text_atomic(report, output_dir / "needle_report.md")
    print(report)
    return 0


def _run_compare(args) -> int:
    results = []
    for path in args.results:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read {path}: {error}") from None
        items = data if isinstance(data, list) else [data]
        for item in items:
            if not {"model", "benchmark", "metrics"} <= set(item):
                raise ValueError(f"{path} is not a result file of `iha-eval math`.")
        results.extend(items)
    report = math_report(results, title=args.title)
    if args.output:
        write_text_atomic(report, args.output)
    print(report)
    return 0


def main(argv: list[str] | None = None, prog: str = "iha-eval") -> int:
    """Bad input prints one line (exit 2); Ctrl-C / SIGTERM exit 130 / 143. Result files are written whole (to a
    temporary name, then renamed), so an interrupted run leaves only complete ones."""
    args = make_parser(prog).parse_args(argv)
    run = {"math": _run_math, "needle": _run_needle, "compare": _run_compare}[args.command]
    set_threads(getattr(args, "threads", None))  # `compare` computes nothing
    return run_command(
        f"{prog} {args.command}",
        lambda: run(args),
        interrupted="the result files written so far are complete; no other file was written",
    )
