"""The transformers-release compatibility layer (`iha/models/iha/compat_iha.py`): the supported range, the cache argument under
both names, and the self-check that guards releases newer than the newest tested one."""

import logging

import pytest
import torch
from testing_utils import TINY, left_padded_batch, tiny_iha_model

import iha
import iha.models.iha.modeling_iha
from iha.models.iha import compat_iha


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.3.0"])
def test_releases_below_the_minimum_are_refused_with_the_fix(version):
    with pytest.raises(compat_iha.UnsupportedTransformersError) as error:
        compat_iha.check_minimum_release(version)
    message = str(error.value)
    assert f"transformers {version} is installed" in message
    assert "transformers >= 5.4.0" in message
    assert 'pip install "transformers>=5.4.0,<5.26"' in message


@pytest.mark.parametrize("version", ["5.4.0", "5.13.1", "5.24.0", "5.25.0", "5.25.3", "5.26.0.dev0"])
def test_supported_and_newer_releases_pass_the_minimum(version):
    compat_iha.check_minimum_release(version)


def test_only_releases_after_the_newest_tested_line_are_untested():
    assert not compat_iha.is_untested_release("5.24.0")
    assert not compat_iha.is_untested_release("5.25.2")
    assert compat_iha.is_untested_release("5.26.0")
    assert compat_iha.is_untested_release("6.0.0")


def test_cache_is_taken_under_either_name():
    cache = object()
    assert compat_iha.take_cache_argument(cache, {}) is cache
    kwargs = {"cache": cache, "output_attentions": False}
    assert compat_iha.take_cache_argument(None, kwargs) is cache
    assert "cache" not in kwargs and "output_attentions" in kwargs
    with pytest.raises(ValueError, match="not both"):
        compat_iha.take_cache_argument(cache, {"cache": object()})


def test_model_decodes_the_same_with_the_cache_passed_as_cache_or_past_key_values():
    model = tiny_iha_model(num_key_value_heads=2)
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask, use_cache=False).logits[:, -1]
        for name in ("past_key_values", "cache"):
            prefill = model(input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=True)
            cache = compat_iha.output_cache(prefill)
            step = model(input_ids[:, -1:], attention_mask=attention_mask, **{name: cache}).logits[:, -1]
            torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.fixture
def untested_release(monkeypatch):
    """The installed transformers judged as "5.99.0", a release newer than every tested one, with no check run yet."""
    monkeypatch.setattr(compat_iha, "INSTALLED_TRANSFORMERS", "5.99.0")
    monkeypatch.setattr(compat_iha, "SELF_CHECK_RESULTS", {})
    monkeypatch.delenv(compat_iha.SKIP_SELF_CHECK_VARIABLE, raising=False)
    return "5.99.0"


def generate_kwargs():
    input_ids, attention_mask = left_padded_batch()
    return dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_on_an_untested_release_the_first_cached_forward_checks_once_and_warns(untested_release, caplog):
    model = tiny_iha_model(num_key_value_heads=2)
    with torch.no_grad():
        input_ids, attention_mask = left_padded_batch()
        model(input_ids, attention_mask=attention_mask, use_cache=False)
        assert compat_iha.SELF_CHECK_RESULTS == {}  # a forward without a cache checks nothing
        with caplog.at_level(logging.WARNING):
            first = model.generate(**generate_kwargs())
            second = model.generate(**generate_kwargs())
    assert compat_iha.SELF_CHECK_RESULTS == {untested_release: None}
    assert caplog.text.count("newer than the releases IHA was tested with") == 1
    assert torch.equal(first, second)


def rename_the_cache_in_generate(monkeypatch):
    """What a new release's `generate` could do to model code written before it (5.24 did it once: `past_key_values`
    became `cache`): pass the cache under a name the model does not know. The model then finds no cache, starts an
    empty one at every step and decodes each token from nothing but itself, without an error."""
    from transformers.generation import GenerationMixin

    prepare_inputs = GenerationMixin.prepare_inputs_for_generation

    def prepare_inputs_under_a_new_name(self, *args, **kwargs):
        model_inputs = prepare_inputs(self, *args, **kwargs)
        for name in ("past_key_values", "cache"):
            if name in model_inputs:
                model_inputs["kv_cache"] = model_inputs.pop(name)
        return model_inputs

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", prepare_inputs_under_a_new_name)


