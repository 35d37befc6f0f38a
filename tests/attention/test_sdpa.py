"""IHA layers on SDPA with the installed package (`iha/attention/sdpa.py`, `blocked_local.py`) and the cache modes,
each checked against the plain-einsum reference.

- flat causal prefill without padding: SDPA's `is_causal` kernel, no (N*P)^2 mask;
- sliding IHA layers without past tokens: blocked local attention (cost grows with N * W), covering the paper's
  window of W * P virtual tokens;
- dense masks on CPU: SDPA reading each KV head for its query group;
- `iha_cache_mode="pseudo"`: cached pseudo keys and values instead of re-mixing the token cache every step.
"""

import pytest
import torch
from testing_utils import (
    TINY,
    generation_position_ids,
    greedy_without_cache,
    left_padded_batch,
    record_sdpa_calls,
    relative_top2_gap,
    sharpen_attention,
    tiny_iha_config,
    tiny_iha_model,
)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import iha
from iha.attention.blocked_local import BlockedLocalMask, local_attention_blocks
from iha.models.iha.layer_iha import IHALayerSpec
from iha.models.iha.masking_iha import create_iha_masks
from iha.models.iha.naive_iha import reference_forward


# --- flat causal prefill: SDPA's is_causal kernel ---------------------------------------------------------------------


def test_flat_causal_prefill_without_padding_runs_is_causal_sdpa_without_a_mask(monkeypatch, precision):
    model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3).double()
    input_ids, _ = left_padded_batch(seq_len=9)
    virtual_len = 9 * 3
    inputs_embeds = model.model.embed_tokens(input_ids)
    assert create_iha_masks(model.config, inputs_embeds, None, None)["iha_full_attention"] is None
    all_real = torch.ones_like(input_ids)
    assert create_iha_masks(model.config, inputs_embeds, all_real, None)["iha_full_attention"] is None

    tested = precision.model(model)
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        logits = tested(precision.to_device(input_ids)).logits.cpu()
        cache = DynamicCache(config=tested.config)
        tested(*precision.to_device(input_ids, all_real), past_key_values=cache, use_cache=True)
    assert len(calls) == 2 * model.config.num_hidden_layers
    for call in calls:
        assert call["mask"] is None and call["is_causal"] and call["queries"] == call["keys"] == virtual_len
    precision.assert_close(logits, reference_forward(model, input_ids), rtol=0, atol=1e-6)

    # Decoding one token is P queries against a longer cache: torch's top-left `is_causal` would be wrong there.
    calls.clear()
    with torch.no_grad():
        tested(*precision.to_device(input_ids[:, :1], torch.ones(3, 10)), past_key_values=cache, use_cache=True)
    assert all(call["mask"] is not None and not call["is_causal"] for call in calls)


@pytest.mark.parametrize("case", ["left-padding", "token-causal"])
def test_masks_are_built_where_is_causal_would_be_wrong(case):
    mask_mode = "token_causal" if case == "token-causal" else "flat_causal"
    config = tiny_iha_config(num_pseudo_heads=2, iha_mask_mode=mask_mode, attn_implementation="sdpa")
    input_ids, attention_mask = left_padded_batch(seq_len=6)
    if case == "token-causal":
        attention_mask = None
    inputs_embeds = torch.zeros(3, 6, TINY["hidden_size"])
    mask = create_iha_masks(config, inputs_embeds, attention_mask, None)["iha_full_attention"]
    assert isinstance(mask, torch.Tensor) and mask.shape[-2:] == (12, 12)


# --- sliding IHA layers: blocked local attention -----------------------------------------------------------------------


def hybrid_model(mask_mode="flat_causal", num_pseudo=2, window=6, **overrides):
    attention_types = ["iha_sliding_attention", "iha_sliding_attention", "full_attention"]
    model = tiny_iha_model(
        num_hidden_layers=3,
        num_key_value_heads=2,
        num_pseudo_heads=num_pseudo,
        iha_mask_mode=mask_mode,
        attention_types=attention_types,
        sliding_window=window,
        **overrides,
    )
    return sharpen_attention(model)


def sliding_mask(model, seq_len, attention_mask=None, past_key_values=None):
    inputs_embeds = torch.zeros(1 if attention_mask is None else attention_mask.shape[0], seq_len, TINY["hidden_size"])
    masks = create_iha_masks(model.config, inputs_embeds, attention_mask, past_key_values)
    return masks["iha_sliding_attention"]


