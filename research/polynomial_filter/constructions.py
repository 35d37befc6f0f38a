"""The paper's polynomial-filter claim: one IHA layer with H heads and P = H pseudo-heads computes a filter of order
k = H^2, [X, AX, A^2 X, ..., A^(k-1) X], that multi-head attention needs k heads for; any order k takes
ceil(sqrt(k)) IHA heads.

The task: N tokens on a graph with a fixed N x N matrix A; token n carries its position (one-hot) and features x_n
(d_x numbers); the output at token n is the filter [X, AX, ..., A^(k-1) X][n] (k d_x numbers). One bidirectional
attention layer reads [e_n, x_n] and writes the output through its `o_proj`; nothing else (no residual, norm or MLP).

Why MHA needs k heads: when the attention patterns read positions only, an MHA head computes M_h X W_h (a fixed
N x N pattern M_h, values and output projection W_h), so H heads compute a sum of H Kronecker products
sum_h W_h^T (x) M_h acting on X. The filter is sum_j E_j^T (x) A^j (E_j places block j of the output), whose
Kronecker rank is the number of linearly independent powers I, A, ..., A^(k-1): k for a generic A when N >= k (a
matrix's powers beyond its minimal polynomial's degree, at most N, depend on the lower ones), so fewer than k such
heads cannot compute it. `mha_error_floor` is how close the best H of them get. The bound says nothing about heads
whose patterns also read the features.

Why H = ceil(sqrt(k)) IHA heads with P = H can (`hand_set_iha_filter`): pseudo-query p of a head mixes in query
head p and pseudo-key q key head q, so the pattern between them is Q_p K_q^T. With Q_p = A^p and K_q = (A^(H q))^T
(rows read off the one-hot positions), Q_p K_q^T = A^(p + H q): every power 0 .. H^2 - 1 from H query and H key
heads. The attention of pseudo-query p sums over the H pseudo-key streams, so the values keep them apart in different
coordinates (V_q holds x in block q); pseudo-query p then returns [A^p X, A^(p+H) X, ..., A^(p+H(H-1)) X], head h
collapses onto p = h, and `o_proj` orders the blocks (and drops powers >= k when k < H^2). For k = 4 this is H = 2
with Q_1 = A, K_1 = (A^2)^T. With linear attention (weights = the logits) this is exact for any A. With softmax it
is exact up to e^-beta when A is a permutation (a directed cycle: A^j X shifts the features by j) and the logits are
scaled by a large beta: each pseudo-query's H matching keys share the weight 1/H (values multiplied by H), every
other key gets e^-beta of it; with hard attention (the beta -> infinity limit) it is exact.

The trained comparisons (k = 4: MHA with 2 and 4 heads against IHA with 2; k = 9: MHA with 3 and 9 against IHA with
3) are `experiment` (this folder); the order-sensitive counting task is `cpm`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from iha.models.iha.modeling_iha import IHAHeadMixing


ATTENTION_KINDS = ("linear", "softmax")  # the kinds the trained comparison trains
# Hard attention (every query's weight shared evenly among its keys of the largest logit, none elsewhere): the limit
# of softmax as the logits are scaled up, for the exact constructions; nothing trains through it.
HARD_ATTENTION = "hard"
CONSTRUCTION_KINDS = (*ATTENTION_KINDS, HARD_ATTENTION)
FILTER_ORDER = 4


def iha_heads_for_order(order: int) -> int:
    """ceil(sqrt(order)): the IHA heads (P = H) whose H^2 pseudo-query x pseudo-key patterns cover `order` powers."""
    if order < 1:
        raise ValueError(f"The filter order must be >= 1, got {order}.")
    return math.isqrt(order - 1) + 1


def filter_target(adjacency: torch.Tensor, features: torch.Tensor, order: int = FILTER_ORDER) -> torch.Tensor:
    """[X, AX, ..., A^(order-1) X] along the feature axis: features [B, N, d_x] -> [B, N, order * d_x]."""
    blocks, power = [features], features
    for _ in range(order - 1):
        power = adjacency @ power
        blocks.append(power)
    return torch.cat(blocks, dim=-1)


def hard_attention_weights(logits: torch.Tensor, tolerance: float = 1e-9) -> torch.Tensor:
    """Each query's weight shared evenly among the keys whose logit is its largest (within `tolerance` of it,
    relative to its size: rounding in the logits must not split a tie), zero elsewhere."""
    largest = logits.amax(dim=-1, keepdim=True)
    chosen = (logits >= largest - tolerance * largest.abs().clamp(min=1.0)).to(logits.dtype)
    return chosen / chosen.sum(dim=-1, keepdim=True)


class FilterAttention(nn.Module):
    """One bidirectional attention layer over N tokens whose inputs are [one-hot position, features]: MHA, or IHA
    with `num_pseudo_heads` (the package's `IHAHeadMixing`, per-head collapse); linear, softmax or hard attention."""

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
        if attention not in CONSTRUCTION_KINDS:
            raise ValueError(f"Unknown attention {attention!r}: choose one of {CONSTRUCTION_KINDS}.")
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
        if self.attention == "linear":
            weights = logits
        elif self.attention == "softmax":
            weights = torch.softmax(logits, dim=-1)
        else:
            weights = hard_attention_weights(logits)
        output = (weights @ value).transpose(1, 2)  # [B, N (* P), H, d]
        if self.head_mixing is not None:
            output = self.head_mixing.collapse_heads(output)  # [B, N, H, d]
        return self.o_proj(output.reshape(batch_size, num_tokens, -1))


def _set_position_rows(projection: torch.Tensor, head: int, head_dim: int, rows: torch.Tensor) -> None:
    """Make head `head` of a q/k projection map position n to rows[n] (an N x N matrix in its first N dims)."""
    size = rows.shape[0]
    projection[head * head_dim : head * head_dim + size, :size] = rows.T


def _logit_scale(head_dim: int, attention: str, beta: float) -> float:
    """What the queries are multiplied by so that a matching query-key pair has logit 1 (linear, hard) or beta
    (softmax): undoes the layer's 1/sqrt(d)."""
    return math.sqrt(head_dim) * (beta if attention == "softmax" else 1.0)


def hand_set_iha_filter(
    adjacency: torch.Tensor,
    feature_size: int,
    head_dim: int,
    attention: str = "linear",
    beta: float = 60.0,
    order: int = FILTER_ORDER,
):
    """The IHA layer with H = ceil(sqrt(order)) heads and P = H that computes [X, AX, ..., A^(order-1) X]
    (module docstring): query head p reads A^p, key head q (A^(H q))^T, so pseudo-query p against pseudo-key stream
    q has the pattern A^(p + H q). Linear attention: exact for any A. Softmax (logits scaled by `beta`) and hard
    attention: for a permutation A, where each pseudo-query's H matching keys (one per stream) share its weight;
    softmax is exact up to e^-beta, hard attention exactly. Returned in A's dtype."""
    num_tokens = adjacency.shape[0]
    num_heads = iha_heads_for_order(order)
    if head_dim < max(num_tokens, num_heads * feature_size):
        needed = max(num_tokens, num_heads * feature_size)
        raise ValueError(f"head_dim must be >= max(N, H d_x) = {needed} for order {order}, got {head_dim}.")
    layer = FilterAttention(
        num_tokens, feature_size, num_heads, head_dim, order * feature_size, num_heads, attention
    ).to(adjacency.dtype)
    scale = _logit_scale(head_dim, attention, beta)
    identity = torch.eye(num_tokens, dtype=adjacency.dtype)
    eye = torch.eye(feature_size, dtype=adjacency.dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        # Query head p reads A^p, key head q (A^(H q))^T: Q_p K_q^T = A^(p + H q), every power 0 .. H^2 - 1.
        stride = torch.linalg.matrix_power(adjacency, num_heads)
        query_rows, key_rows = identity, identity
        for head in range(num_heads):
            _set_position_rows(layer.q_proj.weight, head, head_dim, scale * query_rows)
            _set_position_rows(layer.k_proj.weight, head, head_dim, key_rows.T)
            query_rows, key_rows = query_rows @ adjacency, key_rows @ stride
        # Value head q carries x in coordinates [q d_x, (q + 1) d_x): the H streams a pseudo-query sums over stay
        # apart. Softmax and hard attention share each pseudo-query's weight among its H matching keys: values x H.
        value_scale = 1.0 if attention == "linear" else float(num_heads)
        for head in range(num_heads):
            start = head * head_dim + head * feature_size
            layer.v_proj.weight[start : start + feature_size, num_tokens:] = value_scale * eye
        mixing = layer.head_mixing
        for pseudo in range(num_heads):  # pseudo-head p of every head takes source head p (queries, keys, values)
            mixing.alpha_q[pseudo, :, pseudo] = 1.0
            mixing.alpha_k[pseudo, :, pseudo] = 1.0
            mixing.alpha_v[pseudo, :, pseudo] = 1.0
        for head in range(num_heads):  # head h keeps pseudo-query h: [A^h X, A^(h + H) X, ..., A^(h + H (H-1)) X]
            mixing.collapse[head, head] = 1.0
        # o_proj orders the blocks: A^j X sits in head j % H, coordinates (j // H) d_x; powers >= order are dropped.
        for power in range(order):
            source = (power % num_heads) * head_dim + (power // num_heads) * feature_size
            layer.o_proj.weight[power * feature_size : (power + 1) * feature_size, source : source + feature_size] = eye
    return layer


def hand_set_mha_filter(
    adjacency: torch.Tensor,
    feature_size: int,
    head_dim: int,
    attention: str = "linear",
    beta: float = 60.0,
    order: int = FILTER_ORDER,
):
    """The MHA layer with `order` heads that computes the same filter: head j's pattern is A^j (linear attention;
    softmax with logits beta A^j, exact up to e^-beta, and hard attention, exact, for a permutation A)."""
    num_tokens = adjacency.shape[0]
    layer = FilterAttention(num_tokens, feature_size, order, head_dim, order * feature_size, None, attention)
    layer = layer.to(adjacency.dtype)
    scale = _logit_scale(head_dim, attention, beta)
    identity = torch.eye(num_tokens, dtype=adjacency.dtype)
    eye = torch.eye(feature_size, dtype=adjacency.dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        power = identity
        for head in range(order):
            _set_position_rows(layer.q_proj.weight, head, head_dim, scale * power)
            _set_position_rows(layer.k_proj.weight, head, head_dim, identity)
            start = head * head_dim
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
