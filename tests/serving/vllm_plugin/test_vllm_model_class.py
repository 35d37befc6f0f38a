"""The plugin's model class on its own, built from a folder's config and loaded with its weights, without an engine
and without a kernel (`model_class_run.py`, a process per build): it runs on every vLLM release the plugin lists,
vLLM's CUDA build on a machine without a GPU included.

vLLM's `AutoWeightsLoader` loads every parameter; a folded layer's projections give the pseudo-heads, pseudo-major,
that the explicit mixing gives from the folder's own mixing tensors, and its output projection the collapse followed
by `o_proj`; the CPU backend's metadata builder (vLLM's own) reads the layer's pages as P * block_size slots of
head size d."""

import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from testing_utils import fresh_machine_environment  # noqa: E402
from vllm_cases import tiny_iha_folder  # noqa: E402


RUN = Path(__file__).with_name("model_class_run.py")


def built(folder: Path, tmp_path: Path, explicit: bool) -> dict:
    output = tmp_path / f"{'explicit' if explicit else 'folded'}.pt"
    command = [sys.executable, str(RUN), str(folder), str(output)] + (["--explicit"] if explicit else [])
    environment = fresh_machine_environment(tmp_path / "machine")
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return torch.load(output)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_pseudo_heads=2, iha_position_mode="virtual", qkv_bias=True, o_proj_bias=True),
        dict(num_pseudo_heads=3, iha_collapse_mode="global", attention_types=["full_attention", "iha_full_attention"]),
    ],
    ids=["P2-biases", "P3-global-collapse-mixed-layers"],
)
def test_folded_layers_compute_the_explicit_mixing_of_the_folders_tensors(tmp_path, overrides):
    folder = tiny_iha_folder(tmp_path / "model", **overrides)
    folded, explicit = built(folder, tmp_path, explicit=False), built(folder, tmp_path, explicit=True)
    checkpoint = load_file(folder / "model.safetensors")

    # Every parameter loaded, named as vLLM's Llama names them (q/k/v and gate/up stacked).
    for run in (folded, explicit):
        assert run["loaded"] == sorted(run["parameters"])
    assert not any("head_mixing" in name for name in folded["parameters"])
    for name, parameter in explicit["parameters"].items():
        if "head_mixing" in name:
            torch.testing.assert_close(parameter, checkpoint[name], rtol=0, atol=0)

    num_pseudo, head_dim = overrides["num_pseudo_heads"], 32
    for run in (folded, explicit):
        view = run["kernel_view"]
        assert view["spec"] == (num_pseudo * head_dim, 32) and view["kernel"] == (head_dim, num_pseudo * 32)
        assert view["isa"][0] == view["isa"][1]  # the layer writes its pages in the layout the kernel reads

    for index, (fold, mix) in enumerate(zip(folded["layers"], explicit["layers"])):
        if not fold["folded"]:  # a standard layer: the same projections either way
            assert mix["output"] is None
        for name in ("q", "k", "v", "output"):
            if fold[name] is None:
                continue
            torch.testing.assert_close(fold[name], mix[name], rtol=1e-5, atol=1e-5, msg=f"layer {index}: {name}")
