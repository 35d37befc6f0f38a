"""The test tree mirrors the package: the tests of `iha/<path>/<module>.py` live in `tests/<path>/`, so that a
contributor finds them by the module's path (CONTRIBUTING.md, "Tests"); those of `research/<path>/<module>.py` (the
research code beside the package) in `tests/research/<path>/`. Every package folder has its tests folder, and every
tests folder mirrors a package folder or one of the repository's folders outside the package."""

from pathlib import Path

from testing_utils import REPO_ROOT, TESTS_DIR


PACKAGE_DIR = REPO_ROOT / "iha"
RESEARCH_DIR = REPO_ROOT / "research"
# Each tree of Python packages -> the tests folder that mirrors it.
MIRRORED_TREES = {PACKAGE_DIR: TESTS_DIR, RESEARCH_DIR: TESTS_DIR / "research"}

# The one tests folder named otherwise than its package folder. pytest puts each test file's folder on sys.path
# (rootdir-relative imports, no __init__.py in tests/), so tests/serving is on it while tests/serving/test_*.py
# run: a folder tests/serving/vllm would then be imported as an empty namespace package `vllm`, and
# `pytest.importorskip("vllm")` would not skip the plugin's tests in an environment without vLLM.
RENAMED = {Path("serving/vllm"): Path("serving/vllm_plugin")}

# Tests of what is outside the package: the benchmarks/, docs/ (README, notebooks) and scripts/ folders.
OUTSIDE_THE_PACKAGE = {"benchmarks", "docs", "scripts"}


def mirror(package_folder: Path) -> Path:
    tree = next(tree for tree in MIRRORED_TREES if package_folder == tree or tree in package_folder.parents)
    relative = package_folder.relative_to(tree)
    if tree == PACKAGE_DIR:
        for folder, renamed in RENAMED.items():
            if relative == folder or folder in relative.parents:
                relative = renamed / relative.relative_to(folder)
    return MIRRORED_TREES[tree] / relative


def package_folders() -> list[Path]:
    return sorted(init.parent for tree in MIRRORED_TREES for init in tree.rglob("__init__.py"))


def has_modules(package_folder: Path) -> bool:
    return any(module.name != "__init__.py" for module in package_folder.glob("*.py"))


def test_every_package_folder_has_its_tests_folder():
    missing = [
        f"{folder.relative_to(REPO_ROOT)}/ -> {mirror(folder).relative_to(REPO_ROOT)}/"
        for folder in package_folders()
        if not any(mirror(folder).rglob("test_*.py"))
    ]
    assert not missing, f"package folders without tests in their mirror: {missing}"


def test_a_package_folders_modules_are_tested_in_its_own_tests_folder():
    # A folder whose only module is __init__.py (iha/, iha/models/) has its tests in its subfolders' mirrors.
    missing = [
        str(mirror(folder).relative_to(REPO_ROOT))
        for folder in package_folders()
        if has_modules(folder) and folder != PACKAGE_DIR and not any(mirror(folder).glob("test_*.py"))
    ]
    assert not missing, f"tests folders with no test file of their own: {missing}"


def test_every_tests_folder_mirrors_the_package_or_a_folder_beside_it():
    mirrors = {mirror(folder) for folder in package_folders()}
    strays = []
    for test_file in TESTS_DIR.rglob("test_*.py"):
        folder = test_file.parent
        top = folder.relative_to(TESTS_DIR).parts[:1]
        if folder in mirrors or (top and top[0] in OUTSIDE_THE_PACKAGE and (REPO_ROOT / top[0]).is_dir()):
            continue
        strays.append(str(test_file.relative_to(REPO_ROOT)))
    assert not strays, f"test files in a folder that mirrors no package folder: {sorted(strays)}"


def test_the_renamed_mirror_is_still_needed():
    # If pytest stops putting test folders on sys.path, or the plugin leaves iha/serving/vllm, the rename goes.
    for folder, renamed in RENAMED.items():
        assert (PACKAGE_DIR / folder / "__init__.py").is_file() and (TESTS_DIR / renamed).is_dir()
        assert not (TESTS_DIR / folder).exists()
        assert any((TESTS_DIR / folder.parent).glob("test_*.py"))


def test_research_is_imported_from_the_checkout_not_from_its_tests_folder():
    # pytest puts tests/ on sys.path, where tests/research/ (no __init__.py) could be imported as an empty namespace
    # package `research`; pyproject.toml's `pythonpath = ["."]` puts the repository's root, and its regular package
    # research/, first. The package's own tests folders never land in tests/research/.
    import research

    assert Path(research.__file__).resolve() == RESEARCH_DIR / "__init__.py"
    assert not (PACKAGE_DIR / "research").exists()
