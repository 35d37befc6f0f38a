"""Run converted IHA folders on several transformers releases, each in fresh interpreters with only that release.

A model folder travels with its code files (`configuration_iha.py`, `modeling_iha.py`, ..., `version_iha.py`) and is
loaded by whatever transformers its user has, with or without the `iha` package. For each release this script builds
(once, then reuses) an environment with torch and only that transformers, and runs `transformers_matrix_check.py`
there twice, each time in a fresh interpreter, on folders converted here once:

1. Without `iha` (it cannot be imported): a tiny Llama (GQA), a tiny Mistral (sliding window), a tiny Qwen3 (per-head
   q/k norm, explicit head_dim, a sliding layer), a tiny SmolLM3 (a NoPE sliding layer), a tiny Gemma 3 (sliding and
   full layers, one KV head, its own scale) and the real SmolLM2-135M-Instruct, converted at identity and loaded with
   `trust_remote_code`, against their source models: logits on a left-padded batch (within fp32 rounding, measured as
   the source's own sdpa-vs-eager difference), greedy tokens with DynamicCache, StaticCache and no cache; and, loaded
   in bf16 (the tiny models: a real model's bf16 optimizer steps take minutes per release on a CPU), the mixing loads in
   fp32, the logits match the bf16 source and a few optimizer steps move the mixing entries that start at 1.0 (which
   bf16 weights would freeze). With `--gemma3` also the real Gemma 3 270M (`iha.conversion.builtin.gemma3_dir`;
   minutes per release on 2 cores, so not in CI: its last run is in benchmarks/results/gemma3_270m/).
2. Three folders with random (trained-looking) head mixing, global (the tiny Llama at identity), the paper's hybrid
   (`--layers hybrid` on a tiny 5-layer Llama: 4 sliding IHA layers at P = 2 with the paper's window, 1 global
   standard layer) and Gemma 3, run in both interpreters, without `iha` (transformers' own attention functions) and
   with `iha` imported (the repository on PYTHONPATH: the package's fast paths): logits of a long left-padded batch
   (long enough for the blocked sliding-window path) and of a packed row (restarting position ids, no mask: the
   per-document path), greedy tokens past the window with DynamicCache and StaticCache. Both sets must agree (logits
   within fp32 rounding, tokens equal), and with `iha` imported its plans must have run.
3. Continuous batching (`generate_batch`) of the same three folders: without `iha` it must refuse with the one line
   that names the fix (`modeling_iha.NEEDS_THE_PACKAGE`); with `iha` imported it must decode what `generate()` decodes,
   or refuse with the fix where that release's continuous batching cannot be right (sliding windows before 5.16).
   psutil sits beside torch there: continuous batching on CPU reads the free memory through it.

Below the supported range it checks that loading is refused with one clear message, and `import iha` too.

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
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformers_matrix_check import (  # noqa: E402  (what the check runs, for the report's words)
    BATCH_NEW_TOKENS,
    BATCH_PROMPT_LENGTHS,
    GREEDY_TOKENS,
    LEFT_PADDING,
    LONG_LENGTH,
    PACKED_DOCUMENTS,
)

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
    parser.add_argument(
        "--iha-path",
        type=Path,
        default=REPO_ROOT,
        help="the folder holding the `iha` package that the interpreters with it import (default: this repository)",
    )
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


# The tiny sources' sizes (2 layers; the hybrid's Llama takes 5).
TINY_SIZES = dict(
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

    sizes = TINY_SIZES
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


def hybrid_folder(work_dir: Path) -> Path:
    """A tiny Llama of 5 layers (the size of `tiny_sources`' Llama) converted with `--layers hybrid`: the paper's 4
    sliding IHA layers at P = 2 then a global standard layer, its window the paper's N / (2 P^2) tokens of the
    training length (`max_position_embeddings`, 128: 16 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from iha.conversion import convert_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_SIZES, "num_hidden_layers": 5}, tie_word_embeddings=False)
    source = work_dir / "tiny-llama-5-layers"
    LlamaForCausalLM(config).save_pretrained(source)
    converted = work_dir / "tiny-llama-hybrid-iha"
    convert_checkpoint(source, converted, layers="hybrid", num_pseudo_heads=2, show_progress=False)
    layout = json.loads((converted / "config.json").read_text(encoding="utf-8"))
    log(f"converted {source.name} --layers hybrid: {layout['attention_types']}, window {layout['sliding_window']}")
    return converted


