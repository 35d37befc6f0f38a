"""Run the training tests on the oldest release of every training dependency's range, in an environment of its own.

setup.py states ranges for trl, peft, accelerate, datasets, bitsandbytes and math-verify (`TRAINING_STACK`);
development and `make test` use the newest releases. `IHASFTTrainer` and `with_iha_mixing` lean on TRL internals
(SFTTrainer's set-up and model cards, its cast of a quantized model's trainable weights, the DPO and GRPO trainers'
arguments), which break first at the old end of the range; math-verify's reading rules change between releases.
This script builds (once, then reuses) an environment with torch, the development transformers and the lowest release
of each range, and runs the tests in TESTS there, with `iha` imported from this checkout. Exits with pytest's status.

    python scripts/trl_oldest.py                  # build the environment if needed, run TESTS
    python scripts/trl_oldest.py -- -k dpo -x     # with more pytest arguments

The environment is resolved by pip with this package's own requirements and extras (`.[train,qlora]`) plus the oldest
releases pinned, so the ranges of setup.py are what is tested. It is cached in `--cache-dir` (default
~/.cache/iha/trl-oldest, one folder per set of releases); torch comes from the transformers matrix's torch environment
(scripts/transformers_matrix.py, built there if missing). Needs the package index for the first build; runs offline
afterwards.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformers_matrix import public_version, setup_constants, torch_environment  # noqa: E402

from iha.cli.arguments import ArgumentParser  # noqa: E402


# Where IHA's training code meets TRL's and PEFT's internals: optimizer groups and the TRL command line with LoRA,
# save, reload and merge (SFT); QLoRA through TRL's quantization flags; DPO and GRPO through `with_iha_mixing`.
TESTS = [
    "tests/training/test_sft.py::test_optimizer_gives_mixing_parameters_their_own_lr_and_weight_decay",
    "tests/training/test_sft.py::test_lora_adapter_saves_mixing_reloads_and_merges",
    "tests/training/test_qlora.py::test_qlora_4bit_on_a_llama_converted_on_the_fly_saves_reloads_and_merges",
    # train_sft's configs: TRL's ModelConfig and ScriptArguments with the IHA settings added, TRL's own taken as they are.
    "tests/training/test_sft.py::test_configs_take_trls_own_and_refuse_what_no_run_can_do",
    "tests/training/test_dpo_grpo.py",
    # iha-sft's command line: TRL's own dataclasses, parsed by TRL's parser.
    "tests/cli/test_help.py::test_sft_parses_trls_model_and_script_flags_as_trl_declares_them",
    "tests/cli/test_help.py::test_sft_command_line_accepts_trl_flags_and_checks_its_own",
    # math-verify reads the answers of the evaluation and of the GRPO reward (its oldest release: the reading rules).
    "tests/evaluation/test_eval_answers.py",
]


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/iha/trl-oldest").expanduser())
    parser.add_argument(
        "--torch-cache-dir",
        type=Path,
        default=Path("~/.cache/iha/transformers-matrix").expanduser(),
        help="where the transformers matrix keeps its torch environment (shared, not rebuilt)",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    return parser.parse_args(argv)


def log(message: str):
    print(f"[trl-oldest] {message}", flush=True)


def oldest_releases() -> list[str]:
    """`name==lowest` for every range of TRAINING_STACK, and the development transformers."""
    constants = setup_constants("TRAINING_STACK", "DEVELOPMENT_TRANSFORMERS")
    pins = []
    for requirement in constants["TRAINING_STACK"].values():
        name, _, bounds = requirement.partition(">=")
        if not bounds:
            raise SystemExit(f"setup.py: {requirement!r} has no lower bound (>=) to test")
        pins.append(f"{name}=={bounds.split(',')[0]}")
    return [constants["DEVELOPMENT_TRANSFORMERS"], *pins]


def training_environment(cache_dir: Path, python: Path, pins: list[str]) -> Path:
    """A folder with the oldest releases and everything they and the package need, for the torch environment's
    PYTHONPATH. pip resolves them in that environment (so torch is not installed again) and installs the result."""
    import torch

    key = hashlib.sha256(json.dumps([public_version(torch.__version__), *pins]).encode()).hexdigest()[:12]
    target = cache_dir / "-".join([pin.replace("==", "-") for pin in pins[1:3]] + [key])
    if (target / ".complete").is_file():
        return target
    log(f"resolving {', '.join(pins)} with .[train,qlora] into {target}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_dir))
    try:
        report = staging / "report.json"
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report),
             f"{REPO_ROOT}[train,qlora]", *pins, "pytest>=8"],
            check=True,
        )  # fmt: skip
        resolved = json.loads(report.read_text())["install"]
        packages = [
            f"{item['metadata']['name']}=={item['metadata']['version']}"
            for item in resolved
            if item["metadata"]["name"] != "iha-transformers"  # imported from this checkout
        ]
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
             "--target", str(staging / "site"), *packages],
            check=True,
        )  # fmt: skip
        write_versions = staging / "site" / "training-oldest.json"
        write_versions.write_text(json.dumps(sorted(packages), indent=1))
        (staging / "site" / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        (staging / "site").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    pins = oldest_releases()
    python = torch_environment(args.torch_cache_dir)
    site = training_environment(args.cache_dir, python, pins)
    environment = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    environment.update(
        PYTHONPATH=f"{site}{os.pathsep}{REPO_ROOT}",
        HF_HUB_OFFLINE="1",
        PYTHONNOUSERSITE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    # .ci/run runs this beside the matrix's checks, which share out the cores: one thread here, unless the caller
    # chose a number.
    environment.setdefault("OMP_NUM_THREADS", "1")
    log(f"running {len(TESTS)} test groups on {', '.join(pins)}")
    completed = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *args.pytest_args],
        cwd=REPO_ROOT,
        env=environment,
    )
    outcome = "passed" if completed.returncode == 0 else f"FAILED (pytest exit status {completed.returncode})"
    log(f"{outcome} on {', '.join(pins)} in {time.perf_counter() - started:.0f} s")
    return completed.returncode


if __name__ == "__main__":
    sys.exit(main())
