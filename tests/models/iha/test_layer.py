"""What an IHA layer is (`iha/models/iha/layer_iha.py`): its window arithmetic against the plain reference's mask,
the refusal of stock kernels written once, and each IHA field's default written once in the package."""

import re

import pytest
import torch
from testing_utils import REPO_ROOT, tiny_iha_config

from iha.models.iha.layer_iha import FIELD_DEFAULTS, IHALayerSpec, stock_kernel_refusal
from iha.models.iha.naive_iha import reference_mask, virtual_layout


@pytest.mark.parametrize("num_pseudo", [1, 2, 3])
@pytest.mark.parametrize("window", [2, 5])
def test_the_window_arithmetic_is_the_reference_masks(num_pseudo, window):
    spec = IHALayerSpec("iha_sliding_attention", num_pseudo, window)
    num_tokens = 3 * window
    allowed = reference_mask(num_tokens, num_pseudo, "flat_causal", window, None)[0]
    query, key = allowed.nonzero().unbind(-1)
    # The kernel's window: every virtual query sees keys i - virtual_window < j <= i, and the widest band is that wide.
    assert ((query - key) < spec.virtual_window).all() and (query - key).max() == spec.virtual_window - 1
    # The reach: the furthest token any query sees back; the cache keeps it, and a sliding cache is built one wider.
    reach = (query // num_pseudo - key // num_pseudo).max().item()
    assert spec.reach_tokens == reach and spec.cache_window == reach + 1
    # Standard sliding layers: W tokens, W - 1 back, transformers' own cache window.
    standard = IHALayerSpec("sliding_attention", 1, window)
    assert (standard.virtual_window, standard.reach_tokens, standard.cache_window) == (window, window - 1, window)
    assert IHALayerSpec("iha_full_attention", num_pseudo, None).cache_window is None


@pytest.mark.parametrize("position_mode", ["virtual", "shared"])
def test_virtual_positions_are_the_references(position_mode):
    spec = IHALayerSpec("iha_full_attention", 3, None, position_mode=position_mode)
    positions = torch.arange(5)[None]
    _, pseudo_index, rope_positions = virtual_layout(positions, 3, position_mode)
    token = positions[0].repeat_interleave(3)
    assert torch.equal(spec.virtual_position(token, pseudo_index), rope_positions[0])


def test_a_config_gives_each_layer_its_spec():
    config = tiny_iha_config(
        num_hidden_layers=3,
        num_pseudo_heads=3,
        sliding_window=4,
        iha_mask_mode="token_causal",
        attention_types=["iha_sliding_attention", "full_attention", "sliding_attention"],
    )
    specs = [config.layer_spec(index) for index in range(3)]
    assert [spec.num_pseudo_heads for spec in specs] == [3, 1, 1]
    assert [spec.virtual_window for spec in specs] == [12, None, 4]
    assert specs[0].mask_mode == "token_causal" and specs[0].stock_kernel_refusal("FlashAttention") is not None
    assert specs[2].stock_kernel_refusal("FlashAttention") is None  # a standard layer runs on any kernel


def test_the_stock_kernel_refusal_names_the_kernel_the_mask_and_the_fix():
    assert stock_kernel_refusal("vLLM's paged attention", "flat_causal") is None
    message = stock_kernel_refusal("vLLM's paged attention", "token_causal")
    assert message.startswith("vLLM's paged attention runs causal attention over the interleaved sequence")
    assert "iha_mask_mode='token_causal' needs an explicit mask" in message and "--mask_mode flat_causal" in message
    assert "\n" not in message


def test_each_fields_default_is_written_once():
    # `num_pseudo_heads: int = 2`, `mask_mode: str = "flat_causal"`: a declared default of an IHA field (a dataclass
    # field, an annotated parameter) anywhere in the package or its research code but layer_iha.py, where the others
    # read it from. A value passed in a call is a choice, not a default.
    found = {}
    for name, default in FIELD_DEFAULTS.items():
        if default is None:
            continue
        literal = f'"{default}"' if isinstance(default, str) else str(default)
        pattern = re.compile(rf"\b(?:iha_)?{name.removeprefix('iha_')}\b\s*:[^=\n]+=\s*{re.escape(literal)}(?!\w)")
        for path in sorted([*(REPO_ROOT / "iha").rglob("*.py"), *(REPO_ROOT / "research").rglob("*.py")]):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line) and "==" not in line:
                    found.setdefault(name, []).append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    for places in found.values():
        assert len(places) == 1 and places[0].startswith("iha/models/iha/layer_iha.py:"), places
    assert set(found) == {name for name, value in FIELD_DEFAULTS.items() if value is not None}
