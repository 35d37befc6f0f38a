from pathlib import Path

from setuptools import find_packages, setup


# The transformers releases the model files are tested with (the version matrix, scripts/transformers_matrix.py):
# a range, so that installing the package keeps a user's supported transformers. iha/compat_iha.py holds the same
# range for the files that travel with the weights. Development and the test suite use one release of it.
SUPPORTED_TRANSFORMERS = "transformers>=5.4.0,<5.25"
DEVELOPMENT_TRANSFORMERS = "transformers==5.23.0"

HF_STACK = {
    "trl": "trl==1.16.0",
    "peft": "peft==0.21.2",
    "accelerate": "accelerate==1.15.0",
    "datasets": "datasets==5.2.0",
}

extras = {
    # torch is not pinned here on purpose: install it first (`pip install torch==2.13.0` takes the CPU wheel;
    # on a GPU machine take the CUDA build you want). A bare `torch` requirement with nothing installed would
    # pull a multi-GB CUDA build.
    "train": [HF_STACK["trl"], HF_STACK["peft"], HF_STACK["accelerate"], HF_STACK["datasets"], "matplotlib>=3.7"],
    "eval": ["math-verify==0.9.0", "lm-eval==0.4.13", HF_STACK["datasets"], "matplotlib>=3.7"],
    "convert": ["gguf>=0.10"],
    # `iha serve`: what transformers' server needs (transformers' own `serving` extra).
    "serve": ["fastapi>=0.110", "uvicorn>=0.29", "openai>=1.98", "pydantic>=2"],
}
extras["dev"] = sorted(
    {
        *extras["train"],
        *extras["eval"],
        *extras["convert"],
        *extras["serve"],
        DEVELOPMENT_TRANSFORMERS,
        "pytest>=8",
        "ruff>=0.6",
        "nbclient>=0.10",
        "nbformat>=5.9",
        "ipykernel>=6",
    }
)
extras["all"] = extras["dev"]

setup(
    name="iha-transformers",
    version="0.1.0",
    description="Interleaved Head Attention (arXiv 2602.21371) for Llama-family models in Hugging Face transformers",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["iha", "iha.*"]),
    # The console scripts' module: outside `iha`, so that `--help` runs before the package registers its classes
    # (which imports torch and transformers); see iha_cli.py.
    py_modules=["iha_cli"],
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
            "iha=iha_cli:main",
            "iha-convert=iha_cli:convert",
            "iha-sft=iha_cli:sft",
            "iha-eval=iha_cli:evaluate",
        ]
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
