#!/usr/bin/env bash
# What the GPU check (scripts/gpu_check.sh) carries to the CUDA machine, which has Python 3.12, torch, transformers,
# accelerate, peft and pytest but not the rest, and cannot download anything. Run it here, where PyPI answers:
#
#   bash scripts/gpu_wheels.sh            # writes gpu-carry/ (ignored by git) and prints its size
#
# gpu-carry/wheels    the exact wheels the check imports that the machine lacks, for CPython 3.12 on manylinux x86-64,
#                     downloaded with --no-deps: none of them pulls torch, transformers or anything the machine has
# gpu-carry/smollm2   SmolLM2-135M-Instruct cut to its first $SMOLLM2_LAYERS layers (scripts/gpu_smollm2.py): the
#                     whole GGUF is 98 MB, more than a call carries
# gpu-carry/data      the first 512 rows of GSM8K train and 64 of test, for the check's SFT, eval and bench_sft steps
#                     (../shared/data does not travel; without them the steps read the tests' 315 rows)
#
# What travels is the working tree plus gpu-carry/, at most 64 MiB: the script adds them up and fails above that.
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=gpu-carry
PYTHON=${PYTHON:-.venv/bin/python}
SMOLLM2_LAYERS=${SMOLLM2_LAYERS:-8}
LIMIT_BYTES=$((64 * 1024 * 1024))

# The development pins (setup.py) and, for their dependencies, the versions they resolve to here. The machine's own
# packages (KINDS list of the device: accelerate, huggingface-hub, jinja2, numpy, packaging, pandas, psutil, pyarrow,
# pyyaml, requests, sympy, tqdm, filelock, fsspec, xxhash, torch, transformers) are not carried.
WHEELS=(
    trl==1.16.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    gguf==0.19.0
)
ON_MACHINE="accelerate huggingface-hub huggingface_hub jinja2 numpy packaging pandas psutil pyarrow pyyaml requests
sympy tqdm filelock fsspec xxhash torch transformers"

rm -rf "$CARRY/wheels"
mkdir -p "$CARRY/wheels" "$CARRY/smollm2" "$CARRY/data/gsm8k"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$CARRY/wheels" "${WHEELS[@]}"

# Every requirement of a carried wheel must be carried too or be on the machine: --no-index installs nothing else.
"$PYTHON" - "$CARRY/wheels" "$ON_MACHINE" <<'EOF'
import sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

folder, on_machine = Path(sys.argv[1]), {canonicalize_name(name) for name in sys.argv[2].split()}
# The machine: CPython 3.12 on x86-64 Linux; no extras asked for.
machine = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
carried, needed = set(), {}
for wheel in sorted(folder.glob("*.whl")):
    carried.add(canonicalize_name(wheel.name.split("-")[0]))
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        for line in archive.read(metadata).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                requirement = Requirement(line.split(":", 1)[1].strip())
                if requirement.marker is None or requirement.marker.evaluate(machine):
                    needed.setdefault(canonicalize_name(requirement.name), wheel.name)
missing = {name: wheel for name, wheel in needed.items() if name not in carried | on_machine}
if missing:
    sys.exit(f"gpu_wheels: required but neither carried nor on the machine: {missing}")
print(f"{len(carried)} wheels; every requirement is carried or on the machine")
EOF

if ! ls "$CARRY"/smollm2/*-"$SMOLLM2_LAYERS"-layers.gguf >/dev/null 2>&1; then
    rm -f "$CARRY"/smollm2/*.gguf
    "$PYTHON" scripts/gpu_smollm2.py "$CARRY/smollm2/SmolLM2-135M-Instruct-$SMOLLM2_LAYERS-layers.gguf" \
        --layers "$SMOLLM2_LAYERS"
fi

SHARED_DATA=../shared/data
head -n 512 "$SHARED_DATA/gsm8k/train.jsonl" > "$CARRY/data/gsm8k/train.jsonl"
head -n 64 "$SHARED_DATA/gsm8k/test.jsonl" > "$CARRY/data/gsm8k/test.jsonl"
cp "$SHARED_DATA/gsm8k/LICENSE" "$CARRY/data/gsm8k/LICENSE"

# The working tree as it travels: tracked files and untracked files git does not ignore, plus gpu-carry/.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
    awk '{ total += $1 } END { print total + 0 }')
carry_bytes=$(find "$CARRY" -type f -print0 | xargs -0 stat -c %s | awk '{ total += $1 } END { print total + 0 }')
total=$((tree_bytes + carry_bytes))
mib() { awk -v bytes="$1" 'BEGIN { printf "%.1f MiB", bytes / 1048576 }'; }
echo "working tree $(mib "$tree_bytes") + $CARRY $(mib "$carry_bytes") (wheels $(du -sh "$CARRY/wheels" | cut -f1)," \
    "SmolLM2 $(du -sh "$CARRY/smollm2" | cut -f1), data $(du -sh "$CARRY/data" | cut -f1)) = $(mib "$total"):" \
    "limit $(mib "$LIMIT_BYTES")"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
    echo "gpu_wheels: over the limit; carry fewer layers (SMOLLM2_LAYERS=4 bash scripts/gpu_wheels.sh)" >&2
    exit 1
fi
