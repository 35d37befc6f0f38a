"""Analytic FLOP counts of a Llama or IHA decoder: the yardstick `bench_perf.py` sets its time ratios against.

`model_flops` counts the matmul work of a forward pass (projections, attention over the (query, key) pairs the mask
allows, IHA head mixing and collapse, MLP, LM head); `attention_pairs` counts those pairs for one head.
tests/benchmarks/test_bench_perf.py checks both against brute-force mask counts and a count by hand.
"""

from iha.models.iha.configuration_iha import is_iha_layer, is_sliding_layer


def attention_pairs(
    num_tokens: int,
    num_pseudo_heads: int = 1,
    mask_mode: str = "flat_causal",
    sliding_window: int | None = None,
    past_tokens: int = 0,
    window_unit: str = "token",
) -> int:
    """(query, key) pairs one attention head scores for `num_tokens` new tokens after `past_tokens` earlier ones.

    Queries and keys are pseudo-tokens (P per token; P = 1 is standard attention). Pseudo-token (n, p) sees the
    pseudo-tokens of the earlier tokens inside the window (the last `sliding_window` tokens, or all) and, of its own
    token, pseudo-tokens 0..p (flat causal) or all P (token causal). With `window_unit="virtual"` the window is the
    last `sliding_window * P` virtual tokens instead (`iha_window_unit`).
    """
    if sliding_window is not None and window_unit == "virtual":
        return virtual_window_pairs(num_tokens, num_pseudo_heads, mask_mode, sliding_window, past_tokens)
    pairs = 0
    for token in range(past_tokens, past_tokens + num_tokens):
        first_visible = 0 if sliding_window is None else max(0, token - sliding_window + 1)
        earlier_keys = (token - first_visible) * num_pseudo_heads
        if mask_mode == "flat_causal":
            own_token_pairs = num_pseudo_heads * (num_pseudo_heads + 1) // 2
        else:
            own_token_pairs = num_pseudo_heads * num_pseudo_heads
        pairs += num_pseudo_heads * earlier_keys + own_token_pairs
    return pairs


def virtual_window_pairs(
    num_tokens: int, num_pseudo_heads: int, mask_mode: str, sliding_window: int, past_tokens: int
) -> int:
    """`attention_pairs` under the virtual window: virtual query i sees keys j > i - W * P up to its causal limit."""
    pairs = 0
    for token in range(past_tokens, past_tokens + num_tokens):
        for pseudo in range(num_pseudo_heads):
            query = token * num_pseudo_heads + pseudo
            last_key = query if mask_mode == "flat_causal" else (token + 1) * num_pseudo_heads - 1
            first_key = max(0, query - sliding_window * num_pseudo_heads + 1)
            pairs += last_key - first_key + 1
    return pairs


def model_flops(
    shape: dict,
    attention_types: list[str],
    num_tokens: int,
    past_tokens: int = 0,
    num_pseudo_heads: int = 1,
    sliding_window: int | None = None,
    mask_mode: str = "flat_causal",
    collapse_mode: str = "per_head",
    cache_mode: str = "token",
    logits_tokens: int | None = None,
    window_unit: str = "token",
) -> dict[str, int]:
    """Forward FLOPs (2 per multiply-add) of a Llama or IHA decoder on `num_tokens` new tokens after `past_tokens`.

    Counts the matmul work: q/k/v/o projections, attention (q.k scores and weights @ v over the pairs the mask
    allows: an ideal kernel skips the rest), IHA head mixing (queries of the new tokens; keys and values of every
    token the layer attends to in token cache mode, where each step re-mixes the cache, or of the new tokens only in
    pseudo cache mode), the collapse, the MLP and the LM head (`logits_tokens` rows, default all new tokens).
    Element-wise work (norms, RoPE, softmax, activations) is not counted. Attention types as in `IHAConfig`;
    a Llama model is all "full_attention". `window_unit` is the `iha_window_unit` of sliding IHA layers (whose
    sliding caches keep one token more under "virtual").
    """
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    logits_tokens = num_tokens if logits_tokens is None else logits_tokens
    flops = {"projections": 0, "attention": 0, "mixing": 0, "mlp": 0, "lm_head": 0}
    for attention_type in attention_types:
        flops["projections"] += 2 * num_tokens * hidden * head_dim * (2 * heads + 2 * kv_heads)
        flops["mlp"] += 2 * num_tokens * 3 * hidden * shape["intermediate_size"]
        is_iha = is_iha_layer(attention_type)
        window = sliding_window if is_sliding_layer(attention_type) else None
        pseudo = num_pseudo_heads if is_iha else 1
        layer_mask_mode = mask_mode if is_iha else "flat_causal"
        layer_window_unit = window_unit if is_iha else "token"
        pairs = attention_pairs(num_tokens, pseudo, layer_mask_mode, window, past_tokens, layer_window_unit)
        flops["attention"] += 2 * 2 * heads * head_dim * pairs
        if is_iha:
            if cache_mode == "pseudo" or past_tokens == 0:
                mixed_kv_tokens = num_tokens
            else:  # the cache holds the last `window - 1` tokens on sliding layers (`window` under the virtual window)
                kept = None if window is None else (window if window_unit == "virtual" else window - 1)
                cached = past_tokens if kept is None else min(past_tokens, kept)
                mixed_kv_tokens = cached + num_tokens
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * heads
            flops["mixing"] += 2 * 2 * mixed_kv_tokens * pseudo * kv_heads * head_dim * kv_heads
            collapse_sources = 1 if collapse_mode == "per_head" else heads
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * collapse_sources
    flops["lm_head"] = 2 * logits_tokens * hidden * shape["vocab_size"]
    flops["total"] = sum(flops.values())
    return flops