def test_sliding_layers_use_blocked_attention_whose_size_grows_with_n_times_w():
    model = hybrid_model(num_pseudo=2, window=6)
    block_tokens, context_blocks = local_attention_blocks(IHALayerSpec("iha_sliding_attention", 2, 6))
    long_mask = sliding_mask(model, 8 * block_tokens)
    longer_mask = sliding_mask(model, 16 * block_tokens)
    assert isinstance(long_mask, BlockedLocalMask) and isinstance(longer_mask, BlockedLocalMask)
    # Twice the tokens, twice the (query, key) pairs computed: linear in N, not quadratic.
    assert longer_mask.allowed.numel() == 2 * long_mask.allowed.numel()
    window_len = (context_blocks + 1) * block_tokens * 2
    assert long_mask.allowed.shape[-1] == window_len
    # Short sequences (nothing to skip) and decoding with past tokens keep the dense mask.
    assert isinstance(sliding_mask(model, (context_blocks + 1) * block_tokens), torch.Tensor)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 90, (1, 8 * block_tokens)), past_key_values=cache, use_cache=True)
    assert isinstance(sliding_mask(model, 1, torch.ones(1, 8 * block_tokens + 1), cache), torch.Tensor)


BLOCKED_MODES = [
    ("flat_causal", 2, "virtual", 6),
    ("token_causal", 2, "virtual", 6),
    ("flat_causal", 3, "shared", 5),
    ("token_causal", 1, "shared", 40),
]


