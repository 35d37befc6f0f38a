"""The console scripts of the `iha` package: `iha`, `iha-convert`, `iha-sft`, `iha-eval`.

They live outside the package so that they run before `iha/__init__.py`: importing `iha` registers the IHA classes
with transformers' Auto classes, which imports torch and transformers (seconds), and `--help` needs neither. Each
script first sets `registration_deferred` on this module; `iha/__init__.py` reads it here, in this process's own
modules (a child process, `accelerate launch` included, imports `iha` afresh and registers as usual), and leaves the
registration to the `iha` dispatcher (`iha.cli`), which runs it once the command line is parsed and before the
command's work.
"""

import sys


# Set by the scripts below before they import `iha`; read by `iha/__init__.py`.
registration_deferred = False


def _run(command: str | None) -> int:
    global registration_deferred
    registration_deferred = True
    try:
        from iha import cli

        return cli.main() if command is None else cli.run(command, sys.argv[1:])
    finally:
        # Called in-process (a notebook, a test), a later `import iha` elsewhere must not see a deferral; if the
        # script stopped before registering (`--help`, a bad flag), `iha`'s first IHA class registers (or call
        # `iha.register_auto_classes()`).
        registration_deferred = False


def main() -> int:
    """`iha COMMAND [flags]`."""
    return _run(None)


def convert() -> int:
    """`iha-convert` (the same as `iha convert`)."""
    return _run("convert")


def sft() -> int:
    """`iha-sft` (the same as `iha sft`)."""
    return _run("sft")


def evaluate() -> int:
    """`iha-eval` (the same as `iha eval`)."""
    return _run("eval")


if __name__ == "__main__":
    # `python -m iha_cli` runs this file as `__main__`; `iha/__init__.py` looks for the module named `iha_cli`.
    import iha_cli

    sys.exit(iha_cli.main())