def test_an_untested_release_with_a_broken_cache_path_is_refused_at_the_first_cached_forward(
    untested_release, monkeypatch
):
    model = tiny_iha_model(num_key_value_heads=2)
    rename_the_cache_in_generate(monkeypatch)
    for _ in range(2):  # the failure is remembered: every cached forward refuses, without checking again
        with pytest.raises(compat_iha.UnsupportedTransformersError) as error, torch.no_grad():
            model.generate(**generate_kwargs())
        message = str(error.value)
        assert "\n" not in message
        assert "transformers 5.99.0 is newer than the releases IHA was tested with" in message
        assert "greedy generation with DynamicCache differs from generation without a cache" in message
        assert message.endswith("Set IHA_SKIP_TRANSFORMERS_SELF_CHECK=1 to run anyway.")
        assert 'Fix: pip install "transformers>=5.4.0,<5.26"' in message
    assert list(compat_iha.SELF_CHECK_RESULTS) == [untested_release]
    monkeypatch.setenv(compat_iha.SKIP_SELF_CHECK_VARIABLE, "1")
    with torch.no_grad():
        model.generate(**generate_kwargs())


def test_on_a_tested_release_a_broken_cache_path_is_not_checked_for(monkeypatch):
    # The check costs nothing where the matrix ran: no tiny model is built on a tested release.
    monkeypatch.setattr(compat_iha, "SELF_CHECK_RESULTS", {})
    monkeypatch.setattr(compat_iha, "cache_path_self_check", lambda *classes: pytest.fail("checked a tested release"))
    with torch.no_grad():
        tiny_iha_model(num_key_value_heads=2).generate(**generate_kwargs())
    assert compat_iha.SELF_CHECK_RESULTS == {}


def test_importing_the_model_files_on_an_untested_release_builds_no_model():
    # A fresh interpreter that takes transformers for 5.99.0 and fails if any model is built or run: importing the
    # files that travel with the weights must do neither.
    import subprocess
    import sys

    program = (
        "import transformers\n"
        "transformers.__version__ = '5.99.0'\n"
        "from transformers import PreTrainedModel\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError('a model was built at import')\n"
        "PreTrainedModel.__init__ = refuse\n"
        "from iha.models.iha import compat_iha, modeling_iha, modeling_iha_gemma3\n"
        "assert compat_iha.is_untested_release() and compat_iha.SELF_CHECK_RESULTS == {}\n"
        "print('imported')\n"
    )
    completed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0 and completed.stdout.strip() == "imported", completed.stderr[-2000:]


def test_saved_folders_carry_the_compatibility_module(tmp_path):
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
    assert compat_iha.SUPPORTED_TRANSFORMERS == "transformers>=5.4.0,<5.26"
    assert compat_iha.MINIMUM_TRANSFORMERS == (5, 4, 0) and compat_iha.NEWEST_TESTED_TRANSFORMERS == (5, 25)
    assert compat_iha.INSTALL_COMMAND == 'pip install "transformers>=5.4.0,<5.26"'
    assert compat_iha.supported_requirement("5.16.0") == "transformers>=5.16.0,<5.26"
    setup_arguments = {}
    monkeypatch.setattr(setuptools, "setup", lambda **arguments: setup_arguments.update(arguments))
    runpy.run_path(str(root / "setup.py"))
    assert setup_arguments["version"] == iha.__version__
    assert compat_iha.SUPPORTED_TRANSFORMERS in setup_arguments["install_requires"]
    for page in ("README.md", "docs/transformers-releases.md"):
        text = (root / page).read_text(encoding="utf-8")
        assert f"tested up to {compat_iha.release_text(compat_iha.NEWEST_TESTED_TRANSFORMERS)}.x" in text, page
        assert compat_iha.INSTALL_COMMAND.removeprefix("pip install ") in text, page


def test_self_check_runs_inside_no_init_and_meta_device_contexts_and_keeps_the_random_state():
    from transformers.initialization import no_init_weights

    state = torch.random.get_rng_state()
    with no_init_weights():
        assert compat_iha.cache_path_self_check(iha.IHAConfig, iha.IHAForCausalLM) is None
    with torch.device("meta"):
        assert compat_iha.cache_path_self_check(iha.IHAConfig, iha.IHAForCausalLM) is None
    assert torch.equal(torch.random.get_rng_state(), state)


def test_self_check_reports_a_crash_as_a_failure(monkeypatch):
    def broken_generate(self, *args, **kwargs):
        raise TypeError("generate() got an unexpected keyword argument")

    monkeypatch.setattr(iha.IHAForCausalLM, "generate", broken_generate)
    failure = compat_iha.cache_path_self_check(iha.IHAConfig, iha.IHAForCausalLM)
    assert failure.startswith("the check could not run (TypeError: generate() got an unexpected keyword argument")


def test_the_matrix_covers_the_stated_range():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "transformers_matrix.py"
    spec = importlib.util.spec_from_file_location("transformers_matrix", path)
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    assert compat_iha.release_tuple(matrix.RELEASES[0]) == compat_iha.MINIMUM_TRANSFORMERS
    assert compat_iha.release_tuple(matrix.RELEASES[-1])[:2] == compat_iha.NEWEST_TESTED_TRANSFORMERS
    assert all(
        compat_iha.release_tuple(release) < compat_iha.MINIMUM_TRANSFORMERS for release in matrix.REFUSED_RELEASES
    )


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
