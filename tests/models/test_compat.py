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
    assert 'pip install "transformers>=5.4.0,<5.25"' in message


@pytest.mark.parametrize("version", ["5.4.0", "5.13.1", "5.24.0", "5.24.3", "5.25.0.dev0"])
def test_supported_and_newer_releases_pass_the_minimum(version):
    compat_iha.check_minimum_release(version)


def test_only_releases_after_the_newest_tested_line_are_untested():
    assert not compat_iha.is_untested_release("5.23.0")
    assert not compat_iha.is_untested_release("5.24.2")
    assert compat_iha.is_untested_release("5.25.0")
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


def test_self_check_passes_on_this_release_and_warns_for_an_untested_one(caplog):
    assert compat_iha.cache_path_self_check(iha.IHAConfig, iha.IHAForCausalLM) is None
    with caplog.at_level(logging.WARNING):
        compat_iha.check_untested_release(iha.IHAConfig, iha.IHAForCausalLM, version="5.99.0")
    assert "newer than the releases IHA was tested with" in caplog.text


def test_self_check_catches_a_model_that_ignores_the_cache(monkeypatch):
    # What transformers 5.24 did to a model that only knew `past_key_values`: the cache arrives under another name,
    # the model never sees it, and generation continues from nothing but the last token, without an error.
    def lose_the_cache(past_key_values, kwargs):
        kwargs.pop("cache", None)
        return None

    monkeypatch.setattr(iha.models.iha.modeling_iha, "take_cache_argument", lose_the_cache)
    with pytest.raises(compat_iha.UnsupportedTransformersError) as error:
        compat_iha.check_untested_release(iha.IHAConfig, iha.IHAForCausalLM, version="5.99.0")
    message = str(error.value)
    assert "transformers 5.99.0" in message and "self-check" in message
    assert 'pip install "transformers>=5.4.0,<5.25"' in message
    monkeypatch.setenv(compat_iha.SKIP_SELF_CHECK_VARIABLE, "1")
    compat_iha.check_untested_release(iha.IHAConfig, iha.IHAForCausalLM, version="5.99.0")


def test_saved_folders_carry_the_compatibility_module(tmp_path):
    from iha.conversion.writers import CODE_FILES

    iha.IHAForCausalLM(iha.IHAConfig(**TINY)).save_pretrained(tmp_path)
    for name in CODE_FILES:
        assert (tmp_path / name).is_file(), name


def test_install_requirement_is_the_supported_range():
    # `pip install` must keep any supported transformers a user has: setup.py states the same range as the guard.
    import re
    from pathlib import Path

    setup_text = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    requirement = re.search(r'SUPPORTED_TRANSFORMERS = "([^"]+)"', setup_text).group(1)
    assert requirement == "transformers>=5.4.0,<5.25"
    assert f'pip install "{requirement}"' == compat_iha.INSTALL_COMMAND
    assert compat_iha.MINIMUM_TRANSFORMERS == (5, 4, 0) and compat_iha.NEWEST_TESTED_TRANSFORMERS == (5, 24)


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

    path = Path(__file__).resolve().parents[2] / "scripts" / "transformers_matrix.py"
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
