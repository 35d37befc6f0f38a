"""Analytic FLOP counts of a Llama or IHA decoder: the yardstick `bench_perf.py` sets its time ratios against.

`model_flops` counts the matmul work of a forward pass (projections, attention over the (query, key) pairs the mask
allows, IHA head mixing and collapse, MLP, LM head); `attention_pairs` counts those pairs for one head.
tests/benchmarks/test_bench_perf.py checks both against brute-force mask counts and a count by hand.
"""

from iha.models.iha.layer_iha import IHALayerSpec


def attention_pairs(
    num_tokens: int,
    num_pseudo_heads: int = 1,
    mask_mode: str = "flat_causal",
    sliding_window: int | None = None,
    past_tokens: int = 0,
) -> int:
    """(query, key) pairs one attention head scores for `num_tokens` new tokens after `past_tokens` earlier ones.

    Queries and keys are pseudo-tokens (P per token; P = 1 is standard attention), virtual query i = n * P + p. It sees
    keys up to its causal limit (i under the flat causal mask, the last pseudo-token of its own token under the token
    causal one) and, with a window, only those after i - W * P (the paper's flat window of W * P virtual tokens).
    """
    pairs = 0
    for token in range(past_tokens, past_tokens + num_tokens):
        for pseudo in range(num_pseudo_heads):
            query = token * num_pseudo_heads + pseudo
            last_key = query if mask_mode == "flat_causal" else (token + 1) * num_pseudo_heads - 1
            first_key = 0 if sliding_window is None else max(0, query - sliding_window * num_pseudo_heads + 1)
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
) -> dict[str, int]:
    """Forward FLOPs (2 per multiply-add) of a Llama or IHA decoder on `num_tokens` new tokens after `past_tokens`.

    Counts the matmul work: q/k/v/o projections, attention (q.k scores and weights @ v over the pairs the mask
    allows: an ideal kernel skips the rest), IHA head mixing (queries of the new tokens; keys and values of every
    token the layer attends to in token cache mode, where each step re-mixes the cache, or of the new tokens only in
    pseudo cache mode), the collapse, the MLP and the LM head (`logits_tokens` rows, default all new tokens).
    Element-wise work (norms, RoPE, softmax, activations) is not counted. Attention types as in `IHAConfig`;
    a Llama model is all "full_attention". The sliding caches keep the tokens each layer's window reaches
    (`IHALayerSpec.reach_tokens`: one more on sliding IHA layers at P > 1).
    """
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    logits_tokens = num_tokens if logits_tokens is None else logits_tokens
    flops = {"projections": 0, "attention": 0, "mixing": 0, "mlp": 0, "lm_head": 0}
    for attention_type in attention_types:
        flops["projections"] += 2 * num_tokens * hidden * head_dim * (2 * heads + 2 * kv_heads)
        flops["mlp"] += 2 * num_tokens * 3 * hidden * shape["intermediate_size"]
        is_iha = attention_type.startswith("iha_")
        spec = IHALayerSpec(
            attention_type, num_pseudo_heads if is_iha else 1, sliding_window if "sliding" in attention_type else None
        )
        window, pseudo = spec.sliding_window, spec.num_pseudo_heads
        layer_mask_mode = mask_mode if is_iha else "flat_causal"
        pairs = attention_pairs(num_tokens, pseudo, layer_mask_mode, window, past_tokens)
        flops["attention"] += 2 * 2 * heads * head_dim * pairs
        if is_iha:
            if cache_mode == "pseudo" or past_tokens == 0:
                mixed_kv_tokens = num_tokens
            else:  # the sliding caches hold the tokens the window reaches
                kept = spec.reach_tokens
                cached = past_tokens if kept is None else min(past_tokens, kept)
                mixed_kv_tokens = cached + num_tokens
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * heads
            flops["mixing"] += 2 * 2 * mixed_kv_tokens * pseudo * kv_heads * head_dim * kv_heads
            collapse_sources = 1 if collapse_mode == "per_head" else heads
            flops["mixing"] += 2 * num_tokens * pseudo * heads * head_dim * collapse_sources
    flops["lm_head"] = 2 * logits_tokens * hidden * shape["vocab_size"]
    flops["total"] = sum(flops.values())
    return flops
