"""SFT throughput: IHA vs the same base model, under one identical TRL configuration, side by side in one run.

The base model is a Llama-style checkpoint (default: SmolLM2-135M-Instruct from `iha.conversion.builtin`, offline); the IHA
models are the same checkpoint converted with `iha.conversion.llama_to_iha`, one per layout in `--layouts`: every layer
IHA ("global", P pseudo-heads) and the paper's hybrid ("hybrid": 4 sliding IHA layers to 1 global standard layer,
window max_length / (2 P^2)). All train on the same GSM8K rows in OpenThoughts format, with the same `IHASFTConfig`
(packing, assistant-only loss, gradient checkpointing as TRL defaults), and the trainer's own token count per step
gives tokens per second after warm-up.

The device and dtype come from the machine: on CPU float32 with one torch thread and CPU-time ratios; on a CUDA
device bf16 (where supported) and wall-clock ratios, with `--attn_implementation` choosing SDPA, flex attention or
FlashAttention (the hybrid layout's sliding IHA layers need SDPA or flex).

    nice python benchmarks/bench_sft.py                      # CPU, fp32, writes benchmarks/results/sft.{md,json}
    python benchmarks/bench_sft.py --max_length 4096 --steps 20 --batch_size 4   # on a GPU: bf16, SDPA
    python benchmarks/bench_sft.py --attn_implementation flash_attention_2 --layouts global   # FlashAttention varlen
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import iha
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.conversion import llama_to_iha
from iha.data.gsm8k import gsm8k_file_to_openthoughts
from iha.training import IHAScriptArguments, IHASFTConfig, IHASFTTrainer
from iha.training.train import sft_rows
from iha.utils.atomic_files import write_text_atomic


REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


class StepTimer(TrainerCallback):
    """Wall time and process CPU time of every optimizer step, and the trainer's running token count.

    On a shared CPU machine the wall time mostly measures the other jobs' load; the process's CPU time (all its
    threads) measures the work the step itself did, so the CPU ratio is taken from it.
    """

    def __init__(self):
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.token_counts: list[float] = []
        self._started = self._cpu_started = None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._started, self._cpu_started = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_seconds.append(time.perf_counter() - self._started)
        self.step_cpu_seconds.append(time.process_time() - self._cpu_started)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "num_tokens" in logs:
            self.token_counts.append(float(logs["num_tokens"]))


def measure(name, model, tokenizer, rows, args, warmup: int) -> dict:
    """Train `model` for `args.max_steps` steps; tokens per second (wall and CPU) over the steps after `warmup`."""
    timer = StepTimer()
    started = time.perf_counter()
    # TRL's Python route, as `train_sft` builds it but with no conversion (the base model trains as it is) and no
    # final save: the rows as `messages` with the long ones dropped (`sft_rows`), then the trainer.
    train_rows = sft_rows(rows, "train", tokenizer, IHAScriptArguments(), args)
    trainer = IHASFTTrainer(
        model=model, args=args, train_dataset=train_rows, processing_class=tokenizer, callbacks=[timer]
    )
    trainer.train()
    expected_type = "iha" if name.startswith("iha") else model.config.model_type
    if trainer.model.config.model_type != expected_type:
        raise RuntimeError(f"{name}: trained a {trainer.model.config.model_type} model, expected {expected_type}.")
    total_seconds = time.perf_counter() - started
    tokens_per_step = [timer.token_counts[0]] + [b - a for a, b in zip(timer.token_counts, timer.token_counts[1:])]
    if len(tokens_per_step) != len(timer.step_seconds):
        raise RuntimeError(f"{len(tokens_per_step)} token counts for {len(timer.step_seconds)} steps: log every step.")
    measured_tokens = sum(tokens_per_step[warmup:])
    measured_seconds = sum(timer.step_seconds[warmup:])
    measured_cpu_seconds = sum(timer.step_cpu_seconds[warmup:])
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "model": name,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "steps_measured": len(timer.step_seconds) - warmup,
        "tokens_measured": measured_tokens,
        "seconds_measured": measured_seconds,
        "tokens_per_second": measured_tokens / measured_seconds,
        "cpu_seconds_measured": measured_cpu_seconds,
        "tokens_per_cpu_second": measured_tokens / measured_cpu_seconds,
        "median_step_seconds": statistics.median(timer.step_seconds[warmup:]),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "run_seconds": total_seconds,
    }
    print(
        f"{name}: {result['tokens_per_second']:.1f} tokens/s, {result['tokens_per_cpu_second']:.2f} tokens/CPU-s over "
        f"{result['steps_measured']} steps ({measured_tokens:.0f} tokens in {measured_seconds:.1f} s, "
        f"{measured_cpu_seconds:.1f} CPU-s), loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        flush=True,
    )
    del trainer
    return result


def combine(runs: list[dict]) -> dict:
    """One model's rounds: tokens / s over all measured steps of all rounds, plus each round's own figure."""
    tokens = sum(run["tokens_measured"] for run in runs)
    seconds = sum(run["seconds_measured"] for run in runs)
    cpu_seconds = sum(run["cpu_seconds_measured"] for run in runs)
    return {
        **{key: runs[0][key] for key in ("model", "parameters", "first_loss", "last_loss")},
        "steps_measured": sum(run["steps_measured"] for run in runs),
        "tokens_measured": tokens,
        "seconds_measured": seconds,
        "tokens_per_second": tokens / seconds,
        "cpu_seconds_measured": cpu_seconds,
        "tokens_per_cpu_second": tokens / cpu_seconds,
        "median_step_seconds": statistics.median(run["median_step_seconds"] for run in runs),
        "tokens_per_second_by_round": [run["tokens_per_second"] for run in runs],
        "tokens_per_cpu_second_by_round": [run["tokens_per_cpu_second"] for run in runs],
    }


LAYOUT_NOTES = {
    "global": "every layer IHA",
    "hybrid": "the paper's hybrid: 4 sliding IHA layers to 1 global standard layer",
}


def window_note(windows: dict, num_pseudo_heads: int) -> str:
    """What each layout's sliding IHA layers attend to, as the conversion wrote it (empty without sliding layers): the
    paper's flat window of W * P virtual tokens, the only window IHA has."""
    notes = []
    for layout, window in windows.items():
        if window is None:
            continue
        reach = f"the flat window of the last {window * num_pseudo_heads} virtual tokens (W * P, the paper's)"
        notes.append(f"{layout}: sliding window W = {window} tokens, its IHA layers attending to {reach}")
    return ("Windows: " + "; ".join(notes) + ".") if notes else ""