def with_random_mixing(folder: Path, work_dir: Path, scale: float = 0.3) -> Path:
    """A copy of `folder` whose head mixing is moved off identity, as training moves it: every mixing and collapse
    entry plus `scale` * N(0, 1), seeded. The weights are edited in the safetensors file, the rest copied as written."""
    import torch
    from safetensors.torch import load_file, save_file

    mixed = work_dir / f"{folder.name.removesuffix('-iha')}-mixed-iha"
    shutil.copytree(folder, mixed)
    weight_files = sorted(mixed.glob("*.safetensors"))
    if not weight_files:
        raise SystemExit(f"{folder} holds no safetensors weights")
    generator = torch.Generator().manual_seed(0)
    moved = 0
    for weight_file in weight_files:
        tensors = load_file(weight_file)
        for name in sorted(tensors):
            if ".head_mixing." in name:
                tensors[name] = tensors[name] + scale * torch.randn(tensors[name].shape, generator=generator)
                moved += 1
        save_file(tensors, weight_file, metadata={"format": "pt"})
    if not moved:
        raise SystemExit(f"{folder} has no head mixing to move")
    return mixed


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
    """Run the check script in a fresh interpreter of the clean environment, from an empty folder, with `threads`
    torch threads unless the caller's OMP_NUM_THREADS says otherwise (torch's default where None). `site` is its
    PYTHONPATH: the release's packages, and the repository too where the check runs with `iha` importable."""
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
        return {"passed": False, "crash": completed.stderr.strip().splitlines()[-8:]}


# Which of the package's plans must run for a folder's IHA layers (`PlanRecorder` in the check script names them by
# the kind of mask the package's `iha|sdpa` attention got): sliding layers run blocked on the long batch and the
# packed row, full layers attend per document on the packed row.
BLOCKED, PER_DOCUMENT = "BlockedLocalMask", "PackedDocumentsMask"


def expected_plans(folder: Path) -> dict[str, set[str]]:
    attention_types = set(json.loads((folder / "config.json").read_text(encoding="utf-8"))["attention_types"])
    padded, packed = set(), set()
    if "iha_sliding_attention" in attention_types:
        padded.add(BLOCKED)
        packed.add(BLOCKED)
    if "iha_full_attention" in attention_types:
        packed.add(PER_DOCUMENT)
    return {"padded": padded, "packed": packed}


def largest_difference(first, second, where=None) -> float:
    difference = (first - second).abs()
    return (difference[where] if where is not None else difference).max().item()


