"""The transformers releases IHA models run on (`iha/models/iha/version_iha.py`): refused below the range, one
warning above it, nothing built or run in a user's process; and the folder's modules import what they need."""

import subprocess
import sys

import pytest
import torch
from packaging.version import Version
from testing_utils import TINY, left_padded_batch, tiny_iha_model

import iha
from iha.models.iha import masking_iha, modeling_iha, version_iha


@pytest.mark.parametrize("version", ["4.57.1", "5.0.0", "5.3.0", "5.3.99"])
def test_releases_below_the_minimum_are_refused_with_the_fix(version):
    with pytest.raises(version_iha.UnsupportedTransformersError) as error:
        version_iha.check_transformers_release(version)
    message = str(error.value)
    assert f"transformers {version} is installed" in message
    assert 'Fix: pip install "transformers>=5.4.0,<5.26"' in message and "\n" not in message


@pytest.mark.parametrize("version", ["5.4.0", "5.13.1", "5.25.0", "5.25.3", "5.25.0.dev0"])
def test_supported_releases_pass_silently(version, caplog):
    with caplog.at_level("WARNING"):
        version_iha.check_transformers_release(version)
    assert "newer than the releases" not in caplog.text


@pytest.mark.parametrize("version", ["5.26.0", "5.26.0.dev0", "6.0.0"])
def test_an_untested_release_gets_one_warning_naming_the_tested_range(version, caplog):
    version_iha.logger.warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            version_iha.check_transformers_release(version)
    warnings = [record.getMessage() for record in caplog.records if "newer than the releases" in record.getMessage()]
    assert len(warnings) == 1
    assert f"transformers {version} is newer" in warnings[0] and "tested up to 5.25.x" in warnings[0]


def test_cache_is_taken_under_either_name():
    cache = object()
    assert modeling_iha.take_cache_argument(cache, {}) is cache
    kwargs = {"cache": cache}
    assert modeling_iha.take_cache_argument(None, kwargs) is cache
    assert kwargs == {}
    with pytest.raises(ValueError, match="not both"):
        modeling_iha.take_cache_argument(cache, {"cache": object()})


def test_model_decodes_the_same_with_the_cache_passed_as_cache_or_past_key_values():
    model = tiny_iha_model(num_pseudo_heads=2, sliding_window=3)
    input_ids, attention_mask = left_padded_batch(seq_len=6)
    results = []
    for name in ("cache", "past_key_values"):
        with torch.no_grad():
            prefill = model(input_ids, attention_mask=attention_mask, use_cache=True)
            cache = getattr(prefill, masking_iha.CACHE_ARGUMENT)
            step = model(
                input_ids[:, -1:],
                attention_mask=torch.cat([attention_mask, attention_mask[:, -1:]], 1),
                **{name: cache},
            )
        results.append(step.logits)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_importing_and_running_the_model_on_an_untested_release_builds_no_other_model():
    # A fresh interpreter that takes transformers for 5.99.0 and counts every model built and every generate() run:
    # importing the files that travel with the weights, and the first cached forward of a model, build and run
    # nothing but that model.
    program = (
        "import transformers\n"
        "transformers.__version__ = '5.99.0'\n"
        "from transformers import PreTrainedModel, GenerationMixin\n"
        "built, generated = [], []\n"
        "original_init, original_generate = PreTrainedModel.__init__, GenerationMixin.generate\n"
        "def counting_init(self, *args, **kwargs):\n"
        "    built.append(type(self).__name__)\n"
        "    original_init(self, *args, **kwargs)\n"
        "PreTrainedModel.__init__ = counting_init\n"
        "GenerationMixin.generate = lambda *a, **k: generated.append(1) or original_generate(*a, **k)\n"
        "import torch\n"
        "from iha.models.iha import configuration_iha, configuration_iha_gemma3, modeling_iha, modeling_iha_gemma3\n"
        "assert built == [] and generated == [], (built, generated)\n"
        "config = configuration_iha.IHAConfig(vocab_size=32, hidden_size=16, intermediate_size=32,\n"
        "    num_hidden_layers=2, num_attention_heads=2, sliding_window=3)\n"
        "model = modeling_iha.IHAForCausalLM(config)\n"
        "built.clear()\n"
        "model(torch.tensor([[1, 2, 3, 4]]), use_cache=True)\n"
        "assert built == [] and generated == [], (built, generated)\n"
        "print('nothing else built')\n"
    )
    completed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "nothing else built"
    assert completed.stderr.count("newer than the releases IHA models were tested with") == 1