def markdown_report(report: dict) -> str:
    settings = report["settings"]
    lines = [
        "# SFT throughput: IHA vs the same base model (TRL SFTTrainer)",
        "",
        f"Measured by `benchmarks/bench_sft.py` on {report['device']} (torch threads: {report['threads']}), torch "
        f"{report['torch']}, transformers {report['transformers']}, trl {report['trl']}"
        + (f"; {report['date']}" if "date" in report else "")
        + ".",
        "",
        f"Base: `{settings['model']}`; IHA: the same checkpoint converted with `llama_to_iha` "
        f"(P = {settings['num_pseudo_heads']}; layouts: "
        f"{'; '.join(f'{layout}: {LAYOUT_NOTES[layout]}' for layout in settings['layouts'])}). Identical "
        f"`IHASFTConfig`: max_length {settings['max_length']}, packing (bfd, padding-free), per-device batch "
        f"{settings['batch_size']}, assistant-only loss, gradient checkpointing {settings['gradient_checkpointing']}, "
        f"{'bf16' if settings['bf16'] else 'fp32'}, attention `{settings['attn_implementation']}`, AdamW; "
        f"{settings['rounds']} rounds that rotate which model runs first, each run {settings['steps']} optimizer "
        f"steps with the first {settings['warmup']} not measured (warm-up). Data: GSM8K train rows in OpenThoughts "
        "format." + (f" {report['windows']}" if report.get("windows") else ""),
        "",
        *([report["load"], ""] if "load" in report else []),
        "| model | parameters | tokens / s (wall) | tokens / CPU-s | tokens / CPU-s by round | median step (s) "
        "| loss first -> last |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for result in [report["base"], *(report["iha"][layout] for layout in settings["layouts"])]:
        lines.append(
            f"| {result['model']} | {result['parameters'] / 1e6:.3f} M | {result['tokens_per_second']:.2f} | "
            f"{result['tokens_per_cpu_second']:.3f} | "
            f"{', '.join(f'{value:.3f}' for value in result['tokens_per_cpu_second_by_round'])} | "
            f"{result['median_step_seconds']:.2f} | {result['first_loss']:.3f} -> {result['last_loss']:.3f} |"
        )
    lines += ["", f"IHA / base throughput ({report['ratio_basis']}; per round in brackets):", ""]
    for layout in settings["layouts"]:
        ratios = report["ratios"][layout]
        lines.append(
            f"- **{LAYOUT_NOTES[layout]}: {ratios['ratio']:.3f}** (by round: "
            f"{', '.join(f'{value:.3f}' for value in ratios['ratio_by_round'])}); wall-clock ratio "
            f"{ratios['ratio_wall']:.3f}."
        )
    lines.append("")
    if report["ratio_basis"].startswith("CPU"):
        lines += [
            "On a CPU machine shared with other jobs, wall time measures their load as much as this run's work, so the "
            "headline ratio divides tokens by the CPU time the training process itself used (all its threads).",
            "",
        ]
    lines += [
        "In every layer IHA runs attention over N * P virtual tokens (P^2 times the attention FLOPs of a document) "
        "while projections and MLP cost the same. Packed rows attend within each document only (per document on "
        "SDPA), so the attention of a row costs the sum over its documents, not the square of the row's length.",
        "",
    ]
    return "\n".join(lines)


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", help="Llama-style checkpoint (default: SmolLM2-135M-Instruct via iha.conversion.builtin)"
    )
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K-style .jsonl (question, answer)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--num_pseudo_heads", type=int, default=2)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="alternating base/IHA rounds (order flips each round)")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["global", "hybrid"],
        choices=sorted(LAYOUT_NOTES),
        help="IHA layouts to measure beside the base model",
    )
    parser.add_argument(
        "--attn_implementation",
        default="sdpa",
        choices=["sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "eager"],
    )
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 mixed precision (default: on a CUDA device that supports it, off on CPU)",
    )
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default on CPU: 1, so that CPU time counts work rather than threads spinning at "
        "barriers while the machine's other jobs hold the cores)",
    )
    parser.add_argument("--output", default=str(RESULTS_DIR / "sft"), help="writes OUTPUT.md and OUTPUT.json")
    return parser


