"""Run converted IHA models on several transformers releases, each in an environment that cannot import `iha`.

A model folder travels with its code files (`configuration_iha.py`, `modeling_iha.py`, ..., `version_iha.py`) and is
loaded by whatever transformers its user has. For each release this script builds (once, then reuses) an environment
with torch and only that transformers, and runs `transformers_matrix_check.py` there on folders converted here once:
a tiny Llama (GQA), a tiny Mistral (sliding window), a tiny Qwen3 (per-head q/k norm, explicit head_dim, a sliding
layer), a tiny SmolLM3 (a NoPE sliding layer), a tiny Gemma 3 (sliding and full layers, one KV head, its own scale)
and the real SmolLM2-135M-Instruct; with `--gemma3` also the real Gemma 3 270M (`iha.conversion.builtin.gemma3_dir`; minutes
per release on 2 cores, so not in CI: its last run is in benchmarks/results/gemma3_270m/). Per release and model it
checks that the logits equal the source's on a left-padded batch (within fp32 rounding, measured as the source's own
sdpa-vs-eager difference) and that greedy tokens with DynamicCache, StaticCache and no cache equal the source's; and,
loaded in bf16 (the tiny models: a real model's bf16 optimizer steps take minutes per release on a CPU), that the
mixing loads in fp32, the logits match the bf16 source and a few optimizer steps move the mixing entries that start
at 1.0 (which bf16 weights would freeze). The tiny Llama and Mistral folders also run with
random head mixing through continuous batching (`generate_batch`) against `generate()`, or must refuse where that
release's continuous batching cannot be right for them (sliding windows before 5.16); psutil sits beside torch there,
as continuous batching on CPU reads the free memory through it. Below the supported range it checks that loading is
refused with one clear message.

    python scripts/transformers_matrix.py                      # the default releases (see RELEASES)
    python scripts/transformers_matrix.py --releases 5.20.0    # others, or several
    python scripts/transformers_matrix.py --no-smollm2         # tiny models only
    python scripts/transformers_matrix.py --gemma3             # and the real Gemma 3 270M
    python scripts/transformers_matrix.py --jobs 1             # one release at a time (default: 2 at once)

Environments are cached in `--cache-dir` (default ~/.cache/iha/transformers-matrix); the report (a Markdown table and
JSON) goes to `--output-dir`. Exits 1 when any release fails. Needs the package index for the first build of each
environment; runs offline afterwards.
"""

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.models.iha.version_iha import MINIMUM_TRANSFORMERS, newest_tested_line, supported_range_text  # noqa: E402
from iha.utils.atomic_files import write_json_atomic, write_text_atomic  # noqa: E402