def compare_outputs(without_path: Path, with_path: Path, folders: list[Path]) -> list[dict]:
    """The outputs of each folder without the package against those with it, for each way the process with the
    package loaded it: logits within fp32 rounding (4x the difference between sdpa and eager attention without the
    package, at least 1e-5), greedy tokens equal, the package's plans for the folder's layers taken, and the process
    without the package on the folder's own code."""
    import torch

    without = torch.load(without_path, weights_only=True) if without_path.is_file() else {}
    with_package = torch.load(with_path, weights_only=True) if with_path.is_file() else {}
    rows = []
    for folder in folders:
        name = folder.name
        plain = without.get(name, {}).get("auto")
        loaded = with_package.get(name, {})
        if plain is None or not loaded:
            rows.append({"folder": name, "passed": False, "error": "no outputs (see the check's report)"})
            continue
        real = plain["attention_mask"].bool()
        for loader, fast in loaded.items():
            row = {"folder": name, "loader": loader, "loaded_from": fast["loaded_from"]}
            for case, where in (("padded", real), ("packed", None)):
                row[f"{case}_difference"] = largest_difference(plain[f"{case}_logits"], fast[f"{case}_logits"], where)
                row[f"{case}_rounding"] = largest_difference(
                    plain[f"{case}_logits"], plain[f"{case}_logits_eager"], where
                )
                row[f"{case}_tolerance"] = max(1e-5, 4 * row[f"{case}_rounding"])
            for cache in ("dynamic_cache", "static_cache"):
                tokens = f"{cache}_tokens"
                row[cache] = tokens in plain and tokens in fast and bool(torch.equal(plain[tokens], fast[tokens]))
            row["plans"] = fast["plans"]
            row["plans_missing"] = {
                case: sorted(needed - set(fast["plans"][case])) for case, needed in expected_plans(folder).items()
            }
            row["without_iha_loaded_from"] = plain["loaded_from"]
            row["passed"] = (
                all(row[f"{case}_difference"] <= row[f"{case}_tolerance"] for case in ("padded", "packed"))
                and row["dynamic_cache"]
                and row["static_cache"]
                and all(fast["plans"][case] for case in ("padded", "packed"))  # the package's attention ran
                and not any(row["plans_missing"].values())
                and plain["loaded_from"].startswith("transformers_modules.")  # the folder's own code
                and (loader != "folder" or fast["loaded_from"].startswith("transformers_modules."))
            )
            rows.append(row)
    return rows


def check_release(
    python: Path,
    site: str,
    pairs: list[tuple[Path, Path]],
    mixed: list[Path],
    threads: str,
    scratch: Path,
    iha_path: Path = REPO_ROOT,
) -> dict:
    """One release: a fresh interpreter without the package (the converted folders against their sources,
    continuous batching refused, the outputs of the folders with random mixing), then one with `import iha` (its
    continuous batching, the same outputs), and the two sets of outputs compared."""
    release_dir = Path(tempfile.mkdtemp(prefix="release-", dir=scratch))
    without_path, with_path = release_dir / "without_iha.pt", release_dir / "with_iha.pt"
    folders = [str(folder) for folder in mixed]
    pair_arguments = [str(path) for pair in pairs for path in pair]
    without = run_check(
        python,
        site,
        ["check", "--pairs", *pair_arguments, "--batch", *folders, "--outputs", str(without_path), *folders],
        threads,
    )
    with_package = run_check(
        python,
        f"{site}{os.pathsep}{iha_path}",
        ["check", "--with-iha", "--batch", *folders, "--outputs", str(with_path), *folders],
        threads,
    )
    result = {
        "transformers": without.get("transformers") or with_package.get("transformers"),
        "models": without.get("models", []),
        "continuous_batching": without.get("continuous_batching", []),
        "continuous_batching_with_iha": with_package.get("continuous_batching", []),
        "outputs_without_iha": without.get("outputs", []),
        "outputs_with_iha": with_package.get("outputs", []),
        "agreement": compare_outputs(without_path, with_path, mixed),
        "iha_importable": {"without": without.get("iha_importable"), "with": with_package.get("iha_importable")},
    }
    for name, report in (("without_iha", without), ("with_iha", with_package)):
        if "crash" in report:
            result[f"crash_{name}"] = report["crash"]
    result["passed"] = bool(without["passed"] and with_package["passed"]) and all(
        row["passed"] for row in result["agreement"]
    )
    shutil.rmtree(release_dir, ignore_errors=True)
    return result


