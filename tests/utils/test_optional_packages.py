"""A missing optional package is one line that names the pip command, with the version the package pins."""

import logging
import sys

import pytest

from iha.conversion.builtin import smollm2_dir
from iha.utils.optional_packages import MissingPackageError, declared_requirements, missing_package_message, require


def test_a_missing_declared_package_is_one_line_with_its_pinned_pip_command():
    message = missing_package_message(ModuleNotFoundError("No module named 'trl'", name="trl"))
    trl_requirement = declared_requirements()["trl"]  # the supported range setup.py declares, e.g. trl<1.17,>=1.7.0
    assert any(operator in trl_requirement for operator in "<>=")
    assert message == f'this command needs the `trl` package, which is not installed: pip install "{trl_requirement}"'
    submodule = missing_package_message(ModuleNotFoundError(name="math_verify.parser"))
    math_verify_requirement = declared_requirements()["math-verify"]  # a range too, e.g. math-verify<0.10,>=0.7.0
    assert ">=" in math_verify_requirement and "<" in math_verify_requirement
    assert submodule.endswith(f'pip install "{math_verify_requirement}"')
    # A module the package does not declare is a bug, not a missing extra: it keeps its traceback.
    assert missing_package_message(ModuleNotFoundError(name="no_such_module_anywhere")) is None


def test_require_names_every_missing_package_in_one_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails and find_spec sees no module
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(MissingPackageError) as error:
        require("torch", "gguf", "lm_eval", purpose="the job")
    assert str(error.value) == (
        'the job needs the `gguf`, `lm-eval` packages, which are not installed: pip install "gguf>=0.10" "lm-eval==0.4.13"'
    )


def test_the_builtin_model_without_gguf_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(
        MissingPackageError, match=r'built-in model\'s GGUF file needs the `gguf` package.*"gguf>=0\.10"'
    ):
        smollm2_dir(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_commands_drop_bitsandbytes_kernels_notice_and_keep_its_other_messages(tmp_path, caplog, capsys):
    # The notice shows only on CPUs with AVX512-BF16, so it is sent here by hand, through the logger bitsandbytes uses.
    from iha.cli.main import main as iha_main
    from iha.utils.optional_packages import BITSANDBYTES_CPU_LOGGER, BITSANDBYTES_KERNELS_NOTICE

    # Every command installs the filter before its module (and so bitsandbytes) is imported.
    assert iha_main(["card", str(tmp_path / "missing"), "--base-model", "x"]) == 2
    capsys.readouterr()
    logger = logging.getLogger(BITSANDBYTES_CPU_LOGGER)
    with caplog.at_level(logging.WARNING, logger=BITSANDBYTES_CPU_LOGGER):
        logger.warning(BITSANDBYTES_KERNELS_NOTICE + ": %s. Please make sure ...", "No module named 'kernels'")
        logger.warning("another bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["another bitsandbytes warning"]
