"""A missing optional package is one line that names the pip command, with the version the package pins."""

import logging
import os
import subprocess
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


@pytest.mark.parametrize("logger_name", ["bitsandbytes.backends.cpu.ops", "DeepSpeed"])
def test_commands_drop_the_import_notices_and_keep_the_packages_other_messages(logger_name, tmp_path, caplog, capsys):
    # bitsandbytes' notice shows only on CPUs with AVX512-BF16, DeepSpeed's only where torch sees no GPU: both are sent
    # here by hand, through the loggers the packages use.
    from iha.cli.main import main as iha_main
    from iha.utils.optional_packages import QUIET_NOTICES

    # Every command installs the filters before its module (and so bitsandbytes or DeepSpeed) is imported.
    assert iha_main(["card", str(tmp_path / "missing"), "--base-model", "x"]) == 2
    capsys.readouterr()
    logger = logging.getLogger(logger_name)
    with caplog.at_level(logging.WARNING, logger=logger_name):
        logger.warning(QUIET_NOTICES[logger_name] + " If you have GPU or other accelerator, %s.", "...")
        logger.warning("another warning of the package")
    assert [record.getMessage() for record in caplog.records] == ["another warning of the package"]


DEEPSPEED_IMPORT = """
import sys
from iha.cli.main import main
main(["card", sys.argv[1], "--base-model", "x"])  # any command, failing at once
import deepspeed  # what accelerate does when a model is saved
print("imported", deepspeed.__name__)
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="DeepSpeed says nothing where torch sees a GPU")
def test_deepspeed_imported_by_a_command_says_nothing_about_its_accelerator(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_IMPORT, str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "imported deepspeed" in result.stdout
    assert "accelerator" not in result.stdout + result.stderr
