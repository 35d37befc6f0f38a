"""The paper's polynomial-filter claim: one IHA layer with H heads and P = H pseudo-heads computes a filter of order
k = H^2, [X, AX, A^2 X, ..., A^(k-1) X], that multi-head attention needs k heads for.

The task: N tokens on a graph with a fixed N x N matrix A; token n carries its position (one-hot) and features x_n
(d_x numbers); the output at token n is the filter [X, AX, A^2 X, A^3 X][n] (4 d_x numbers), here k = 4. One
bidirectional attention layer reads [e_n, x_n] and writes the output through its `o_proj`; nothing else (no residual,
norm or MLP).

Why MHA needs k heads: when the attention patterns read positions only, an MHA head computes M_h X W_h (a fixed
N x N pattern M_h, values and output projection W_h), so H heads compute a sum of H Kronecker products
sum_h W_h^T (x) M_h acting on X. The filter is sum_j E_j^T (x) A^j (E_j places block j of the output), whose
Kronecker rank is the number of linearly independent powers I, A, A^2, A^3: 4 for a generic A, so fewer than 4 such
heads cannot compute it.

Why 2 IHA heads with P = 2 can (`hand_set_iha_filter`): pseudo-query p of a head mixes in query head p and
pseudo-key q key head q, so the pattern between them is Q_p K_q^T. With Q_0 = I, Q_1 = A and K_0 = I, K_1 = (A^2)^T
(rows read off the one-hot positions), Q_p K_q^T = A^(p + 2q): the four powers 0..3 from two query and two key
heads. The attention of pseudo-query p sums over both pseudo-key streams, so the values keep them apart in
different coordinates (V_0 = [x, 0], V_1 = [0, x]); pseudo-query p then returns [A^p X, A^(p+2) X], head 0
collapses onto p = 0 and head 1 onto p = 1, and `o_proj` orders the blocks. With linear attention (weights = the
logits) this is exact for any A. With softmax it is exact up to e^-beta when A is a permutation (a directed cycle:
A^j X shifts the features by j) and the logits are scaled by a large beta: each pseudo-query's two matching keys
share the weight 1/2 (values doubled), every other key gets e^-beta of it.

The trained comparison (MHA with 2 and 4 heads against IHA with 2) is `iha.experiments.synthetic.polynomial`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...models.iha.modeling_iha import IHAHeadMixing


ATTENTION_KINDS = ("linear", "softmax")
FILTER_ORDER = 4


def filter_target(adjacency: torch.Tensor, features: torch.Tensor, order: int = FILTER_ORDER) -> torch.Tensor:
    """[X, AX, ..., A^(order-1) X] along the feature axis: features [B, N, d_x] -> [B, N, order * d_x]."""
    blocks, power = [features], features
    for _ in range(order - 1):
        power = adjacency @ power
        blocks.append(power)
    return torch.cat(blocks, dim=-1)


class FilterAttention(nn.Module):
    """One bidirectional attention layer over N tokens whose inputs are [one-hot position, features]: MHA, or IHA
    with `num_pseudo_heads` (the package's `IHAHeadMixing`, per-head collapse); linear or softmax attention."""

    def __init__(
        self,
        num_tokens: int,
        feature_size: int,
        num_heads: int,
        head_dim: int,
        output_size: int,
        num_pseudo_heads: int | None = None,
        attention: str = "linear",
    ):
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"Unknown attention {attention!r}: choose one of {ATTENTION_KINDS}.")
        self.num_tokens, self.num_heads, self.head_dim, self.attention = num_tokens, num_heads, head_dim, attention
        input_size = num_tokens + feature_size
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, output_size, bias=False)
        self.head_mixing = None
        if num_pseudo_heads is not None:
            self.head_mixing = IHAHeadMixing(num_heads, num_heads, num_pseudo_heads, collapse_mode="per_head")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch_size, num_tokens, _ = features.shape
        positions = torch.eye(num_tokens, dtype=features.dtype, device=features.device).expand(batch_size, -1, -1)
        inputs = torch.cat([positions, features], dim=-1)
        shape = (batch_size, num_tokens, self.num_heads, self.head_dim)
        query = self.q_proj(inputs).view(shape).transpose(1, 2)  # [B, H, N, d]
        key = self.k_proj(inputs).view(shape).transpose(1, 2)
        value = self.v_proj(inputs).view(shape).transpose(1, 2)
        if self.head_mixing is not None:
            query = self.head_mixing.mix_queries(query)  # [B, H, N * P, d], virtual index n * P + p
            key, value = self.head_mixing.mix_keys_values(key, value)
        logits = query @ key.transpose(-1, -2) / math.sqrt(self.head_dim)
        weights = logits if self.attention == "linear" else torch.softmax(logits, dim=-1)
        output = (weights @ value).transpose(1, 2)  # [B, N (* P), H, d]
        if self.head_mixing is not None:
            output = self.head_mixing.collapse_heads(output)  # [B, N, H, d]
        return self.o_proj(output.reshape(batch_size, num_tokens, -1))


def _set_position_rows(projection: torch.Tensor, head: int, head_dim: int, rows: torch.Tensor) -> None:
    """Make head `head` of a q/k projection map position n to rows[n] (an N x N matrix in its first N dims)."""
    size = rows.shape[0]
    projection[head * head_dim : head * head_dim + size, :size] = rows.T


