"""The window of sliding IHA layers, the paper's flat window of W * P virtual tokens, checked against the plain
reference on every path.

- the reference's own mask: the flat band, the source's window for the last pseudo-query, the reach into token n - W;
- the model against the reference: eager, SDPA, left padding, packed rows, the decomposition;
- caches: DynamicCache, StaticCache and their sliding layers keep one token more, decoding step by step and
  `generate()` equal to decoding without a cache; a cache filled under the narrower window is refused;
- the retired token window: a config that records it is refused with the fix;
- `output_attentions`, and what FlashAttention is told (its run is in scripts/gpu_check.py).

The fast paths of the installed package on these layouts (blocked windows, packed documents) are tested in
tests/attention/.
"""

import json

import pytest
import torch
from testing_utils import (
    TINY,
    generation_position_ids,
    greedy_without_cache,
    left_padded_batch,
    sharpen_attention,
    tiny_iha_config,
    tiny_iha_model,
)
from transformers import DynamicCache, StaticCache

import iha
from iha.models.iha.layer_iha import IHALayerSpec
from iha.models.iha.naive_iha import decomposed_attention, reference_forward, reference_mask


HYBRID_TYPES = ["iha_sliding_attention", "full_attention", "sliding_attention", "iha_full_attention"]


def virtual_window_model(num_pseudo=2, window=3, mask_mode="flat_causal", **overrides):
    settings = dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_pseudo_heads=num_pseudo,
        iha_mask_mode=mask_mode,
        sliding_window=window,
        attention_types=HYBRID_TYPES,
    )
    return tiny_iha_model(**{**settings, **overrides})


def logits_and_reference(model, input_ids, attention_mask, precision):
    position_ids = generation_position_ids(attention_mask)
    inputs = precision.to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    with torch.no_grad():
        logits = precision.model(model)(**inputs).logits.cpu()
        expected = reference_forward(model, input_ids, attention_mask, position_ids)
    real = attention_mask.bool()
    return logits[real], expected[real]


# --- the retired token window -----------------------------------------------------------------------------------------


def test_a_folder_written_with_the_token_window_is_refused_with_the_fix(tmp_path):
    model = tiny_iha_model(num_pseudo_heads=2, sliding_window=3)
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    fields = json.loads(config_file.read_text())
    assert "iha_window_unit" not in fields
    config_file.write_text(json.dumps({**fields, "iha_window_unit": "token"}))  # a folder of the first versions
    with pytest.raises(ValueError, match=r"iha_window_unit='token'.*Re-convert the source checkpoint \(`iha-convert"):
        iha.IHAForCausalLM.from_pretrained(tmp_path)
    # Where the unit changes nothing (P = 1, no sliding IHA layer) the field is dropped; "virtual" is today's window.
    for settings in (dict(num_pseudo_heads=1, sliding_window=3), dict(num_pseudo_heads=2)):
        assert not hasattr(tiny_iha_config(**settings, iha_window_unit="token"), "iha_window_unit")
    assert not hasattr(tiny_iha_config(sliding_window=3, iha_window_unit="virtual"), "iha_window_unit")


def test_paper_hybrid_round_trips(tmp_path):
    config = iha.IHAConfig.paper_hybrid(training_length=24, **{**TINY, "num_hidden_layers": 5})
    assert config.sliding_window == 3
    config.save_pretrained(tmp_path)
    loaded = iha.IHAConfig.from_pretrained(tmp_path)
    assert loaded.attention_types == config.attention_types and loaded.sliding_window == 3