def test_saved_folders_carry_the_version_check(tmp_path):
    from iha.conversion.writers import CODE_FILES

    iha.IHAForCausalLM(iha.IHAConfig(**TINY)).save_pretrained(tmp_path)
    for name in CODE_FILES:
        assert (tmp_path / name).is_file(), name


def test_the_supported_range_is_written_once_and_read_by_setup_and_the_docs(monkeypatch):
    # `pip install` must keep any supported transformers a user has: setup.py reads the range the guard uses, as text.
    import runpy
    from pathlib import Path

    import setuptools

    root = Path(__file__).resolve().parents[3]
    assert version_iha.SUPPORTED_TRANSFORMERS == "transformers>=5.4.0,<5.26"
    assert version_iha.MINIMUM_TRANSFORMERS == Version("5.4.0") and version_iha.newest_tested_line() == "5.25"
    assert version_iha.INSTALL_COMMAND == 'pip install "transformers>=5.4.0,<5.26"'
    assert version_iha.supported_requirement("5.16.0") == "transformers>=5.16.0,<5.26"
    setup_arguments = {}
    monkeypatch.setattr(setuptools, "setup", lambda **arguments: setup_arguments.update(arguments))
    runpy.run_path(str(root / "setup.py"))
    assert setup_arguments["version"] == iha.__version__
    assert version_iha.SUPPORTED_TRANSFORMERS in setup_arguments["install_requires"]
    for page in ("README.md", "docs/transformers-releases.md"):
        text = (root / page).read_text(encoding="utf-8")
        assert f"tested up to {version_iha.newest_tested_line()}.x" in text, page
        assert version_iha.INSTALL_COMMAND.removeprefix("pip install ") in text, page


def test_the_matrix_covers_the_stated_range():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "transformers_matrix.py"
    spec = importlib.util.spec_from_file_location("transformers_matrix", path)
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    assert Version(matrix.RELEASES[0]) == version_iha.MINIMUM_TRANSFORMERS
    assert matrix.RELEASES[-1].startswith(version_iha.newest_tested_line() + ".")
    assert all(Version(release) < version_iha.MINIMUM_TRANSFORMERS for release in matrix.REFUSED_RELEASES)


def test_every_module_auto_map_names_imports_the_files_it_needs_itself():
    """transformers 5.4 - 5.9 copy into the remote-code cache only the siblings the module `auto_map` names imports
    itself; one a sibling imports in turn is missing there, and loading fails (FileNotFoundError). Each such module must
    import them all directly, and each must be among the files a converted folder carries."""

    from transformers.dynamic_module_utils import get_relative_imports

    from iha.conversion.writers import AUTO_MAPS, MODEL_FOLDER, code_files

    package = MODEL_FOLDER
    for model_type, auto_map in AUTO_MAPS.items():
        for entry in auto_map.values():
            module = entry.split(".")[0]
            direct = set(get_relative_imports(package / f"{module}.py"))
            needed, frontier = set(), set(direct)
            while frontier:
                needed |= frontier
                frontier = {name for sibling in frontier for name in get_relative_imports(package / f"{sibling}.py")}
                frontier -= needed
            assert needed <= direct, f"{module}.py imports {sorted(needed - direct)} only through other files"
            assert {f"{name}.py" for name in needed | {module}} <= set(code_files(model_type)), module
