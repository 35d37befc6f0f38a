"""The packages only some jobs need (the `train` and `eval` extras): a missing one is one line with the pip command.

`require` checks, before a job starts, that the packages it will import are installed, and names every missing one
in one error. `missing_package_message` turns an import that failed on one of the package's declared requirements
into that same line, for the `iha` commands (`iha.cli.main`); a module the package does not declare is a real bug and
keeps its traceback. The pip command asks for what the package's own metadata declares (`trl>=1.7.0,<1.17`), so it
installs a release inside the supported range.
"""

import importlib.metadata
import importlib.util
import logging

from packaging.requirements import Requirement


DISTRIBUTION = "iha-transformers"


class MissingPackageError(ModuleNotFoundError):
    """One or more optional packages a job needs are not installed; the message holds the pip command."""


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def declared_requirements() -> dict[str, str]:
    """Canonical distribution name -> the requirement the package declares for it (`trl` -> `trl<1.17,>=1.7.0`)."""

    try:
        lines = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
        return {}
    requirements = {}
    for line in lines:
        requirement = Requirement(line)
        requirements.setdefault(_canonical(requirement.name), f"{requirement.name}{requirement.specifier}")
    return requirements


def pip_command(modules: list[str]) -> str:
    """`pip install "trl<1.17,>=1.7.0" "gguf>=0.10"` for the top-level modules `trl` and `gguf`."""
    requirements = declared_requirements()
    names = [requirements.get(_canonical(module), _canonical(module)) for module in modules]
    return "pip install " + " ".join(f'"{name}"' if any(c in name for c in "<>=!~") else name for name in names)


def missing_packages_error(modules: list[str], purpose: str) -> MissingPackageError:
    listed = ", ".join(f"`{_canonical(module)}`" for module in modules)
    what = "package, which is" if len(modules) == 1 else "packages, which are"
    error = MissingPackageError(f"{purpose} needs the {listed} {what} not installed: {pip_command(modules)}")
    error.name = modules[0]
    return error


def require(*modules: str, purpose: str) -> None:
    """Raise one `MissingPackageError` naming every module of `modules` that cannot be imported."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise missing_packages_error(missing, purpose)


def missing_package_message(error: ModuleNotFoundError) -> str | None:
    """The one line for an import that failed on a package the package declares (an optional one); None otherwise."""
    if isinstance(error, MissingPackageError):
        return str(error)
    module = (error.name or "").split(".")[0]
    if not module or _canonical(module) not in declared_requirements():
        return None
    return str(missing_packages_error([module], "this command"))


__all__ = ["MissingPackageError", "missing_package_message", "pip_command", "require"]


# Two notices optional packages log at import that look like failures and are none, dropped by every `iha` command
# (`quiet_optional_package_notices`; the other messages of the same loggers still show):
#
# - bitsandbytes' CPU backend, imported by peft (and so by transformers' Trainer) whenever bitsandbytes is installed,
#   logs at import, on CPUs with AVX512-BF16, that the optional `kernels` package is missing: a faster 4-bit matmul it
#   would download from the Hub. No command but QLoRA on CPU uses 4-bit layers, and that falls back to bitsandbytes'
#   own kernel, so every command would open with a warning about a package it does not need.
# - DeepSpeed, imported by accelerate whenever a model is saved (`save_pretrained` unwraps it) or a Trainer is built,
#   picks its accelerator at import and, where torch sees no GPU, warns "Setting accelerator to CPU. If you have GPU or
#   other accelerator, we were unable to detect it." The command runs where torch runs it (the CPU, there), and a
#   DeepSpeed run on the CPU is what `iha sft --deepspeed` does on purpose.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU."
QUIET_NOTICES = {BITSANDBYTES_CPU_LOGGER: BITSANDBYTES_KERNELS_NOTICE, DEEPSPEED_LOGGER: DEEPSPEED_CPU_NOTICE}


class _DropNotice(logging.Filter):
    """Drops the records whose message starts with `notice`."""

    def __init__(self, notice: str):
        super().__init__()
        self.notice = notice

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.notice)


def quiet_optional_package_notices() -> None:
    """Drop those notices (`QUIET_NOTICES`) from their packages' loggers. Call it before the packages are imported:
    the loggers exist from here on, the packages log through them, and their set-up keeps the filters."""
    for name, notice in QUIET_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(each, _DropNotice) and each.notice == notice for each in logger.filters):
            logger.addFilter(_DropNotice(notice))