def package_import_error(python: Path, site: Path, iha_path: Path = REPO_ROOT) -> str:
    """What `import iha` (the installed package, not a model folder) says on this release: the same guard."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONHOME", "VIRTUAL_ENV")}
    environment.update(PYTHONPATH=f"{site}{os.pathsep}{iha_path}", PYTHONNOUSERSITE="1")
    completed = subprocess.run(
        [str(python), "-c", "import iha; print('imported')"], env=environment, capture_output=True, text=True
    )
    output = (completed.stdout + completed.stderr).strip().splitlines()
    return output[-1] if output else ""


def log_release(release: str, result: dict) -> None:
    """One line per model, per continuous-batching folder and per folder compared with and without the package, then
    the crashes if any."""
    for model in result.get("models", []):
        log(
            f"transformers {release}, {Path(model['source']).name}: {'ok' if model['passed'] else 'FAILED'} "
            f"(logits {model['logit_difference']:.1e}, dynamic {model['dynamic_cache']}, static "
            f"{model['static_cache']}, no cache {model['no_cache']}, bf16 {bf16_cell(model)}, {model['seconds']} s)"
        )
    for key, where in (("continuous_batching", "without iha"), ("continuous_batching_with_iha", "with iha")):
        for batched in result.get(key, []):
            log(
                f"transformers {release}, {batched['folder']}, continuous batching {where}: "
                f"{batched['continuous_batching']}, generate() after it: {batched['generate_after']} "
                f"({'ok' if batched['passed'] else 'FAILED'}, {batched['seconds']} s)"
                + (f": {batched['generate_after_error']}" if "generate_after_error" in batched else "")
            )
    for row in result.get("agreement", []):
        if "error" in row:
            log(f"transformers {release}, {row['folder']}, without vs with iha: FAILED ({row['error']})")
            continue
        log(
            f"transformers {release}, {row['folder']}, without vs with iha ({loader_cell(row)}): "
            f"{'ok' if row['passed'] else 'FAILED'} "
            f"(padded {row['padded_difference']:.1e}, packed {row['packed_difference']:.1e}, dynamic "
            f"{row['dynamic_cache']}, static {row['static_cache']}, plans {plans_cell(row)})"
        )
    for key in ("outputs_without_iha", "outputs_with_iha"):
        for output in result.get(key, []):
            for name, value in output.items():
                if name.endswith("error"):
                    log(f"transformers {release}, {output['folder']}, {key}: {name}: {value}")
    for key in ("crash", "crash_without_iha", "crash_with_iha"):
        if key in result:
            log(f"transformers {release}: the check crashed ({key}):\n" + "\n".join(result[key]))


PLAN_NAMES = {BLOCKED: "blocked", PER_DOCUMENT: "per document", "Tensor": "dense"}


def loader_cell(row: dict) -> str:
    """How the process with `iha` imported loaded the folder, and which code ran."""
    code = "the package's classes" if row["loaded_from"].startswith("iha.") else "the folder's classes"
    how = "AutoModelForCausalLM" if row["loader"] == "auto" else "auto_map's class"
    return f"{how}: {code}"


def plans_cell(row: dict) -> str:
    """Which of the package's plans ran with `iha` imported, per input (the counts are calls of IHA layers)."""
    cells = []
    for case in ("padded", "packed", "dynamic_cache", "static_cache"):
        plans = row["plans"].get(case, {})
        taken = ", ".join(f"{PLAN_NAMES.get(kind, kind)} {count}" for kind, count in sorted(plans.items()))
        missing = row.get("plans_missing", {}).get(case)
        if missing:
            taken += " **missing " + ", ".join(PLAN_NAMES.get(kind, kind) for kind in missing) + "**"
        cells.append(f"{case.replace('_cache', '')}: {taken or '**none**'}")
    return "; ".join(cells)


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


