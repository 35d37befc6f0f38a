"""Conversion cost next to a plain from_pretrained + save_pretrained of the same checkpoint.

Every measurement runs in a fresh Python process, so peak memory (ru_maxrss) belongs to that one job, and the
jobs alternate (baseline, convert, convert --no-verify, baseline, ...) so that load on a shared machine hits all
of them alike. Reported per job: the time of the operation itself (imports excluded), the whole process's wall
time, peak RSS, and peak RSS above the process's RSS right after the imports (torch + transformers + iha are
about 0.4 GB that does not grow with the model).

    python benchmarks/bench_convert.py                      # SmolLM2-135M-Instruct (fp32) from iha.conversion.builtin
    python benchmarks/bench_convert.py --source path/or/hub-id --repeats 5 --output benchmarks/results/convert.md
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


JOBS = ("baseline", "convert", "convert_no_verify")
JOB_TITLES = {
    "baseline": "from_pretrained + save_pretrained (source, fp32)",
    "convert": "iha-convert, defaults (verification on)",
    "convert_no_verify": "iha-convert --no-verify",
}


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_job(job: str, source: str, destination: str) -> dict:
    """One measurement, inside the worker process. Prints nothing but its JSON result."""
    import torch
    from transformers import AutoModelForCausalLM

    import iha  # noqa: F401  (imported by both jobs so that both pay the same import cost)
    from iha.conversion import convert_checkpoint

    rss_after_imports = current_rss_bytes()
    started = time.perf_counter()
    if job == "baseline":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.save_pretrained(destination)
    else:
        convert_checkpoint(source, destination, verify=job == "convert", show_progress=False)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"seconds": seconds, "peak_rss_bytes": peak, "rss_after_imports_bytes": rss_after_imports}


def checkpoint_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def measure(job: str, source: str, scratch: Path, threads: int | None) -> dict:
    destination = scratch / f"{job}-out"
    shutil.rmtree(destination, ignore_errors=True)
    command = [sys.executable, __file__, "--worker", job, "--source", source, "--destination", str(destination)]
    started = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    process_seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"{job} failed:\n{completed.stderr[-4000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["process_seconds"] = process_seconds
    shutil.rmtree(destination, ignore_errors=True)
    return result


def summarize(runs: list[dict]) -> dict:
    return {
        "seconds_min": min(run["seconds"] for run in runs),
        "seconds_median": statistics.median(run["seconds"] for run in runs),
        "process_seconds_median": statistics.median(run["process_seconds"] for run in runs),
        "peak_rss_bytes_max": max(run["peak_rss_bytes"] for run in runs),
        "peak_above_imports_bytes_max": max(run["peak_rss_bytes"] - run["rss_after_imports_bytes"] for run in runs),
    }


def render_markdown(results: dict) -> str:
    size = results["checkpoint_bytes"]
    mib = 2**20
    baseline = results["jobs"]["baseline"]
    lines = [
        "# Conversion benchmark",
        "",
        f"Source: `{results['source_label']}`, checkpoint {size / mib:.0f} MiB of safetensors; "
        f"{results['repeats']} alternating runs per job, each in a fresh process; {results['machine']}.",
        "",
        "| job | time, min (s) | time, median (s) | process wall, median (s) | peak RSS (MiB) | peak RSS above "
        "imports (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for job in JOBS:
        summary = results["jobs"][job]
        lines.append(
            f"| {JOB_TITLES[job]} | {summary['seconds_min']:.2f} | {summary['seconds_median']:.2f} | "
            f"{summary['process_seconds_median']:.2f} | {summary['peak_rss_bytes_max'] / mib:.0f} | "
            f"{summary['peak_above_imports_bytes_max'] / mib:.0f} |"
        )
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for job in ("convert", "convert_no_verify"):
        summary = results["jobs"][job]
        lines += [
            f"| {JOB_TITLES[job]}: time / baseline time (min) | "
            f"{summary['seconds_min'] / baseline['seconds_min']:.2f} | <= 2 |",
            f"| {JOB_TITLES[job]}: time / baseline time (median) | "
            f"{summary['seconds_median'] / baseline['seconds_median']:.2f} | <= 2 |",
            f"| {JOB_TITLES[job]}: peak RSS / checkpoint size | {summary['peak_rss_bytes_max'] / size:.2f} | <= 2 |",
            f"| {JOB_TITLES[job]}: peak RSS above imports / checkpoint size | "
            f"{summary['peak_above_imports_bytes_max'] / size:.2f} | <= 2 |",
        ]
    lines += [
        f"| baseline: peak RSS / checkpoint size | {baseline['peak_rss_bytes_max'] / size:.2f} | (reference) |",
        "",
        "Verification runs the source twice (sdpa and eager attention, to measure its own fp32 rounding noise) and "
        "the converted model once, on a fixed batch; it holds one model in memory at a time.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--source", help="checkpoint folder or Hub id (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        help="OMP_NUM_THREADS for every job (on a busy machine, 1 avoids OpenMP spin-waiting that slows forwards "
        "by 10x; default: torch's own choice)",
    )
    parser.add_argument("--output", default="benchmarks/results/convert.md", help="markdown path; JSON goes next to it")
    parser.add_argument("--worker", choices=JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--destination", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(run_job(args.worker, args.source, args.destination)))
        return 0

    if args.source is None:
        from iha.conversion.builtin import smollm2_dir

        source = str(smollm2_dir())
        source_label = "SmolLM2-135M-Instruct (iha.conversion.builtin.smollm2_dir(), fp32)"
    else:
        source, source_label = args.source, args.source
    source_dir = Path(source)
    if not source_dir.is_dir():
        from huggingface_hub import snapshot_download

        source_dir = Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
        source = str(source_dir)

    runs = {job: [] for job in JOBS}
    with tempfile.TemporaryDirectory(prefix="iha-bench-convert-") as scratch:
        for repeat in range(args.repeats):
            for job in JOBS:
                result = measure(job, source, Path(scratch), args.threads)
                runs[job].append(result)
                print(
                    f"[{repeat + 1}/{args.repeats}] {job}: {result['seconds']:.2f} s, "
                    f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
    results = {
        "source": source,
        "source_label": source_label,
        "checkpoint_bytes": checkpoint_bytes(source_dir),
        "repeats": args.repeats,
        "machine": (
            f"{os.cpu_count()} CPUs, torch threads {args.threads or 'default'}, "
            f"load average {os.getloadavg()[0]:.1f} at the end"
        ),
        "jobs": {job: summarize(job_runs) for job, job_runs in runs.items()},
        "runs": runs,
    }
    markdown = render_markdown(results)
    from iha.utils.atomic_files import write_json_atomic, write_text_atomic

    output = Path(args.output)
    write_text_atomic(markdown, output)
    write_json_atomic(results, output.with_suffix(".json"))
    print(markdown)
    print(f"Wrote {output} and {output.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
