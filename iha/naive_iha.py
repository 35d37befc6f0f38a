"""A small, obviously-correct reference implementation of Interleaved Head Attention.

Plain einsum, explicit virtual positions and an explicit (N*P) x (N*P) mask built from the definitions (each head
mixes into P pseudo-heads, pseudo-tokens interleave token-major at virtual index n * P + p, causal attention over the
virtual sequence, a learned collapse back to H heads); no cache, no kernels, no tricks (RoPE is applied at the full
virtual position after mixing, rather than split into a token-level and a per-pseudo-head rotation as the model does).
It covers what the architectures add around the mixing: per-head q/k norms (Qwen3, Gemma 3) before it, layers
without RoPE (SmolLM3), a RoPE base per layer type and Gemma 3's `query_pre_attn_scalar` and block of four norms.
Every fast path of the model is checked against it: `from iha.naive_iha import reference_forward`. It imports only
torch and does not travel with the weights.
"""

import torch


def rope(states: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Rotate states [B, heads, L, d] by RoPE at positions [B, L]."""
    angles = positions[..., None].to(torch.float64) * inv_freq.to(torch.float64)  # [B, L, d/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, L, d]
    cos, sin = (angles.cos() * scaling).to(states.dtype), (angles.sin() * scaling).to(states.dtype)
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


def virtual_layout(position_ids: torch.Tensor, num_pseudo: int, position_mode: str):
    """Token index, pseudo index and RoPE position of every virtual token (token-major interleave)."""
    batch_size, seq_len = position_ids.shape
    virtual = torch.arange(seq_len * num_pseudo)
    token_index = virtual // num_pseudo
    pseudo_index = virtual % num_pseudo
    token_positions = position_ids[:, token_index]
    if position_mode == "virtual":
        rope_positions = token_positions * num_pseudo + pseudo_index
    else:
        rope_positions = token_positions
    return token_index, pseudo_index, rope_positions


def reference_mask(
    seq_len: int,
    num_pseudo: int,
    mask_mode: str,
    sliding_window: int | None,
    padding_mask: torch.Tensor | None,
    sequence_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [B or 1, N*P, N*P] mask: True where virtual query i may attend virtual key j."""
    virtual = torch.arange(seq_len * num_pseudo)
    query, key = virtual[:, None], virtual[None, :]
    query_token, key_token = query // num_pseudo, key // num_pseudo
    if mask_mode == "flat_causal":
        allowed = key <= query
    else:
        allowed = key_token <= query_token
    if sliding_window is not None:
        allowed = allowed & (key_token > query_token - sliding_window)
    allowed = allowed[None]
    if padding_mask is not None:
        key_is_real = padding_mask.bool()[:, virtual // num_pseudo]
        allowed = allowed & key_is_real[:, None, :]
    if sequence_ids is not None:
        virtual_ids = sequence_ids[:, virtual // num_pseudo]
        allowed = allowed & (virtual_ids[:, :, None] == virtual_ids[:, None, :])
    return allowed


def reference_attention(attn, hidden_states, position_ids, rotary, padding_mask=None, sequence_ids=None):
    """One attention layer of an IHA model (IHA or standard), straight from the definitions.

    `rotary` is the layer's RoPE as (inverse frequencies, cos/sin scaling), or None for a layer without RoPE.
    """
    config = attn.config
    batch_size, seq_len, _ = hidden_states.shape
    num_heads, num_kv, head_dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
    groups = num_heads // num_kv

    q = attn.q_proj(hidden_states).view(batch_size, seq_len, num_heads, head_dim)
    k = attn.k_proj(hidden_states).view(batch_size, seq_len, num_kv, head_dim)
    v = attn.v_proj(hidden_states).view(batch_size, seq_len, num_kv, head_dim).transpose(1, 2)
    if attn.q_norm is not None:  # per head, over head_dim, before anything mixes the heads
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)

    if attn.head_mixing is None:
        num_pseudo, position_mode, mask_mode = 1, "shared", "flat_causal"
        q_virtual, k_virtual, v_virtual = q, k, v
    else:
        mixing = attn.head_mixing
        num_pseudo, position_mode, mask_mode = mixing.num_pseudo_heads, config.iha_position_mode, config.iha_mask_mode
        # Q~[b, h, n, p] = sum_m alpha_q[m, h, p] Q[b, m, n]; then virtual index n * P + p.
        q_virtual = torch.einsum("bmnd,mhp->bhnpd", q, mixing.alpha_q).reshape(batch_size, num_heads, -1, head_dim)
        k_virtual = torch.einsum("bmnd,mhp->bhnpd", k, mixing.alpha_k).reshape(batch_size, num_kv, -1, head_dim)
        v_virtual = torch.einsum("bmnd,mhp->bhnpd", v, mixing.alpha_v).reshape(batch_size, num_kv, -1, head_dim)

    if rotary is not None:
        inv_freq, rope_scaling = rotary
        _, _, rope_positions = virtual_layout(position_ids, num_pseudo, position_mode)
        q_virtual = rope(q_virtual, rope_positions, inv_freq, rope_scaling)
        k_virtual = rope(k_virtual, rope_positions, inv_freq, rope_scaling)

    # Query head h reads KV head h // groups (GQA). Gemma 3 scales by its `query_pre_attn_scalar`, others by head_dim.
    k_per_head = k_virtual[:, torch.arange(num_heads) // groups]
    v_per_head = v_virtual[:, torch.arange(num_heads) // groups]
    scale_dim = getattr(config, "query_pre_attn_scalar", None) or head_dim
    scores = torch.einsum("bhid,bhjd->bhij", q_virtual, k_per_head) / scale_dim**0.5
    allowed = reference_mask(seq_len, num_pseudo, mask_mode, attn.sliding_window, padding_mask, sequence_ids)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully padded query rows
    out = torch.einsum("bhij,bhjd->bhid", weights, v_per_head)  # [B, H, N*P, d]

    if attn.head_mixing is not None:
        out = out.view(batch_size, num_heads, seq_len, num_pseudo, head_dim)
        if attn.head_mixing.collapse_mode == "per_head":
            out = torch.einsum("bhnpd,hp->bhnd", out, attn.head_mixing.collapse)
        else:
            out = torch.einsum("bmnpd,hmp->bhnd", out, attn.head_mixing.collapse)
    out = out.transpose(1, 2).reshape(batch_size, seq_len, num_heads * head_dim)
    return attn.o_proj(out)


def layer_rotary(model, layer_idx: int):
    """(inverse frequencies, cos/sin scaling) of one layer's RoPE, or None for a layer without RoPE.

    Gemma 3's rotary embedding keeps one set per layer type (`sliding_attention_inv_freq`, ...); Llama's one set.
    """
    if not model.model.layers[layer_idx].self_attn.use_rope:
        return None
    rotary = model.model.rotary_emb
    if hasattr(rotary, "inv_freq"):
        return rotary.inv_freq, rotary.attention_scaling
    layer_type = model.config.layer_types[layer_idx]
    return getattr(rotary, f"{layer_type}_inv_freq"), getattr(rotary, f"{layer_type}_attention_scaling")


def reference_forward(model, input_ids, attention_mask=None, position_ids=None, sequence_ids=None):
    """Logits of an IHAForCausalLM or IHAGemma3ForCausalLM computed with `reference_attention` in every layer."""
    batch_size, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len)[None].expand(batch_size, -1)
    hidden = model.model.embed_tokens(input_ids)  # Gemma 3's embedding multiplies by sqrt(hidden_size) itself
    for layer_idx, layer in enumerate(model.model.layers):

        def attention(normed, layer=layer, layer_idx=layer_idx):
            rotary = layer_rotary(model, layer_idx)
            return reference_attention(layer.self_attn, normed, position_ids, rotary, attention_mask, sequence_ids)

        if hasattr(layer, "pre_feedforward_layernorm"):
            # Gemma 3's block: attention and MLP outputs are normalised too before they join the residual stream.
            hidden = hidden + layer.post_attention_layernorm(attention(layer.input_layernorm(hidden)))
            hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        else:
            hidden = hidden + attention(layer.input_layernorm(hidden))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden))