def markdown_table(results: list[dict], iha_source: str | None = None) -> str:
    refusal_line = next(
        (
            row["message"]
            for result in results
            for row in result.get("continuous_batching", [])
            if row["passed"] and row.get("message")
        ),
        None,
    )
    lines = [
        f"Supported: {supported_range_text()}. Each row ran in an environment with torch and only that transformers "
        "(`iha` not importable), loading the converted folders through `trust_remote_code`. Logit difference: max "
        "|IHA - source| over the real tokens of a left-padded batch of 3 (tolerance in brackets: 4x the source's own "
        "sdpa-vs-eager difference, at least 1e-5). Greedy: 16 new tokens, equal to the source's. bf16: both models "
        "loaded with `dtype=torch.bfloat16`; the mixing must load in fp32, the logits match the bf16 source (tolerance "
        "4x its sdpa-vs-eager difference, at least 1e-2), and 5 AdamW steps at 1e-3 move every mixing entry that "
        "starts at 1.0." + (f" The interpreters with `iha` imported it from {iha_source}." if iha_source else ""),
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
    agreement = [(result["transformers"], row) for result in results for row in result.get("agreement", [])]
    if agreement:
        lines += [
            "",
            "Without the package against with it: each folder, with random (trained-looking) head mixing, loaded "
            "through `trust_remote_code` in two fresh interpreters of the release, one that cannot import `iha` "
            "(transformers' own attention functions) and one that imported it first (the package's fast paths, "
            f"registered as `iha|sdpa`). Logits of a left-padded batch of {len(LEFT_PADDING)} rows of {LONG_LENGTH} "
            f"tokens (left padding {', '.join(map(str, LEFT_PADDING))}; max over real tokens) and of one packed row "
            f"(documents of {', '.join(map(str, PACKED_DOCUMENTS))} tokens, restarting position ids, no mask); in "
            "brackets the bar, 4x the difference between sdpa and eager attention without the package, at least 1e-5. "
            f"Greedy: {GREEDY_TOKENS} new tokens after the padded batch (every step past the sliding windows), equal "
            "in both processes. Plans: what the package's `iha|sdpa` attention ran with `iha` imported, in calls of "
            "IHA layers (blocked: the blocked sliding-window path; per document: the packed-documents path; dense: an "
            "SDPA mask); a sliding IHA layer must run blocked on both inputs, a full one per document on the packed "
            "row.",
            "",
            "| transformers | folder | loaded with `iha` imported | padded logits | packed logits "
            "| greedy, DynamicCache | greedy, StaticCache | plans with `iha` imported |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for release, row in agreement:
            folder = row["folder"].removesuffix("-iha")
            if "error" in row:
                lines.append(f"| {release} | {folder} | - | **{row['error']}** | - | - | - | - |")
                continue

            def difference(case, row=row):
                text = f"{row[f'{case}_difference']:.1e} ({row[f'{case}_tolerance']:.0e})"
                return text if row[f"{case}_difference"] <= row[f"{case}_tolerance"] else f"**{text}**"

            def tokens(cache, row=row):
                return "equal" if row[cache] else "**different**"

            lines.append(
                f"| {release} | {folder} | {loader_cell(row)} | {difference('padded')} | {difference('packed')} | "
                f"{tokens('dynamic_cache')} | {tokens('static_cache')} | {plans_cell(row)} |"
            )
    batched = {}
    for result in results:
        for key, where in (("continuous_batching", "without"), ("continuous_batching_with_iha", "with")):
            for row in result.get(key, []):
                batched.setdefault((result["transformers"], row["folder"]), {})[where] = row
    if batched:
        lines += [
            "",
            f"Continuous batching (`generate_batch`: {len(BATCH_PROMPT_LENGTHS)} prompts of "
            f"{min(BATCH_PROMPT_LENGTHS)}-{max(BATCH_PROMPT_LENGTHS)} tokens, {BATCH_NEW_TOKENS} greedy tokens each, "
            "a paged cache of 16 blocks of 16 tokens, at most 32 tokens per batch) of the same folders. Without the "
            "package it must refuse with `modeling_iha.NEEDS_THE_PACKAGE`; with `iha` imported it must decode what "
            "`generate()` decodes on each prompt alone, or, where the release's continuous batching cannot be right "
            "for the model (sliding-window layers before 5.16, whose pages read back wrong tokens for a stock Mistral "
            "too), refuse with the fix. Either way `generate()` must decode the same tokens after it as before "
            "(5.4.0 and 5.13.1 switch the model to `paged|sdpa` when continuous batching starts, and 5.4.0 never "
            "switches it back: the package does).",
            "",
            "| transformers | folder | without `iha` | with `iha` imported |",
            "|---|---|---|---|",
        ]
        for (release, folder), where in batched.items():
            cells = []
            for side in ("without", "with"):
                row = where.get(side)
                if row is None:
                    cells.append("**not run**")
                    continue
                outcome = row["continuous_batching"]
                if row.get("message") and side == "with":
                    outcome += f": {row['message'].split('. ')[0]}"
                if row.get("error"):
                    outcome += f" ({row['error'][:120]})"
                if row["generate_after"] != "equal":
                    outcome += f"; then generate(): {row['generate_after']}"
                    if row.get("generate_after_error"):
                        outcome += f" ({row['generate_after_error'][:160]})"
                cells.append(outcome if row["passed"] else f"**{outcome}**")
            lines.append(f"| {release} | {folder.removesuffix('-iha')} | {cells[0]} | {cells[1]} |")
    if refusal_line is not None:
        lines += ["", "Refused without the package, in one line:", "", "```text", refusal_line, "```"]
    return "\n".join(lines) + "\n"


def package_source(iha_path: Path) -> str:
    """Where the interpreters with `iha` imported took it from: this repository's commit (with "and uncommitted
    changes" where its package differs from it), or the folder given."""
    if iha_path.resolve() != REPO_ROOT:
        return f"`{iha_path}` (not this repository)"
    git = ["git", "-C", str(REPO_ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--", "iha"], capture_output=True, text=True).stdout
    return f"this repository at {commit or 'an unknown commit'}" + (" with uncommitted changes" if changed else "")


def cpu_seconds() -> float:
    """User and system CPU time of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


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
        # The folders compared without the package and with it: global (the tiny Llama at identity), the paper's
        # hybrid, Gemma 3; each with random mixing.
        converted = {source.name: folder for source, folder in pairs}
        mixed = [
            with_random_mixing(folder, work_dir)
            for folder in (converted["tiny-llama"], hybrid_folder(work_dir), converted["tiny-gemma3"])
        ]
        python = torch_environment(args.cache_dir)
        psutil_site = psutil_environment(args.cache_dir, python)

        results = []
        for release in args.refused_releases:
            site = transformers_environment(args.cache_dir, python, release)
            result = run_check(python, str(site), ["refuse", str(pairs[0][1])])
            result.setdefault("transformers", release)
            result["package_import"] = package_import_error(python, site, args.iha_path)
            result["passed"] = result["passed"] and "UnsupportedTransformersError: " in result["package_import"]
            log(f"transformers {release}: {'refused clearly' if result['passed'] else 'FAILED'}: {result.get('error')}")
            results.append(result)
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
                pool.submit(check_release, python, site, pairs, mixed, threads, work_dir, args.iha_path): release
                for release, site in sites.items()
            }
            log(f"checking {', '.join(sites)}, {args.jobs} at a time")
            for check in as_completed(checks):
                release = checks[check]
                try:
                    result = check.result()
                except Exception as error:  # one release's failure must not lose the others' report
                    result = {"passed": False, "crash": [repr(error)]}
                result["transformers"] = release
                log_release(release, result)
                by_release[release] = result
        results += [by_release[release] for release in sites]  # the report keeps the order of --releases
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    failed = [result["transformers"] for result in results if not result["passed"]]
    iha_source = package_source(args.iha_path)
    summary = {
        "iha_source": iha_source,
        "supported": supported_range_text(),
        "minimum": str(MINIMUM_TRANSFORMERS),
        "newest_tested": newest_tested_line(),
        "results": results,
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 1),
        # CPU seconds of every process the matrix waited for (the checks, the environment builds), and its own.
        "cpu_seconds": round(cpu_seconds(), 1),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(summary, args.output_dir / "transformers_matrix.json")
    write_text_atomic(markdown_table(results, iha_source), args.output_dir / "transformers_matrix.md")
    print(markdown_table(results, iha_source))
    log(
        f"{'FAILED on ' + ', '.join(failed) if failed else 'all releases passed'} in {summary['seconds']} s "
        f"({summary['cpu_seconds']} CPU s)"
    )
    print(f"transformers-matrix: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
