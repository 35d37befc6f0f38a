"""The benchmark of a folder without the package takes the package's paths out of transformers' registries for its
"without" steps, exactly as a process without `iha` has them, and puts them back."""

import sys

import torch
from testing_utils import REPO_ROOT, left_padded_batch, tiny_iha_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_without_package import without_the_package  # noqa: E402


def installed_names():
    registries = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    return sorted(name for registry in registries for name in registry if name.startswith("iha|"))


def test_the_package_paths_are_out_inside_and_back_after():
    before = installed_names()
    assert before == ["iha|paged", "iha|sdpa", "iha|sdpa"]
    with without_the_package():
        assert installed_names() == []
    assert installed_names() == before


def test_without_the_package_the_model_takes_transformers_functions(monkeypatch):
    calls = []
    installed = AttentionInterface._global_mapping["iha|sdpa"]
    monkeypatch.setitem(
        AttentionInterface._global_mapping, "iha|sdpa", lambda *a, **k: calls.append(1) or installed(*a, **k)
    )
    model = tiny_iha_model(num_pseudo_heads=2)
    input_ids, attention_mask = left_padded_batch(seq_len=6)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        assert len(calls) == model.config.num_hidden_layers  # every IHA layer took the package's path
        with without_the_package():
            logits = model(input_ids, attention_mask=attention_mask).logits
    assert len(calls) == model.config.num_hidden_layers  # and none without it, for the same logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)
