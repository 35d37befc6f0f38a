"""The version matrix's own logic (scripts/transformers_matrix.py and its check script), without building its
environments: the folders it makes (the paper's hybrid, random mixing), how it judges the outputs of a process without
`iha` against those of one with it, its report, and the check script's side that runs with the package, on this
environment's transformers."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "scripts"))
import transformers_matrix  # noqa: E402
import transformers_matrix_check  # noqa: E402


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return transformers_matrix.hybrid_folder(tmp_path_factory.mktemp("hybrid"))


def test_the_hybrid_folder_is_the_papers_layout_at_two_pseudo_heads(hybrid):
    config = json.loads((hybrid / "config.json").read_text())
    assert config["attention_types"] == ["iha_sliding_attention"] * 4 + ["full_attention"]
    assert config["num_pseudo_heads"] == 2
    # The paper's window: training length (max_position_embeddings, 128) / (2 P^2).
    assert config["sliding_window"] == 128 // (2 * 2**2)
    # The long batch is long enough for the package's blocked path at this window.
    assert transformers_matrix.expected_plans(hybrid) == {
        "padded": {transformers_matrix.BLOCKED},
        "packed": {transformers_matrix.BLOCKED},
    }


def test_random_mixing_moves_every_mixing_tensor_and_nothing_else(hybrid, tmp_path):
    mixed = transformers_matrix.with_random_mixing(hybrid, tmp_path)
    assert mixed.name == "tiny-llama-hybrid-mixed-iha"
    before, after = load_file(hybrid / "model.safetensors"), load_file(mixed / "model.safetensors")
    assert before.keys() == after.keys()
    mixing = [name for name in before if ".head_mixing." in name]
    assert len(mixing) == 4 * 4  # alpha_q, alpha_k, alpha_v, collapse of each sliding IHA layer
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved == (name in mixing), name
    assert (mixed / "modeling_iha.py").read_bytes() == (hybrid / "modeling_iha.py").read_bytes()


def outputs(logits_shift=0.0, tokens_shift=0, plans=None, loaded_from="transformers_modules.x.modeling_iha") -> dict:
    generator = torch.Generator().manual_seed(0)
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[1, :2] = 0
    padded = torch.randn(2, 6, 5, generator=generator)
    packed = torch.randn(1, 6, 5, generator=generator)
    tokens = torch.arange(16).view(2, 8)
    return {
        "loaded_from": loaded_from,
        "attention_mask": attention_mask,
        "padded_logits": padded + logits_shift,
        "packed_logits": packed,
        "padded_logits_eager": padded + 1e-7,
        "packed_logits_eager": packed,
        "dynamic_cache_tokens": tokens + tokens_shift,
        "static_cache_tokens": tokens,
        "plans": plans
        or {
            "padded": {"BlockedLocalMask": 4},
            "packed": {"BlockedLocalMask": 4},
            "dynamic_cache": {},
            "static_cache": {},
        },
    }


def compare(tmp_path, folder, without: dict, with_package: dict) -> dict:
    torch.save({folder.name: {"auto": without}}, tmp_path / "without.pt")
    torch.save({folder.name: {"folder": with_package}}, tmp_path / "with.pt")
    return transformers_matrix.compare_outputs(tmp_path / "without.pt", tmp_path / "with.pt", [folder])[0]


def test_outputs_agree_within_rounding_and_differences_fail(hybrid, tmp_path):
    row = compare(tmp_path, hybrid, outputs(), outputs(logits_shift=2e-6))
    assert row["passed"], row
    # The process without the package must have run the folder's own code; with `auto_map's class`, so must the
    # other.
    assert not compare(tmp_path, hybrid, outputs(loaded_from="iha.models.iha.modeling_iha"), outputs())["passed"]
    assert not compare(tmp_path, hybrid, outputs(), outputs(loaded_from="iha.models.iha.modeling_iha"))["passed"]
    assert row["padded_tolerance"] == 1e-5 and row["padded_difference"] == pytest.approx(2e-6, rel=0.1)
    # Past fp32 rounding (the padding is not compared, the real tokens are).
    assert not compare(tmp_path, hybrid, outputs(), outputs(logits_shift=1e-3))["passed"]
    # One greedy token different.
    row = compare(tmp_path, hybrid, outputs(), outputs(tokens_shift=1))
    assert not row["passed"] and not row["dynamic_cache"] and row["static_cache"]


def test_outputs_fail_where_the_package_did_not_take_its_path(hybrid, tmp_path):
    dense_only = {"padded": {"Tensor": 4}, "packed": {"Tensor": 4}, "dynamic_cache": {}, "static_cache": {}}
    row = compare(tmp_path, hybrid, outputs(), outputs(plans=dense_only))
    assert not row["passed"]
    assert row["plans_missing"] == {"padded": ["BlockedLocalMask"], "packed": ["BlockedLocalMask"]}
    assert "**missing blocked**" in transformers_matrix.plans_cell(row)
    # A process whose outputs are missing altogether fails too.
    (tmp_path / "with.pt").unlink()
    assert not transformers_matrix.compare_outputs(tmp_path / "without.pt", tmp_path / "with.pt", [hybrid])[0]["passed"]


def test_the_report_marks_what_failed(hybrid, tmp_path):
    good = compare(tmp_path, hybrid, outputs(), outputs())
    bad = compare(tmp_path, hybrid, outputs(), outputs(tokens_shift=1))
    refused = {
        "folder": hybrid.name,
        "continuous_batching": "refused",
        "generate_after": "equal",
        "passed": True,
        "message": "ValueError: Continuous batching of IHA models needs the package.",
    }
    stuck = {
        "folder": hybrid.name,
        "continuous_batching": "refused",
        "generate_after": "error",
        "generate_after_error": "ValueError: attn_implementation 'paged|sdpa' runs only under continuous batching",
        "passed": False,
    }
    results = [
        {"transformers": "5.4.0", "models": [], "agreement": [good], "continuous_batching": [refused], "passed": True},
        {
            "transformers": "5.25.0",
            "models": [],
            "agreement": [bad],
            "continuous_batching_with_iha": [stuck],
            "passed": False,
        },
    ]
    table = transformers_matrix.markdown_table(results)
    loaded = "auto_map's class: the folder's classes"
    assert f"| 5.4.0 | tiny-llama-hybrid | {loaded} | " in table and "**different**" not in table.split("| 5.25.0")[0]
    assert f"| 5.25.0 | tiny-llama-hybrid | {loaded} | " in table and "**different**" in table.split("| 5.25.0")[1]
    # Continuous batching without the package refused; nothing reported with it.
    assert "| 5.4.0 | tiny-llama-hybrid | refused | **not run** |" in table
    # generate() failing after a refused continuous batching session.
    assert "| 5.25.0 | tiny-llama-hybrid | **not run** | **refused; then generate(): error (ValueError: " in table
    assert "```text\nValueError: Continuous batching of IHA models needs the package.\n```" in table


@pytest.mark.slow
def test_the_check_with_the_package_runs_its_fast_paths_and_continuous_batching(hybrid, tmp_path):
    """The check script's side with `iha` imported, on this environment's transformers: the hybrid folder with random
    mixing takes the blocked path on the long batch and the packed row, and continuous batching decodes what
    generate() decodes."""
    mixed = transformers_matrix.with_random_mixing(hybrid, tmp_path)
    out = tmp_path / "with.pt"
    command = [sys.executable, str(transformers_matrix.CHECK_SCRIPT), "check", "--with-iha"]
    command += ["--batch", str(mixed), "--outputs", str(out), str(mixed)]
    completed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["passed"], report
    assert report["continuous_batching"][0]["continuous_batching"] == "equal"
    # Loaded by AutoModelForCausalLM (the package's classes, `iha` imported) and by the folder's own classes.
    assert [(output["loader"], output["loaded_from"].split(".")[0]) for output in report["outputs"]] == [
        ("auto", "iha"),
        ("folder", "transformers_modules"),
    ]
    for output in report["outputs"]:
        plans = output["plans"]
        assert plans["padded"].get("BlockedLocalMask", 0) == 4 and plans["packed"].get("BlockedLocalMask", 0) == 4
    saved = torch.load(out, weights_only=True)[mixed.name]["folder"]
    assert saved["padded_logits"].shape == (3, transformers_matrix_check.LONG_LENGTH, 128)
    assert saved["dynamic_cache_tokens"].shape[1] == transformers_matrix_check.LONG_LENGTH + 20