@pytest.mark.parametrize("mode", BLOCKED_MODES, ids=lambda mode: "-".join(map(str, mode)))
def test_blocked_local_attention_matches_reference_with_padding(mode, precision):
    mask_mode, num_pseudo, position_mode, window = mode
    model = hybrid_model(mask_mode, num_pseudo, window, iha_position_mode=position_mode).double()
    block_tokens, context_blocks = local_attention_blocks(IHALayerSpec("iha_sliding_attention", num_pseudo, window))
    seq_len = (context_blocks + 3) * block_tokens + 5  # the last block runs past the sequence
    input_ids, attention_mask = left_padded_batch(seq_len=seq_len)
    attention_mask[1, : block_tokens + 3] = 0  # padding across a block boundary
    input_ids[attention_mask == 0] = 0
    position_ids = generation_position_ids(attention_mask)
    assert isinstance(sliding_mask(model, seq_len, attention_mask), BlockedLocalMask)
    inputs = precision.to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    with torch.no_grad():
        logits = precision.model(model)(**inputs).logits.cpu()
        expected = reference_forward(model, input_ids, attention_mask, position_ids)
    real = attention_mask.bool()
    precision.assert_close(logits[real], expected[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_blocked_local_attention_on_packed_sequences_matches_reference(mask_mode, precision):
    model = hybrid_model(mask_mode, num_pseudo=2, window=6).double()
    generator = torch.Generator().manual_seed(3)
    lengths = [70, 45, 60]  # boundaries inside blocks
    packed = torch.randint(3, TINY["vocab_size"], (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    sequence_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    inputs_embeds = model.model.embed_tokens(packed)
    masks = create_iha_masks(model.config, inputs_embeds, None, None, position_ids)
    assert isinstance(masks["iha_sliding_attention"], BlockedLocalMask)
    packed_on_device, positions_on_device = precision.to_device(packed, position_ids)
    with torch.no_grad():
        logits = precision.model(model)(packed_on_device, position_ids=positions_on_device, use_cache=False).logits
        expected = reference_forward(model, packed, position_ids=position_ids, sequence_ids=sequence_ids)
    precision.assert_close(logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_blocked_local_attention_gradients_match_reference(mask_mode, precision):
    model = hybrid_model(mask_mode, num_pseudo=2, window=6).double().train()
    input_ids, attention_mask = left_padded_batch(seq_len=80)
    position_ids = generation_position_ids(attention_mask)
    real = attention_mask.bool()
    assert isinstance(sliding_mask(model, 80, attention_mask), BlockedLocalMask)

    tested = precision.model(model)
    inputs = precision.to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    tested(**inputs).logits[precision.to_device(real)].square().mean().backward()
    gradients = {name: p.grad.clone() for name, p in tested.named_parameters()}
    model.zero_grad()
    reference_forward(model, input_ids, attention_mask, position_ids)[real].square().mean().backward()
    for name, parameter in model.named_parameters():
        # transformers computes RoPE angles in float32 even in a float64 model: ~1e-6 relative differences.
        scale = parameter.grad.abs().max().item()
        precision.assert_close(gradients[name], parameter.grad, rtol=1e-5, atol=1e-5 * scale, msg=name, gradient=True)
    assert gradients["model.layers.0.self_attn.head_mixing.alpha_k"].abs().sum() > 0


def test_generation_after_a_blocked_prefill_matches_uncached_decoding(precision):
    model = hybrid_model("flat_causal", num_pseudo=2, window=6)
    input_ids, attention_mask = left_padded_batch(seq_len=70)
    assert isinstance(sliding_mask(model, 70, attention_mask), BlockedLocalMask)
    model = precision.model(model)
    input_ids, attention_mask = precision.to_device(input_ids, attention_mask)
    gaps = []
    expected = greedy_without_cache(model, input_ids, attention_mask, steps=4, relative_gaps=gaps)
    common = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    precision.assert_same_greedy(model.generate(input_ids, **common), expected, gaps, input_ids.shape[1])
    # A static sliding cache returns all prompt keys at prefill as well, so the prefill takes the blocked path too
    # (eagerly: on a GPU `generate` compiles static-cache decoding by default, which test_compile.py tests).
    static = model.generate(input_ids, cache_implementation="static", disable_compile=True, **common)
    precision.assert_same_greedy(static, expected, gaps, input_ids.shape[1])


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("window", [6, 33])
def test_blocked_local_attention_covers_the_papers_window(window, mask_mode, precision):
    # With W = 33 and P = 2 the blocks are 32 tokens, and the window reaches 33 tokens back (`IHALayerSpec.reach_tokens`):
    # two earlier blocks, where W - 1 tokens would need one.
    spec = IHALayerSpec("iha_sliding_attention", 2, 33)
    assert spec.reach_tokens == 33 and local_attention_blocks(spec) == (32, 2)
    model = hybrid_model(mask_mode, num_pseudo=2, window=window).double()
    block_tokens, context_blocks = local_attention_blocks(IHALayerSpec("iha_sliding_attention", 2, window))
    seq_len = (context_blocks + 3) * block_tokens + 5
    input_ids, attention_mask = left_padded_batch(seq_len=seq_len)
    attention_mask[1, : block_tokens + 3] = 0  # padding across a block boundary
    input_ids[attention_mask == 0] = 0
    position_ids = generation_position_ids(attention_mask)
    assert isinstance(sliding_mask(model, seq_len, attention_mask), BlockedLocalMask)
    inputs = precision.to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
    with torch.no_grad():
        logits = precision.model(model)(**inputs).logits.cpu()
        expected = reference_forward(model, input_ids, attention_mask, position_ids)
    real = attention_mask.bool()
    precision.assert_close(logits[real], expected[real], rtol=0, atol=1e-6)


def test_each_kind_of_mask_runs_its_kernel(monkeypatch):
    """`iha_sdpa_attention` hands a blocked plan, a packed plan and a dense mask on CPU to their kernels, and anything
    else (SDPA's `is_causal` call without a mask) to transformers' SDPA function."""
    from iha.attention import sdpa

    calls = []
    for name in ("blocked_local_attention", "per_document_attention", "masked_sdpa_sharing_kv_heads"):
        monkeypatch.setattr(sdpa, name, lambda *args, name=name, **kwargs: calls.append(name))
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *args, **kwargs: calls.append("transformers"))
    query = torch.zeros(1, 2, 4, 8)
    blocked = BlockedLocalMask(torch.ones(1, 1, 2, 4, dtype=torch.bool), torch.arange(4), 1, 1)
    packed = sdpa.PackedDocumentsMask(groups=[], output_index=None)
    for mask in (blocked, packed, torch.ones(1, 1, 4, 4, dtype=torch.bool), None):
        sdpa.iha_sdpa_attention(None, query, query, query, mask)
    sdpa.iha_sdpa_attention(None, query.to("meta"), query, query, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    assert calls == [
        "blocked_local_attention",
        "per_document_attention",
        "masked_sdpa_sharing_kv_heads",
        "transformers",
        "transformers",  # a dense mask off the CPU: transformers' own function
    ]


# --- cache modes ----------------------------------------------------------------------------------------------------


def greedy_with_reference(model, input_ids, attention_mask, steps, relative_gaps=None):
    for _ in range(steps):
        with torch.no_grad():
            logits = reference_forward(model, input_ids, attention_mask, generation_position_ids(attention_mask))
        if relative_gaps is not None:
            relative_gaps.append(relative_top2_gap(logits[:, -1]))
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=-1)
    return input_ids


PSEUDO_CACHE_MODES = [
    ("flat_causal", "virtual", None),
    ("token_causal", "shared", None),
    ("flat_causal", "virtual", 3),
]


@pytest.mark.parametrize("mode", PSEUDO_CACHE_MODES, ids=lambda mode: "-".join(map(str, mode)))
def test_pseudo_cache_generation_matches_reference_greedy(mode, precision):
    mask_mode, position_mode, window = mode
    layout = {}
    if window is not None:
        layout = {"attention_types": ["iha_sliding_attention", "full_attention", "iha_full_attention"]}
    model = tiny_iha_model(
        num_hidden_layers=3,
        num_key_value_heads=2,
        num_pseudo_heads=3,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
        iha_cache_mode="pseudo",
        sliding_window=window,
        **layout,
    )
    sharpen_attention(model)
    input_ids, attention_mask = left_padded_batch(seq_len=7)
    steps = 8  # past the window of 3 tokens, so the sliding cache drops tokens
    # Ground truth from the reference: the model's own uncached forward also goes through the cache code.
    gaps = []
    expected = greedy_with_reference(model, input_ids, attention_mask, steps, gaps)
    tested = precision.model(model)
    input_ids, attention_mask = precision.to_device(input_ids, attention_mask)
    common = dict(
        attention_mask=attention_mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    precision.assert_same_greedy(tested.generate(input_ids, **common), expected, gaps, input_ids.shape[1])
    static = tested.generate(input_ids, cache_implementation="static", disable_compile=True, **common)
    precision.assert_same_greedy(static, expected, gaps, input_ids.shape[1])


def test_cache_modes_give_equal_decode_logits(precision):
    token_model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3, iha_cache_mode="token")
    pseudo_model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3, iha_cache_mode="pseudo")
    pseudo_model.load_state_dict(token_model.state_dict())
    token_model, pseudo_model = precision.model(token_model), precision.model(pseudo_model)
    input_ids, attention_mask = precision.to_device(*left_padded_batch(seq_len=10))
    position_ids = generation_position_ids(attention_mask)
    step_logits = {}
    for name, model in (("token", token_model), ("pseudo", pseudo_model)):
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad():
            for start, stop in ((0, 6), (6, 7), (7, 8), (8, 10)):
                logits.append(
                    model(
                        input_ids[:, start:stop],
                        attention_mask=attention_mask[:, :stop],
                        position_ids=position_ids[:, start:stop],
                        past_key_values=cache,
                        use_cache=True,
                    ).logits
                )
        step_logits[name] = torch.cat(logits, dim=1)
    real = attention_mask.bool()
    precision.assert_close(step_logits["pseudo"][real], step_logits["token"][real], rtol=1e-5, atol=1e-5)


def cache_bytes(model, input_ids) -> int:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def test_token_cache_costs_the_base_models_memory_and_pseudo_cache_p_times_on_iha_layers():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 2})).eval()
    attention_types = ["iha_full_attention", "full_attention"]
    token = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3, attention_types=attention_types)
    pseudo = tiny_iha_model(
        num_key_value_heads=2, num_pseudo_heads=3, attention_types=attention_types, iha_cache_mode="pseudo"
    )
    input_ids, _ = left_padded_batch(seq_len=12)
    base_bytes = cache_bytes(llama, input_ids)
    assert cache_bytes(token, input_ids) == base_bytes
    # Layer 0 (IHA) stores P = 3 pseudo keys and values per token, layer 1 (standard) the usual ones.
    assert cache_bytes(pseudo, input_ids) == base_bytes // 2 * 3 + base_bytes // 2


def test_pseudo_cache_static_early_initialization_matches_what_the_layers_store():
    model = tiny_iha_model(
        num_key_value_heads=2,
        num_pseudo_heads=3,
        iha_cache_mode="pseudo",
        attention_types=["iha_full_attention", "full_attention"],
    )
    num_heads, head_dims = model._get_static_cache_init_shape()
    lazy = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(3, 90, (1, 5)), past_key_values=lazy, use_cache=True)
    assert [layer.keys.shape[1] for layer in lazy.layers] == [num_heads] * 2
    assert [layer.keys.shape[-1] for layer in lazy.layers] == head_dims == [36, 12]


def test_unknown_cache_mode_is_refused():
    with pytest.raises(ValueError, match="iha_cache_mode"):
        iha.IHAConfig(**TINY, iha_cache_mode="mixed")