def hand_set_iha_filter(adjacency: torch.Tensor, feature_size: int, head_dim: int, beta: float | None = None):
    """The 2-head, P = 2 IHA layer that computes [X, AX, A^2 X, A^3 X] (module docstring). `beta` None: linear
    attention (exact for any A); a number: softmax attention with logits scaled by beta (exact up to e^-beta for a
    permutation A). Returned in A's dtype."""
    num_tokens = adjacency.shape[0]
    if head_dim < max(num_tokens, 2 * feature_size):
        raise ValueError(f"head_dim must be >= max(N, 2 d_x) = {max(num_tokens, 2 * feature_size)}, got {head_dim}.")
    attention = "linear" if beta is None else "softmax"
    layer = FilterAttention(num_tokens, feature_size, 2, head_dim, FILTER_ORDER * feature_size, 2, attention)
    layer = layer.to(adjacency.dtype)
    scale = math.sqrt(head_dim) * (1.0 if beta is None else beta)  # undoes the 1/sqrt(d) of the logits
    identity = torch.eye(num_tokens, dtype=adjacency.dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        # Query head 0 reads I, head 1 A; key head 0 I, key head 1 (A^2)^T: Q_p K_q^T = A^(p + 2q).
        _set_position_rows(layer.q_proj.weight, 0, head_dim, scale * identity)
        _set_position_rows(layer.q_proj.weight, 1, head_dim, scale * adjacency)
        _set_position_rows(layer.k_proj.weight, 0, head_dim, identity)
        _set_position_rows(layer.k_proj.weight, 1, head_dim, (adjacency @ adjacency).T)
        # Value head 0 carries x in coordinates [0, d_x), value head 1 in [d_x, 2 d_x); doubled for softmax, which
        # splits each pseudo-query's weight evenly between its two matching keys.
        value_scale = 1.0 if beta is None else 2.0
        for head in (0, 1):
            rows = slice(head * head_dim + head * feature_size, head * head_dim + (head + 1) * feature_size)
            layer.v_proj.weight[rows, num_tokens:] = value_scale * torch.eye(feature_size, dtype=adjacency.dtype)
        mixing = layer.head_mixing
        for pseudo in (0, 1):  # pseudo-head p of every head takes source head p, for queries, keys and values
            mixing.alpha_q[pseudo, :, pseudo] = 1.0
            mixing.alpha_k[pseudo, :, pseudo] = 1.0
            mixing.alpha_v[pseudo, :, pseudo] = 1.0
        mixing.collapse[0, 0] = 1.0  # head 0: [X, A^2 X]
        mixing.collapse[1, 1] = 1.0  # head 1: [A X, A^3 X]
        # o_proj orders the blocks: A^j X sits in head j % 2, coordinates (j // 2) * d_x.
        eye = torch.eye(feature_size, dtype=adjacency.dtype)
        for power in range(FILTER_ORDER):
            source = (power % 2) * head_dim + (power // 2) * feature_size
            layer.o_proj.weight[power * feature_size : (power + 1) * feature_size, source : source + feature_size] = eye
    return layer


def hand_set_mha_filter(adjacency: torch.Tensor, feature_size: int, head_dim: int, beta: float | None = None):
    """The 4-head MHA layer that computes the same filter: head j's pattern is A^j (linear attention; softmax with
    logits beta A^j, exact up to e^-beta for a permutation A)."""
    num_tokens = adjacency.shape[0]
    attention = "linear" if beta is None else "softmax"
    layer = FilterAttention(
        num_tokens, feature_size, FILTER_ORDER, head_dim, FILTER_ORDER * feature_size, None, attention
    )
    layer = layer.to(adjacency.dtype)
    scale = math.sqrt(head_dim) * (1.0 if beta is None else beta)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        power = torch.eye(num_tokens, dtype=adjacency.dtype)
        for head in range(FILTER_ORDER):
            _set_position_rows(layer.q_proj.weight, head, head_dim, scale * power)
            _set_position_rows(layer.k_proj.weight, head, head_dim, torch.eye(num_tokens, dtype=adjacency.dtype))
            start = head * head_dim
            eye = torch.eye(feature_size, dtype=adjacency.dtype)
            layer.v_proj.weight[start : start + feature_size, num_tokens:] = eye
            layer.o_proj.weight[head * feature_size : (head + 1) * feature_size, start : start + feature_size] = eye
            power = power @ adjacency
    return layer


def _power_singular_values(adjacency: torch.Tensor, order: int) -> torch.Tensor:
    """Singular values of the powers I, A, ..., A^(order-1) stacked as vectors: those of the filter's operator
    rearranged so that Kronecker products become rank-1 terms (the output blocks E_j are orthogonal, of equal norm)."""
    powers, power = [], torch.eye(adjacency.shape[0], dtype=adjacency.dtype)
    for _ in range(order):
        powers.append(power.flatten())
        power = power @ adjacency
    return torch.linalg.svdvals(torch.stack(powers))


def kronecker_rank(adjacency: torch.Tensor, order: int = FILTER_ORDER, tolerance: float = 1e-9) -> int:
    """The number of linearly independent powers I, A, ..., A^(order-1): the Kronecker rank of the filter, the
    fewest MHA heads with position-only patterns that compute it (module docstring)."""
    singular_values = _power_singular_values(adjacency, order)
    return int((singular_values > tolerance * singular_values[0]).sum())


def mha_error_floor(adjacency: torch.Tensor, num_heads: int, order: int = FILTER_ORDER) -> float:
    """The smallest relative error ||Y_hat - Y|| / ||Y|| (on average over Gaussian features, where it equals the
    operators' relative Frobenius distance) of `num_heads` MHA heads whose patterns read positions only: the best
    sum of `num_heads` Kronecker products (Eckart-Young on the rearranged operator)."""
    squares = _power_singular_values(adjacency, order).pow(2)
    return (squares[num_heads:].sum() / squares.sum()).sqrt().item()
