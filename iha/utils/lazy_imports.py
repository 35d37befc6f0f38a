"""Package attributes imported on first use (PEP 562 module `__getattr__`).

`iha.experiments.synthetic` names its public classes and functions in one table (`iha.conversion`, `iha.training`
and `iha.evaluation` import their short public lists plainly); a name's module is imported when the name is first used. Importing a light module of
a subpackage (a command line's parser, the settings) then leaves the optional stacks it does not need unimported:
TRL, peft and datasets for training, math-verify for scoring, matplotlib for plots. (`import iha` itself loads
torch and transformers: it registers the IHA classes with the Auto classes.)
"""

import importlib
import sys


def lazy_attributes(package: str, exports: dict[str, str]):
    """`__getattr__` and `__dir__` for `package`: `exports` maps each public name to the submodule defining it."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)  # found as a plain attribute from now on
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
