"""What each wing of the package may import (CONTRIBUTING.md, "Layout"): the wings stand in one order, from the model
to the command line, and a module imports only from its own wing and the wings before it. So no two wings import each
other, and a wing can be read, tested and changed knowing only those before it. The model files themselves import only
torch, transformers and each other (tests/models/iha/test_remote_code.py).

research/ (the synthetic tasks, the polynomial filter, the A/B) is a client of the package, as benchmarks/ is: it
imports any wing of `iha`, and `iha` never imports it (the wheel does not contain it). Its own folders stand in an
order of their own (`RESEARCH_ORDER`)."""

import ast
from pathlib import Path

from testing_utils import REPO_ROOT


PACKAGE_DIR = REPO_ROOT / "iha"
RESEARCH_DIR = REPO_ROOT / "research"

# Each wing may import the wings before it. `iha` itself (the package's __init__, which registers the model classes
# and the installed attention paths) is the package's face: the wing `iha`, right after the two it registers.
# Sub-wing: serving's vLLM plugin.
WING_ORDER = [
    "models",
    "attention",
    "iha",
    "utils",
    "data",
    "hub",
    "conversion",
    "evaluation",
    "training",
    "serving",
    "serving.vllm",
    "export",
    "demo",
    "cli",
]
SUB_WINGS = {"serving": {"vllm"}}

# research/'s folders, each importing only those before it (and any wing of `iha`): the paired statistics all of them
# report with, the synthetic task, the polynomial filter (which trains the synthetic task's IHA layer), the A/B.
RESEARCH_ORDER = ["statistics", "synthetic", "polynomial_filter", "ab"]


def wing_of(module: str) -> str:
    """`iha.serving.vllm.attention` -> `serving.vllm`; `iha.training.model` -> `training`; `iha` -> `iha`."""
    parts = module.split(".")[1:]
    if not parts:
        return "iha"
    if len(parts) > 1 and parts[1] in SUB_WINGS.get(parts[0], ()):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, top: str = "iha") -> list[tuple[int, str]]:
    """(line, absolute module) of every import of package `top` (`iha`, `research`) in the file, those inside
    functions too."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            # `from . import x` / `from .. import x`: x may be a module of that package.
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names] if not node.module else []
            found.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name == top or name.startswith(f"{top}.")]


def wing_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, its wing, the imported wing) for every import across wings."""
    crossings = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        wing = wing_of(module_name(path))
        for line, imported in imported_modules(path):
            target = wing_of(imported)
            if target != wing:
                crossings.append((str(path.relative_to(REPO_ROOT)), line, wing, target))
    return crossings


def test_every_wing_is_in_the_order():
    folders = {path.parent for path in PACKAGE_DIR.rglob("__init__.py")}
    wings = {wing_of(module_name(folder / "__init__.py")) for folder in folders}
    assert wings - set(WING_ORDER) == set(), "a new wing: place it in WING_ORDER (and CONTRIBUTING.md)"


def test_a_wing_imports_only_the_wings_before_it():
    rank = {wing: index for index, wing in enumerate(WING_ORDER)}
    crossings = wing_imports()
    assert crossings, "no import across wings found: the scan is broken"
    backwards = [
        f"{path}:{line}: {wing} imports {target}"
        for path, line, wing, target in crossings
        if target in rank and rank[target] > rank[wing]
    ]
    assert not backwards, "imports against the wing order (WING_ORDER):\n" + "\n".join(backwards)


def test_the_package_never_imports_research():
    imports = [
        f"{path.relative_to(REPO_ROOT)}:{line}: imports {name}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for line, name in imported_modules(path, top="research")
    ]
    assert not imports, "iha imports research/, which is not installed with it:\n" + "\n".join(imports)


def research_part(module: str) -> str:
    """`research.synthetic.train` -> `synthetic`; `research.statistics` -> `statistics`; `research` -> ``."""
    return module.split(".")[1] if "." in module else ""


def test_research_imports_only_its_folders_before_it():
    rank = {part: index for index, part in enumerate(RESEARCH_ORDER)}
    folders = {research_part(module_name(path)) for path in RESEARCH_DIR.rglob("*.py")} - {""}
    assert folders == set(RESEARCH_ORDER), "a new research folder: place it in RESEARCH_ORDER (and CONTRIBUTING.md)"
    crossings, backwards = 0, []
    for path in sorted(RESEARCH_DIR.rglob("*.py")):
        part = research_part(module_name(path))
        for line, name in imported_modules(path, top="research"):
            target = research_part(name)
            if target and part and target != part:
                crossings += 1
                if rank[target] > rank[part]:
                    backwards.append(f"{path.relative_to(REPO_ROOT)}:{line}: {part} imports {target}")
    assert crossings, "no import across research's folders found: the scan is broken"
    assert not backwards, "imports against RESEARCH_ORDER:\n" + "\n".join(backwards)