# --- the reference's mask ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_pseudo", [2, 3])
def test_virtual_window_is_a_flat_band_whose_last_pseudo_query_sees_the_token_window(num_pseudo):
    num_tokens, window = 12, 4
    virtual = reference_mask(num_tokens, num_pseudo, "flat_causal", window, None)[0]
    # Every pseudo-query past the start sees W * P virtual keys.
    assert (virtual.sum(-1)[window * num_pseudo :] == window * num_pseudo).all()
    for n in range(window, num_tokens):
        last = n * num_pseudo + num_pseudo - 1
        seen_tokens = virtual[last].nonzero().flatten() // num_pseudo
        assert seen_tokens.unique().tolist() == list(range(n - window + 1, n + 1))
        assert len(virtual[last].nonzero()) == window * num_pseudo  # every pseudo-token of the source's window
        # The first pseudo-query reaches the later pseudo-keys of token n - W: one token further than W - 1.
        first = n * num_pseudo
        reached = virtual[first].nonzero().flatten()
        assert reached.min().item() == (n - window) * num_pseudo + 1
    spec = IHALayerSpec("iha_sliding_attention", num_pseudo, window)
    assert spec.reach_tokens == window and spec.cache_window == window + 1
    assert spec.virtual_window == window * num_pseudo


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("num_pseudo", [2, 3])
def test_decomposition_with_the_virtual_window_is_exact(mask_mode, num_pseudo):
    # The way an engine with stock causal kernels runs it: the queries before a key's pseudo-index take a window one
    # token wider.
    generator = torch.Generator().manual_seed(0)
    num_tokens, window = 11, 3
    query, key, value = torch.randn(3, 2, 2, num_tokens * num_pseudo, 8, generator=generator, dtype=torch.float64)
    padding_mask = torch.ones(2, num_tokens, dtype=torch.long)
    padding_mask[1, :4] = 0
    allowed = reference_mask(num_tokens, num_pseudo, mask_mode, window, padding_mask)
    scores = (query @ key.transpose(-1, -2) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ value
    decomposed = decomposed_attention(query, key, value, num_pseudo, mask_mode, 0.3, window, padding_mask)
    real = padding_mask.bool().repeat_interleave(num_pseudo, dim=-1)
    torch.testing.assert_close(decomposed.transpose(1, 2)[real], expected.transpose(1, 2)[real], rtol=0, atol=1e-12)


# --- the model against the reference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("num_pseudo", [1, 2, 3])
def test_virtual_window_matches_reference_with_left_padding(num_pseudo, mask_mode, attn_implementation, precision):
    model = virtual_window_model(num_pseudo, mask_mode=mask_mode, attn_implementation=attn_implementation)
    # transformers' eager float mask overflows in float64 (padded rows turn to NaN), so eager runs in float32.
    dtype, atol = (torch.float64, 1e-6) if attn_implementation == "sdpa" else (torch.float32, 1e-5)
    input_ids, attention_mask = left_padded_batch(seq_len=12)
    logits, expected = logits_and_reference(model.to(dtype), input_ids, attention_mask, precision)
    precision.assert_close(logits, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_virtual_window_on_packed_rows_matches_reference(attn_implementation, precision):
    model = virtual_window_model(3, window=4, attn_implementation=attn_implementation).double()
    lengths = [30, 9, 1, 40]  # the long documents cross the window; sdpa takes the blocked path
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(3, TINY["vocab_size"], (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    sequence_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed_on_device, positions_on_device = precision.to_device(packed, position_ids)
    with torch.no_grad():
        logits = precision.model(model)(packed_on_device, position_ids=positions_on_device, use_cache=False).logits
        expected = reference_forward(model, packed, position_ids=position_ids, sequence_ids=sequence_ids)
    precision.assert_close(logits.cpu(), expected, rtol=0, atol=1e-6)


def test_output_attentions_keep_the_flat_band():
    model = virtual_window_model(3, window=2, attn_implementation="eager")
    input_ids, _ = left_padded_batch(seq_len=6)
    with torch.no_grad():
        attentions = model(input_ids, output_attentions=True).attentions
    allowed = reference_mask(6, 3, "flat_causal", 2, None)[0]
    sliding_iha = attentions[0]  # layer 0: a sliding IHA layer
    assert sliding_iha.shape == (3, 4, 18, 18)
    assert (sliding_iha[:, :, ~allowed] == 0).all()
    assert (sliding_iha[:, :, allowed] > 0).all()
    torch.testing.assert_close(sliding_iha.sum(-1), torch.ones(3, 4, 18))


def test_flash_attention_takes_the_virtual_window():
    config = tiny_iha_config(num_pseudo_heads=3, sliding_window=4, attention_types=HYBRID_TYPES, num_hidden_layers=4)
    model = iha.IHAForCausalLM(config)
    assert [layer.self_attn.kernel_sliding_window for layer in model.model.layers] == [12, None, 4, None]
    check_flash(config)  # accepted: FlashAttention's own window computes it


def check_flash(config):
    config._attn_implementation_internal = "flash_attention_2"
    holder = type("Holder", (), {})()
    holder.config = config
    iha.IHAModel._check_attention_implementation(holder)


# --- caches -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_mode", ["token", "pseudo"])
@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("num_pseudo", [2, 3])
def test_decoding_with_sliding_caches_matches_the_full_forward(num_pseudo, cache_class, cache_mode, precision):
    window, seq_len, prefix = 3, 12, 5
    model = precision.model(virtual_window_model(num_pseudo, window, iha_cache_mode=cache_mode).double())
    input_ids, attention_mask = precision.to_device(*left_padded_batch(seq_len=seq_len))
    position_ids = generation_position_ids(attention_mask)
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=seq_len)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        steps = [
            model(
                input_ids[:, :prefix],
                attention_mask=attention_mask[:, :prefix],
                position_ids=position_ids[:, :prefix],
                past_key_values=cache,
                use_cache=True,
            ).logits
        ]
        for t in range(prefix, seq_len):
            step = model(
                input_ids[:, t : t + 1],
                attention_mask=attention_mask[:, : t + 1],
                position_ids=position_ids[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            steps.append(step.logits)
    # Every sliding layer of the cache keeps `window` past tokens, one more than transformers' default.
    sliding_layers = [cache.layers[i] for i, t in enumerate(HYBRID_TYPES) if t.endswith("sliding_attention")]
    for layer in sliding_layers:
        if cache_class == "dynamic":
            assert layer.sliding_window == window + 1 and layer.keys.shape[2] == window
        else:
            assert layer.max_cache_len == window + 1
    incremental = torch.cat(steps, dim=1)
    real = attention_mask.bool()
    precision.assert_close(incremental[real], full[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_generate_with_the_virtual_window_matches_decoding_without_cache(attn_implementation, precision):
    model = precision.model(virtual_window_model(2, window=3, attn_implementation=attn_implementation))
    input_ids, attention_mask = precision.to_device(*left_padded_batch(seq_len=7))
    steps = 8  # past the window, so the sliding caches drop tokens
    gaps = []
    expected = greedy_without_cache(model, input_ids, attention_mask, steps, gaps)
    common = dict(attention_mask=attention_mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    dynamic = model.generate(input_ids, **common)
    static = model.generate(input_ids, cache_implementation="static", disable_compile=True, **common)
    for generated in (dynamic, static):
        precision.assert_same_greedy(generated, expected, gaps, input_ids.shape[1])


def test_a_cache_filled_under_the_narrower_window_is_refused():
    model = virtual_window_model(2, window=3)
    input_ids, _ = left_padded_batch(seq_len=6)
    cache = DynamicCache(config=model.config)
    narrow = tiny_iha_model(num_pseudo_heads=1, num_hidden_layers=4, sliding_window=3, attention_types=HYBRID_TYPES)
    with torch.no_grad():
        narrow(input_ids, past_key_values=cache, use_cache=True)  # P = 1: transformers' window of 3 tokens fits
    with pytest.raises(ValueError, match="reaches 3 past tokens, but its cache .* keeps 2"):
        model(input_ids[:, :1], past_key_values=cache, use_cache=True)


# --- FlashAttention: its own window, in virtual units (a CUDA device with flash-attn: scripts/gpu_check.py) -----------


def check_low_precision_window(model, device):
    """`model` (bfloat16, on `device`) against the float64 reference of the same weights: closer to it, by a margin,
    than the reference with a window one token narrower (a kernel told the window in tokens, or a cache that dropped
    the token the first pseudo-query reaches, is that far off; bf16 noise is of the order of such a difference in a
    tiny model, so a bare tolerance would not tell them apart)."""
    reference = virtual_window_model(2, LOW_PRECISION_WINDOW).double()
    reference.load_state_dict(model.state_dict())
    to_device = lambda tensor: tensor.to(device)  # noqa: E731

    def assert_virtual_window(actual, reference_logits):
        virtual = reference_logits()
        sliding_layers = [layer.self_attn for layer in reference.model.layers if layer.self_attn.sliding_window]
        for attention in sliding_layers:
            attention.sliding_window -= 1
        narrower = reference_logits()
        for attention in sliding_layers:
            attention.sliding_window += 1
        error = (actual.double().cpu() - virtual).abs().max().item()
        gap = (narrower - virtual).abs().max().item()
        assert gap > 0.05, gap  # sharpened attention: ~0.1 here, 20 times bfloat16's error on CPU
        assert error < 0.2 * gap, (error, gap)

    # Left padding (varlen over the unpadded rows), longer than the window of 4 virtual tokens.
    input_ids, attention_mask = left_padded_batch(seq_len=24)
    position_ids = generation_position_ids(attention_mask)
    real = attention_mask.bool()
    with torch.no_grad():
        inputs = dict(attention_mask=to_device(attention_mask), position_ids=to_device(position_ids))
        logits = model(to_device(input_ids), **inputs).logits
        assert_virtual_window(
            logits.cpu()[real], lambda: reference_forward(reference, input_ids, attention_mask, position_ids)[real]
        )

        # Decoding with a DynamicCache past the window: the cache keeps the token the first pseudo-query reaches.
        cache = DynamicCache(config=model.config)
        prefix = 6
        steps = [
            model(
                to_device(input_ids[:, :prefix]),
                attention_mask=to_device(attention_mask[:, :prefix]),
                position_ids=to_device(position_ids[:, :prefix]),
                past_key_values=cache,
                use_cache=True,
            ).logits
        ]
        for t in range(prefix, input_ids.shape[1]):
            step = model(
                to_device(input_ids[:, t : t + 1]),
                attention_mask=to_device(attention_mask[:, : t + 1]),
                position_ids=to_device(position_ids[:, t : t + 1]),
                past_key_values=cache,
                use_cache=True,
            )
            steps.append(step.logits)
        incremental = torch.cat(steps, dim=1).cpu()
        assert_virtual_window(
            incremental[real], lambda: reference_forward(reference, input_ids, attention_mask, position_ids)[real]
        )

        # Packed rows: varlen over virtual cumulative lengths, the window inside every document.
        lengths = [20, 7, 1, 12]
        generator = torch.Generator().manual_seed(2)
        packed = torch.randint(3, TINY["vocab_size"], (1, sum(lengths)), generator=generator)
        packed_positions = torch.cat([torch.arange(n) for n in lengths])[None]
        sequence_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        logits = model(to_device(packed), position_ids=to_device(packed_positions), use_cache=False).logits
        assert_virtual_window(
            logits.cpu(),
            lambda: reference_forward(reference, packed, position_ids=packed_positions, sequence_ids=sequence_ids),
        )


LOW_PRECISION_WINDOW = 2


def low_precision_model(attn_implementation):
    model = virtual_window_model(2, LOW_PRECISION_WINDOW, attn_implementation=attn_implementation)
    return sharpen_attention(model, scale=8.0)


def test_the_low_precision_check_tells_the_windows_apart():
    # What the FlashAttention test below asserts, shown here on SDPA in bfloat16 on the CPU.
    check_low_precision_window(low_precision_model("sdpa").to(torch.bfloat16), torch.device("cpu"))


def test_flash_attention_with_the_virtual_window_matches_reference():
    pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("FlashAttention needs a CUDA device")
    model = low_precision_model("flash_attention_2").to("cuda", torch.bfloat16)
    check_low_precision_window(model, torch.device("cuda"))
