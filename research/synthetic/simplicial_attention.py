"""2-simplicial attention (Roy et al. 2025): one query attends pairs of keys, scored by a trilinear form.

For head h with query q_i, two keys k_j, k'_k and two values v_j, v'_k (five projections of the input, plus the
output projection):

    score[i, j, k] = sum_d q_i[d] * k_j[d] * k'_k[d] / sqrt(d_head)
    weight[i, :, :] = softmax over all pairs (j, k) of score[i, :, :]
    out_i = sum_{j, k} weight[i, j, k] * (v_j * v'_k)        (elementwise product of the two values)

This is the bidirectional, full (unwindowed) form: every query sees every pair of real keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def two_simplicial_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    second_key: torch.Tensor,
    value: torch.Tensor,
    second_value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, H, Nq, d], keys and values [B, H, N, d], key_padding_mask [B, N] (True = real token) -> [B, H, Nq, d].

    The trilinear score is a dot product with a pair key, q_i . (k_j * k'_k), and the output a softmax-weighted sum
    of pair values v_j * v'_k: plain softmax attention over the N^2 pairs, so the fused SDPA kernel runs it without
    materialising the [Nq, N, N] weights (which are what makes the naive form slow and large).
    """
    batch_size, num_heads, num_keys, head_dim = key.shape
    pair_keys = (key[:, :, :, None, :] * second_key[:, :, None, :, :]).reshape(batch_size, num_heads, -1, head_dim)
    pair_values = (value[:, :, :, None, :] * second_value[:, :, None, :, :]).reshape(
        batch_size, num_heads, -1, head_dim
    )
    attention_mask = None
    if key_padding_mask is not None:
        pair_is_real = key_padding_mask[:, :, None] & key_padding_mask[:, None, :]  # [B, N (j), N (k)]
        attention_mask = pair_is_real.reshape(batch_size, 1, 1, num_keys * num_keys)
    return F.scaled_dot_product_attention(query, pair_keys, pair_values, attn_mask=attention_mask)


class TwoSimplicialAttention(nn.Module):
    """Bidirectional 2-simplicial attention with H heads; the drop-in peer of the synthetic model's attention."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"`hidden_size` ({hidden_size}) must be a multiple of `num_heads` ({num_heads}).")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        # After q/k/v/o, so that a model seeded like an MHA one draws the same four projections.
        self.second_k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.second_v_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        query, key, second_key, value, second_value = (
            projection(hidden_states).view(shape).transpose(1, 2)
            for projection in (self.q_proj, self.k_proj, self.second_k_proj, self.v_proj, self.second_v_proj)
        )
        output = two_simplicial_attention(query, key, second_key, value, second_value, key_padding_mask)
        return self.o_proj(output.transpose(1, 2).reshape(batch_size, seq_len, -1))