def setup_constants(*names: str) -> dict:
    """Module-level literals of setup.py (read, not run: running it would call `setup()`)."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text(encoding="utf-8"))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"setup.py defines no literal {sorted(missing)}")
    return found


# The ends of the supported range (`SUPPORTED_TRANSFORMERS` in version_iha.py: the oldest release and the first of the
# newest tested line), the last release before `Cache.get_query_offset` (the compatibility fallback), and the
# development release (setup.py).
DEVELOPMENT_RELEASE = setup_constants("DEVELOPMENT_TRANSFORMERS")["DEVELOPMENT_TRANSFORMERS"].partition("==")[2]
RELEASES = [str(MINIMUM_TRANSFORMERS), "5.13.1", DEVELOPMENT_RELEASE, f"{newest_tested_line()}.0"]
# Releases below the supported range, where loading must be refused clearly.
REFUSED_RELEASES = ["5.3.0"]
CHECK_SCRIPT = Path(__file__).resolve().with_name("transformers_matrix_check.py")


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--releases", nargs="+", default=RELEASES, help="supported releases to check (%(default)s)")
    parser.add_argument(
        "--refused-releases", nargs="*", default=REFUSED_RELEASES, help="releases that must be refused (%(default)s)"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/iha/transformers-matrix").expanduser())
    parser.add_argument("--output-dir", type=Path, default=Path("runs/transformers_matrix"))
    parser.add_argument("--no-smollm2", action="store_true", help="check the tiny models only")
    parser.add_argument("--gemma3", action="store_true", help="also check the real Gemma 3 270M (minutes per release)")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="releases checked at once (%(default)s)"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def log(message: str):
    print(f"[transformers-matrix] {message}", flush=True)


def public_version(version: str) -> str:
    return version.split("+")[0]


def torch_environment(cache_dir: Path) -> Path:
    """A virtual environment holding torch alone (the version installed here); returns its interpreter. Built once
    under a lock: `make trl-oldest` shares it and may run at the same time."""
    import torch
    from filelock import FileLock

    venv = cache_dir / f"torch-{public_version(torch.__version__)}"
    python = venv / "bin" / "python"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv.with_name(f".{venv.name}.lock"))):
        if (venv / ".complete").is_file():
            return python
        log(f"building {venv} (torch {public_version(torch.__version__)})")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # --no-compile: byte-compiling every module at install costs more than compiling the few a check imports.
        torch_requirement = f"torch=={public_version(torch.__version__)}"
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", torch_requirement], check=True)
        (venv / ".complete").touch()
    return python


def package_environment(cache_dir: Path, python: Path, name: str, requirement: str) -> Path:
    """A folder `cache_dir / name` holding `requirement` and its dependencies (built once), put on PYTHONPATH of the
    torch environment."""
    target = cache_dir / name
    if (target / ".complete").is_file():
        return target
    log(f"installing {requirement} into {target}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--no-compile", "--target", str(staging), requirement],
            check=True,
        )
        (staging / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def transformers_environment(cache_dir: Path, python: Path, release: str) -> Path:
    """One transformers release and its dependencies."""
    return package_environment(cache_dir, python, f"transformers-{release}", f"transformers=={release}")


def psutil_environment(cache_dir: Path, python: Path) -> Path:
    """psutil alone: continuous batching on CPU reads the free memory through it (before 5.2x it stops without)."""
    return package_environment(cache_dir, python, "psutil", "psutil")


def tiny_sources(work_dir: Path) -> list[Path]:
    """Tiny random models of every supported architecture, saved: a Llama (GQA, untied head), a Mistral (window of
    4 tokens), a Qwen3 (per-head q/k norm, head_dim 16 apart from hidden / heads, its last layer sliding), a SmolLM3
    (its second layer without RoPE and sliding, tied embeddings) and a Gemma 3 (two sliding layers and a full one, one
    KV head, `query_pre_attn_scalar` apart from head_dim). The new architectures' weights are moved off their initial
    values, so that their norms (Gemma's start at zero) count."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    sizes = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    window = dict(use_sliding_window=True, sliding_window=4)
    gemma3_sizes = {**sizes, "num_hidden_layers": 3, "num_key_value_heads": 1}
    sources = []
    for name, model_class, config in [
        ("tiny-llama", LlamaForCausalLM, LlamaConfig(**sizes, tie_word_embeddings=False)),
        ("tiny-mistral", MistralForCausalLM, MistralConfig(**sizes, sliding_window=4)),
        ("tiny-qwen3", Qwen3ForCausalLM, Qwen3Config(**sizes, head_dim=16, max_window_layers=1, **window)),
        ("tiny-smollm3", SmolLM3ForCausalLM, SmolLM3Config(**sizes, no_rope_layer_interval=2, **window)),
        (
            "tiny-gemma3",
            Gemma3ForCausalLM,
            Gemma3TextConfig(
                **gemma3_sizes, head_dim=16, query_pre_attn_scalar=12, sliding_window=4, sliding_window_pattern=3
            ),
        ),
    ]:
        torch.manual_seed(0)
        model = model_class(config)
        if name not in ("tiny-llama", "tiny-mistral"):  # those two stay as in earlier reports
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
        model.save_pretrained(work_dir / name)
        sources.append(work_dir / name)
    return sources


def convert_sources(sources: list[Path], work_dir: Path) -> list[tuple[Path, Path]]:
    from iha.conversion import convert_checkpoint

    pairs = []
    for source in sources:
        converted = work_dir / f"{source.name}-iha"
        report = convert_checkpoint(source, converted, show_progress=False)
        log(f"converted {source.name}: {report.verification.message if report.verification else 'not verified'}")
        pairs.append((source, converted))
    return pairs


def run_check(python: Path, site: str, arguments: list[str], threads: str | None = None) -> dict:
    """Run the check script in the clean environment, from an empty folder (so `iha` cannot be imported), with
    `threads` torch threads unless the caller's OMP_NUM_THREADS says otherwise (torch's default where None)."""
    environment = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    environment.update(PYTHONPATH=site, HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1", TOKENIZERS_PARALLELISM="false")
    if threads is not None:
        environment.setdefault("OMP_NUM_THREADS", threads)  # a user's own choice is kept
    with tempfile.TemporaryDirectory() as empty:
        # Its own copy of the folders' code files: transformers copies them into the modules cache without a lock,
        # and checks running at the same time would write the same files.
        environment["HF_MODULES_CACHE"] = str(Path(empty) / "modules")
        completed = subprocess.run(
            [str(python), str(CHECK_SCRIPT), *arguments],
            cwd=empty,
            env=environment,
            capture_output=True,
            text=True,
        )
    lines = completed.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"passed": False, "crash": completed.stderr.strip().splitlines()[-5:]}


def package_import_error(python: Path, site: Path) -> str:
    """What `import iha` (the installed package, not a model folder) says on this release: the same guard."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONHOME", "VIRTUAL_ENV")}
    environment.update(PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}", PYTHONNOUSERSITE="1")
    completed = subprocess.run(
        [str(python), "-c", "import iha; print('imported')"], env=environment, capture_output=True, text=True
    )
    output = (completed.stdout + completed.stderr).strip().splitlines()
    return output[-1] if output else ""


def log_release(release: str, result: dict) -> None:
    """One line per continuous-batching folder and per model of a release's check, then its crash if any."""
    for batched in result.get("continuous_batching", []):
        log(
            f"transformers {release}, {batched['folder']}, continuous batching: {batched['continuous_batching']} "
            f"({'ok' if batched['passed'] else 'FAILED'}, {batched['seconds']} s)"
        )
    for model in result.get("models", []):
        log(
            f"transformers {release}, {Path(model['source']).name}: {'ok' if model['passed'] else 'FAILED'} "
            f"(logits {model['logit_difference']:.1e}, dynamic {model['dynamic_cache']}, static "
            f"{model['static_cache']}, no cache {model['no_cache']}, bf16 {bf16_cell(model)}, {model['seconds']} s)"
        )
    if "crash" in result:
        log(f"transformers {release}: the check crashed:\n" + "\n".join(result["crash"]))


def bf16_cell(model: dict) -> str:
    if not model.get("bf16_checked", True):
        return "not run (tiny models only)"
    dtype = "fp32" if model["bf16_mixing_fp32"] else "**not fp32**"
    moved = model["bf16_identity_entries"] - model["bf16_identity_entries_unmoved"]
    moved_text = f"{moved} of {model['bf16_identity_entries']}"
    if not model["bf16_identity_learns"]:
        moved_text = f"**{moved_text}**"
    difference = f"{model['bf16_logit_difference']:.1e} ({model['bf16_tolerance']:.0e})"
    if not model["bf16_logits_equal"]:
        difference = f"**{difference}**"
    return f"{dtype}, {difference}, {moved_text}"


def markdown_table(results: list[dict]) -> str:
    lines = [
        f"Supported: {supported_range_text()}. Each row ran in an environment with torch and only that transformers "
        "(`iha` not importable), loading the converted folders through `trust_remote_code`. Logit difference: max "
        "|IHA - source| over the real tokens of a left-padded batch of 3 (tolerance in brackets: 4x the source's own "
        "sdpa-vs-eager difference, at least 1e-5). Greedy: 16 new tokens, equal to the source's. bf16: both models "
        "loaded with `dtype=torch.bfloat16`; the mixing must load in fp32, the logits match the bf16 source (tolerance "
        "4x its sdpa-vs-eager difference, at least 1e-2), and 5 AdamW steps at 1e-3 move every mixing entry that "
        "starts at 1.0.",
        "",
        "| transformers | model | load | logit difference | greedy, DynamicCache | greedy, StaticCache | greedy, no cache "
        "| bf16: mixing dtype, logit difference, identity entries moved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "models" not in result:
            outcome = "refused: " + (result.get("error") or "NOT REFUSED").split("\n")[0]
            if not result["passed"]:
                outcome = f"**{outcome}** (import iha: {result.get('package_import')})"
            lines.append(f"| {result['transformers']} | all | {outcome} | - | - | - | - | - |")
            continue
        for model in result["models"]:

            def mark(key, model=model):
                return "equal" if model[key] else ("**error**" if f"{key}_error" in model else "**different**")

            lines.append(
                f"| {result['transformers']} | {Path(model['source']).name} | ok | "
                f"{model['logit_difference']:.1e} ({model['tolerance']:.0e}) | {mark('dynamic_cache')} | "
                f"{mark('static_cache')} | {mark('no_cache')} | {bf16_cell(model)} |"
            )
    batched = [(result["transformers"], row) for result in results for row in result.get("continuous_batching", [])]
    if batched:
        lines += [
            "",
            "Continuous batching (`generate_batch`: 4 prompts of 2-17 tokens, 10 greedy tokens each, a paged cache of "
            "16 blocks of 16 tokens, at most 32 tokens per batch) of the tiny folders with random head mixing, against "
            "`generate()` on each prompt alone. Where the release's continuous batching cannot be right for the model "
            "(sliding-window layers before 5.16, whose pages read back wrong tokens for a stock Mistral too), the model "
            "must refuse with the fix.",
            "",
            "| transformers | model | continuous batching |",
            "|---|---|---|",
        ]
        for release, row in batched:
            outcome = row["continuous_batching"] if row["passed"] else f"**{row['continuous_batching']}**"
            if row.get("message"):
                outcome += f": {row['message'].split('. ')[0]}"
            lines.append(f"| {release} | {row['folder'].removesuffix('-iha')} | {outcome} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    log(f"supported {supported_range_text()}; checking {args.releases}, refusal on {args.refused_releases}")
    work_dir = Path(tempfile.mkdtemp(prefix="iha-matrix-"))
    try:
        sources = tiny_sources(work_dir)
        if not args.no_smollm2:
            from iha.conversion.builtin import smollm2_dir

            sources.append(smollm2_dir())
        if args.gemma3:
            from iha.conversion.builtin import gemma3_dir

            sources.append(gemma3_dir())
        pairs = convert_sources(sources, work_dir)
        tiny_folders = [str(converted) for _, converted in pairs[:2]]
        python = torch_environment(args.cache_dir)
        psutil_site = psutil_environment(args.cache_dir, python)

        results = []
        for release in args.refused_releases:
            site = transformers_environment(args.cache_dir, python, release)
            result = run_check(python, str(site), ["refuse", str(pairs[0][1])])
            result.setdefault("transformers", release)
            result["package_import"] = package_import_error(python, site)
            result["passed"] = result["passed"] and "UnsupportedTransformersError: " in result["package_import"]
            log(f"transformers {release}: {'refused clearly' if result['passed'] else 'FAILED'}: {result.get('error')}")
            results.append(result)
        arguments = ["check", *[str(path) for pair in pairs for path in pair], "--batch", *tiny_folders]
        sites = {
            release: f"{transformers_environment(args.cache_dir, python, release)}{os.pathsep}{psutil_site}"
            for release in args.releases
        }
        # The releases are independent processes: run `--jobs` at a time, this machine's cores shared out among them
        # (other jobs running beside the matrix are not counted).
        threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
        by_release = {}
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            checks = {
                pool.submit(run_check, python, site, arguments, threads): release for release, site in sites.items()
            }
            log(f"checking {', '.join(sites)}, {args.jobs} at a time")
            for check in as_completed(checks):
                release = checks[check]
                try:
                    result = check.result()
                except Exception as error:  # one release's failure must not lose the others' report
                    result = {"passed": False, "crash": [repr(error)]}
                result.setdefault("transformers", release)
                log_release(release, result)
                by_release[release] = result
        results += [by_release[release] for release in sites]  # the report keeps the order of --releases
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    failed = [result["transformers"] for result in results if not result["passed"]]
    summary = {
        "supported": supported_range_text(),
        "minimum": str(MINIMUM_TRANSFORMERS),
        "newest_tested": newest_tested_line(),
        "results": results,
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(summary, args.output_dir / "transformers_matrix.json")
    write_text_atomic(markdown_table(results), args.output_dir / "transformers_matrix.md")
    print(markdown_table(results))
    log(f"{'FAILED on ' + ', '.join(failed) if failed else 'all releases passed'} in {summary['seconds']} s")
    print(f"transformers-matrix: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
