"""The unit of a sliding IHA layer's window (`iha_window_unit`): "token" (the first releases' window) and "virtual"
(the paper's flat window of W * P virtual tokens), checked against the plain reference on every path.

- the config field: its default for folders written before it, its validation, `paper_hybrid`;
- the reference's own mask: the flat band, the token window of the last pseudo-query, the reach into token n - W;
- the model against the reference: eager, SDPA (dense and blocked), left padding, packed rows, the decomposition;
- caches: DynamicCache, StaticCache and their sliding layers keep one token more, decoding step by step and
  `generate()` equal to decoding without a cache; a cache filled under the narrower window is refused;
- `output_attentions`, and what FlashAttention is told (its run is in scripts/gpu_check.py).
"""

import json

import pytest
import torch
from testing_utils import (
    TINY,
    generation_position_ids,
    greedy_without_cache,
    left_padded_batch,
    tiny_iha_config,
    tiny_iha_model,
)
from transformers import DynamicCache, StaticCache

import iha
from iha.models.iha.blocked_local_iha import BlockedLocalMask, local_attention_blocks, window_reach_tokens
from iha.models.iha.masking_iha import create_iha_masks, kernel_sliding_window
from iha.models.iha.naive_iha import decomposed_attention, reference_forward, reference_mask


HYBRID_TYPES = ["iha_sliding_attention", "full_attention", "sliding_attention", "iha_full_attention"]


def virtual_window_model(num_pseudo=2, window=3, mask_mode="flat_causal", **overrides):
    settings = dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_pseudo_heads=num_pseudo,
        iha_mask_mode=mask_mode,
        sliding_window=window,
        iha_window_unit="virtual",
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


# --- the config field -------------------------------------------------------------------------------------------------


def test_window_unit_defaults_to_token_and_is_validated():
    assert tiny_iha_config(sliding_window=4).iha_window_unit == "token"
    with pytest.raises(ValueError, match=r"`iha_window_unit` must be one of \['token', 'virtual'\], got 'tokens'"):
        tiny_iha_config(sliding_window=4, iha_window_unit="tokens")


def test_folder_without_the_field_keeps_the_token_window(tmp_path):
    model = tiny_iha_model(num_pseudo_heads=2, sliding_window=3).double()
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    fields = json.loads(config_file.read_text())
    assert fields.pop("iha_window_unit") == "token"
    config_file.write_text(json.dumps(fields))  # a folder written before the field existed
    loaded = iha.IHAForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.config.iha_window_unit == "token"
    input_ids, attention_mask = left_padded_batch(seq_len=10)
    position_ids = generation_position_ids(attention_mask)
    with torch.no_grad():
        logits = loaded(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        token_window = reference_forward(model, input_ids, attention_mask, position_ids)
        model.config.iha_window_unit = "virtual"
        virtual_window = reference_forward(model, input_ids, attention_mask, position_ids)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], token_window[real], rtol=0, atol=1e-6)
    assert (logits[real] - virtual_window[real]).abs().max() > 1e-3  # the two windows really differ


def test_paper_hybrid_writes_the_virtual_window_and_it_round_trips(tmp_path):
    config = iha.IHAConfig.paper_hybrid(training_length=24, **{**TINY, "num_hidden_layers": 5})
    assert config.iha_window_unit == "virtual"
    assert config.sliding_window == 3
    kept = iha.IHAConfig.paper_hybrid(training_length=24, iha_window_unit="token", **{**TINY, "num_hidden_layers": 5})
    assert kept.iha_window_unit == "token"
    config.save_pretrained(tmp_path)
    assert iha.IHAConfig.from_pretrained(tmp_path).iha_window_unit == "virtual"