def main(argv=None):
    parser = make_parser()
    options = parser.parse_args(argv)
    if options.threads is not None or not torch.cuda.is_available():
        torch.set_num_threads(options.threads or 1)
    if options.steps <= options.warmup:
        parser.error("--steps must exceed --warmup")
    if options.bf16 is None:
        options.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    model_label = options.model
    if options.model is None:
        from iha.conversion.builtin import smollm2_dir

        options.model, model_label = str(smollm2_dir()), "SmolLM2-135M-Instruct (iha.conversion.builtin)"
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    rows = gsm8k_file_to_openthoughts(options.data, limit=options.rows)

    def config(output_dir):
        return IHASFTConfig(
            output_dir=output_dir,
            max_steps=options.steps,
            per_device_train_batch_size=options.batch_size,
            learning_rate=1e-5,
            mixing_learning_rate=1e-3,
            max_length=options.max_length,
            packing=True,
            gradient_checkpointing=not options.no_gradient_checkpointing,
            bf16=options.bf16,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )

    windows = {}  # layout -> sliding window in tokens, as the conversion wrote it

    def load(kind):
        model = AutoModelForCausalLM.from_pretrained(
            options.model, dtype=torch.float32, attn_implementation=options.attn_implementation
        )
        if kind == "base":
            return f"{model.config.model_type} (base)", model
        layers = "hybrid" if kind == "hybrid" else "all"
        converted = llama_to_iha(
            model,
            num_pseudo_heads=options.num_pseudo_heads,
            layers=layers,
            training_length=options.max_length,
            share_weights=True,
        )
        windows[kind] = converted.config.sliding_window
        return f"iha (P={options.num_pseudo_heads}, {kind})", converted

    # Rounds rotate the order (base, global, hybrid), (global, hybrid, base), ... so that a shared machine's changing
    # load falls on every model alike; every run starts from freshly loaded weights.
    kinds = ["base", *options.layouts]
    runs = {kind: [] for kind in kinds}
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(options.rounds):
            shift = round_index % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                name, model = load(kind)
                runs[kind].append(measure(name, model, tokenizer, rows, config(scratch), options.warmup))
                del model
    results = {kind: combine(kind_runs) for kind, kind_runs in runs.items()}

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86-64'})"
    report = {
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": (
            f"Load average (1 min) {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end of the "
            f"run on {os.cpu_count()} cores."
        ),
        "windows": window_note(windows, options.num_pseudo_heads),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "iha_version": iha.__version__,
        "settings": {
            "model": model_label,
            "num_pseudo_heads": options.num_pseudo_heads,
            "max_length": options.max_length,
            "batch_size": options.batch_size,
            "steps": options.steps,
            "warmup": options.warmup,
            "bf16": options.bf16,
            "attn_implementation": options.attn_implementation,
            "gradient_checkpointing": not options.no_gradient_checkpointing,
            "rows": options.rows,
            "rounds": options.rounds,
            "layouts": options.layouts,
        },
        "base": results["base"],
        "iha": {layout: results[layout] for layout in options.layouts},
    }
    on_gpu = torch.cuda.is_available()
    rate = "tokens_per_second" if on_gpu else "tokens_per_cpu_second"
    report["ratio_basis"] = "wall-clock tokens per second" if on_gpu else "CPU-time tokens per CPU-second"
    report["ratios"] = {
        layout: {
            "ratio": results[layout][rate] / results["base"][rate],
            "ratio_by_round": [
                iha_rate / base_rate
                for iha_rate, base_rate in zip(results[layout][f"{rate}_by_round"], results["base"][f"{rate}_by_round"])
            ],
            "ratio_wall": results[layout]["tokens_per_second"] / results["base"]["tokens_per_second"],
            "ratio_cpu_time": results[layout]["tokens_per_cpu_second"] / results["base"]["tokens_per_cpu_second"],
        }
        for layout in options.layouts
    }
    output = Path(options.output)
    write_text_atomic(json.dumps(report, indent=2) + "\n", output.with_suffix(".json"))
    write_text_atomic(markdown_report(report), output.with_suffix(".md"))
    for layout in options.layouts:
        print(f"IHA ({layout}) / base throughput ({report['ratio_basis']}): {report['ratios'][layout]['ratio']:.3f}")
    print(f"-> {output.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