# --- the reference's mask ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_pseudo", [2, 3])
def test_virtual_window_is_a_flat_band_whose_last_pseudo_query_sees_the_token_window(num_pseudo):
    num_tokens, window = 12, 4
    virtual = reference_mask(num_tokens, num_pseudo, "flat_causal", window, None, window_unit="virtual")[0]
    token = reference_mask(num_tokens, num_pseudo, "flat_causal", window, None, window_unit="token")[0]
    # Every pseudo-query past the start sees W * P virtual keys.
    assert (virtual.sum(-1)[window * num_pseudo :] == window * num_pseudo).all()
    for n in range(window, num_tokens):
        last = n * num_pseudo + num_pseudo - 1
        seen_tokens = virtual[last].nonzero().flatten() // num_pseudo
        assert seen_tokens.unique().tolist() == list(range(n - window + 1, n + 1))
        assert torch.equal(virtual[last], token[last])
        # The first pseudo-query reaches the later pseudo-keys of token n - W: one token further than the token window.
        first = n * num_pseudo
        reached = virtual[first].nonzero().flatten()
        assert reached.min().item() == (n - window) * num_pseudo + 1
        assert token[first].nonzero().flatten().min().item() == (n - window + 1) * num_pseudo
    assert window_reach_tokens(window, num_pseudo, "virtual") == window
    assert window_reach_tokens(window, 1, "virtual") == window - 1 == window_reach_tokens(window, num_pseudo)


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
    allowed = reference_mask(num_tokens, num_pseudo, mask_mode, window, padding_mask, window_unit="virtual")
    scores = (query @ key.transpose(-1, -2) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ value
    decomposed = decomposed_attention(query, key, value, num_pseudo, mask_mode, 0.3, window, padding_mask, "virtual")
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


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("window", [6, 33])
def test_blocked_local_attention_covers_the_virtual_window(window, mask_mode, precision):
    # With W = 33 and P = 2 the blocks are 32 tokens: the token window reaches 32 tokens back (one earlier block),
    # the virtual window 33 (two).
    model = virtual_window_model(2, window, mask_mode).double()
    assert local_attention_blocks(33, 2, "token")[1] == 1 and local_attention_blocks(33, 2, "virtual")[1] == 2
    block_tokens, context_blocks = local_attention_blocks(window, 2, "virtual")
    seq_len = (context_blocks + 3) * block_tokens + 5
    input_ids, attention_mask = left_padded_batch(seq_len=seq_len)
    attention_mask[1, : block_tokens + 3] = 0  # padding across a block boundary
    input_ids[attention_mask == 0] = 0
    inputs_embeds = model.model.embed_tokens(input_ids)
    masks = create_iha_masks(model.config, inputs_embeds, attention_mask, None)
    assert isinstance(masks["iha_sliding_attention"], BlockedLocalMask)
    logits, expected = logits_and_reference(model, input_ids, attention_mask, precision)
    precision.assert_close(logits, expected, rtol=0, atol=1e-6)


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


def test_blocked_local_gradients_with_the_virtual_window_match_reference(precision):
    model = virtual_window_model(2, window=6).double().train()
    input_ids, attention_mask = left_padded_batch(seq_len=80)
    position_ids = generation_position_ids(attention_mask)
    real = attention_mask.bool()
    tested = precision.model(model)
    inputs = precision.to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    tested(**inputs).logits[precision.to_device(real)].square().mean().backward()
    gradients = {name: p.grad.clone() for name, p in tested.named_parameters()}
    model.zero_grad()
    reference_forward(model, input_ids, attention_mask, position_ids)[real].square().mean().backward()
    for name, parameter in model.named_parameters():
        scale = parameter.grad.abs().max().item()
        precision.assert_close(gradients[name], parameter.grad, rtol=1e-5, atol=1e-5 * scale, msg=name, gradient=True)


def test_output_attentions_keep_the_flat_band():
    model = virtual_window_model(3, window=2, attn_implementation="eager")
    input_ids, _ = left_padded_batch(seq_len=6)
    with torch.no_grad():
        attentions = model(input_ids, output_attentions=True).attentions
    allowed = reference_mask(6, 3, "flat_causal", 2, None, window_unit="virtual")[0]
    sliding_iha = attentions[0]  # layer 0: a sliding IHA layer
    assert sliding_iha.shape == (3, 4, 18, 18)
    assert (sliding_iha[:, :, ~allowed] == 0).all()
    assert (sliding_iha[:, :, allowed] > 0).all()
    torch.testing.assert_close(sliding_iha.sum(-1), torch.ones(3, 4, 18))


def test_flash_attention_takes_the_virtual_window():
    virtual = tiny_iha_config(
        num_pseudo_heads=3,
        sliding_window=4,
        iha_window_unit="virtual",
        attention_types=HYBRID_TYPES,
        num_hidden_layers=4,
    )
    assert [kernel_sliding_window(virtual, t) for t in HYBRID_TYPES] == [12, None, 4, None]
    token = tiny_iha_config(num_pseudo_heads=3, sliding_window=4, attention_types=HYBRID_TYPES, num_hidden_layers=4)
    assert [kernel_sliding_window(token, t) for t in HYBRID_TYPES] == [None, None, 4, None]
    check_flash(virtual)  # accepted: FlashAttention's own window computes it
    with pytest.raises(ValueError, match="iha_window_unit='token'"):
        check_flash(token)


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
    model.config.iha_window_unit = "token"
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    model.config.iha_window_unit = "virtual"
    with pytest.raises(ValueError, match="filled keeping 2"):
        model(input_ids[:, :1], past_key_values=cache, use_cache=True)
