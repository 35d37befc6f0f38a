"""A prefix-count task of our own, order-sensitive: one hard-attention IHA layer with ceil(sqrt(N_max)) heads (P = H)
solves it exactly where multi-head attention with position-only patterns needs N_max heads.

The paper states this separation for a task it calls CPM-3. This is not that task, and it is named CPM-3 in the code
only for history. The paper's CPM-3 counts, at each position i, the ordered pairs (j1, j2) with
x_i + G x_j1 + x_j2 = 0 (mod M), G > 2M (so the predicate is order-sensitive); its construction is a cyclic-permutation
"workspace" (every position ends up holding all symbols in cyclic order: N_max MHA heads, or ceil(sqrt(N_max)) IHA
heads with P = H and hard attention: the polynomial filter of `constructions` with A the cyclic permutation)
followed by an MLP that enumerates the pairs. That MLP readout is not built or tested here.

**The prefix-count task ("CPM-3" in the code).** The input is a sequence of
n <= N_max symbols s_0 .. s_(n-1) from {0, 1, 2}, written into slots 0 .. n-1 of N_max slots (slots n .. N_max-1
empty), followed by one readout token. The answer, at the readout token, is the N_max x 3 table of prefix counts

    c[j, s] = #{i <= j : s_i = s}        (j = 0 .. N_max-1; an empty slot counts nothing),

flattened slot-major (`cpm_target`). It is order-sensitive: the table determines the sequence (s_j is the symbol
whose count rises at j), while the counts of the whole sequence, all that one head attending evenly to every slot
reads, do not ((0, 1) and (1, 0) share them). The same definition holds for any alphabet (`num_symbols`).

The layer is `FilterAttention` (one bidirectional attention layer over [one-hot position, features], nothing after
`o_proj`) with hard attention: each query's weight shared evenly among its keys of the largest logit (the limit of
softmax as its logits are scaled up). A token's features are its symbol one-hot (zero for an empty slot and the
readout).

N_max MHA heads (`hand_set_mha_cpm`): head j attends to slots 0 .. j (every one a logit of 1, the rest 0), so it
returns c[j, :] / (j + 1), and `o_proj` multiplies by j + 1.

ceil(sqrt(N_max)) IHA heads (`hand_set_iha_cpm`): as in the polynomial filter
(`constructions`), pseudo-query p of a head takes query head p and pseudo-key stream q key
head q, so their pattern is Q_p K_q^T. Let H = ceil(sqrt(N_max)); query head p at the readout is sum_{t <= p} e_t + e_H,
and key head q at slot i is e_(i - H q) when 0 <= i - H q < H, e_H when i < H q, else 0: Q_p K_q^T = [i <= p + H q], a
prefix of slots, for each of the H^2 >= N_max thresholds p + H q. Pseudo-query p attends evenly to all its matches over
the H streams (stream q's prefix holds min(p + H q + 1, N_max) slots); value stream q holds the symbol one-hot in its
own coordinates [3 q, 3 q + 3), so stream q's block receives the counts of prefix p + H q divided by the (fixed) number
of matches. Head h keeps pseudo-query h, and `o_proj` rescales and orders the blocks (threshold j = h + H q), dropping
thresholds >= N_max. Exact in float64.

Why MHA needs N_max heads (the bound `cpm_kronecker_rank` measures): when the patterns at the readout read positions
only (any weights, so also softmax or hard attention) and the answer is read from `o_proj`, H MHA heads' readout
output is c_0 + sum_h W_h (sum_i m_h[i] x_i) for the slots' one-hots x_i, head h's pattern m_h and values-and-output
W_h: an affine map of the stacked one-hots whose linear part is a sum of H Kronecker products m_h^T (x) W_h. The
differences of CPM-3 inputs span every (slot, symbol) direction (`("a", "b") - ("a",)` is symbol b in slot 1), so a
layer exact on every input has the target's linear part, sum_i e_i^T (x) B_i (B_i puts slot i's one-hot into the
blocks j >= i), whose Kronecker rank is N_max (the B_i are linearly independent): fewer than N_max such heads
cannot. The bound says nothing about heads whose patterns read the symbols, or about a nonlinear readout (an MLP)
after the layer; and "hard attention" here is averaging hard attention (tied keys share the weight): with an argmax
that keeps one key per query, each pseudo-query reads one slot and this construction does not apply.
"""

from __future__ import annotations

import math
from itertools import product

import torch

from .constructions import HARD_ATTENTION, FilterAttention, iha_heads_for_order


NUM_SYMBOLS = 3  # the "3" of CPM-3 as defined here
EMPTY = -1  # an empty slot


def all_sequences(max_length: int, num_symbols: int = NUM_SYMBOLS) -> torch.Tensor:
    """Every sequence of 0 .. `max_length` symbols, as slots [count, N_max] (EMPTY after the sequence)."""
    rows = []
    for length in range(max_length + 1):
        for sequence in product(range(num_symbols), repeat=length):
            rows.append([*sequence, *[EMPTY] * (max_length - length)])
    return torch.tensor(rows, dtype=torch.long)


def random_sequences(
    count: int, max_length: int, generator: torch.Generator, num_symbols: int = NUM_SYMBOLS
) -> torch.Tensor:
    """`count` sequences of uniformly drawn lengths 0 .. `max_length` and symbols, as slots [count, N_max]."""
    symbols = torch.randint(num_symbols, (count, max_length), generator=generator)
    lengths = torch.randint(max_length + 1, (count, 1), generator=generator)
    return torch.where(torch.arange(max_length) < lengths, symbols, EMPTY)


def symbol_one_hots(slots: torch.Tensor, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> torch.Tensor:
    """[B, N_max] slots -> [B, N_max, num_symbols] one-hots (zero for an empty slot)."""
    filled = slots != EMPTY
    one_hots = torch.nn.functional.one_hot(slots.clamp(min=0), num_symbols).to(dtype)
    return one_hots * filled.unsqueeze(-1).to(dtype)


def cpm_target(slots: torch.Tensor, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> torch.Tensor:
    """The prefix counts c[j, s] = #{i <= j : s_i = s}, flattened slot-major: [B, N_max] -> [B, N_max * num_symbols]."""
    return symbol_one_hots(slots, num_symbols, dtype).cumsum(dim=1).flatten(1)


def cpm_inputs(slots: torch.Tensor, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> torch.Tensor:
    """The layer's features: the slots' symbol one-hots, then the readout token's (zero) -> [B, N_max + 1, M]."""
    one_hots = symbol_one_hots(slots, num_symbols, dtype)
    return torch.cat([one_hots, one_hots.new_zeros(one_hots.shape[0], 1, num_symbols)], dim=1)


def cpm_readout(layer: FilterAttention, slots: torch.Tensor, num_symbols: int = NUM_SYMBOLS) -> torch.Tensor:
    """The layer's answer: its output at the readout token (the last one)."""
    dtype = next(layer.parameters()).dtype
    return layer(cpm_inputs(slots, num_symbols, dtype))[:, -1]


def _set_head_column(projection: torch.Tensor, head: int, head_dim: int, token: int, vector: torch.Tensor) -> None:
    """Make head `head` of a q/k/v projection map the one-hot position `token` to `vector`."""
    projection[head * head_dim : head * head_dim + vector.shape[0], token] = vector


def hand_set_mha_cpm(max_length: int, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> FilterAttention:
    """N_max hard-attention MHA heads that answer CPM-3 exactly: head j attends to slots 0 .. j (module docstring)."""
    num_tokens, head_dim = max_length + 1, num_symbols
    layer = FilterAttention(
        num_tokens, num_symbols, max_length, head_dim, max_length * num_symbols, None, HARD_ATTENTION
    ).to(dtype)
    readout = max_length
    match = torch.zeros(head_dim, dtype=dtype)
    match[0] = 1.0
    eye = torch.eye(num_symbols, dtype=dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        for head in range(max_length):
            _set_head_column(layer.q_proj.weight, head, head_dim, readout, math.sqrt(head_dim) * match)
            for slot in range(head + 1):
                _set_head_column(layer.k_proj.weight, head, head_dim, slot, match)
            start = head * head_dim
            layer.v_proj.weight[start : start + num_symbols, num_tokens:] = eye
            rows = slice(head * num_symbols, (head + 1) * num_symbols)
            layer.o_proj.weight[rows, start : start + num_symbols] = (head + 1) * eye
    return layer


def hand_set_iha_cpm(max_length: int, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> FilterAttention:
    """ceil(sqrt(N_max)) hard-attention IHA heads with P = H that answer CPM-3 exactly: pseudo-query p against
    pseudo-key stream q matches the prefix of slots 0 .. p + H q (module docstring)."""
    num_heads = iha_heads_for_order(max_length)
    num_tokens, head_dim = max_length + 1, max(num_heads + 1, num_heads * num_symbols)
    layer = FilterAttention(
        num_tokens, num_symbols, num_heads, head_dim, max_length * num_symbols, num_heads, HARD_ATTENTION
    ).to(dtype)
    readout, always = max_length, num_heads  # coordinate H of the queries and keys matches every slot it is set in
    basis = torch.eye(head_dim, dtype=dtype)
    eye = torch.eye(num_symbols, dtype=dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.zero_()
        for head in range(num_heads):
            # Query head p at the readout: e_0 + ... + e_p + e_H.
            query = basis[: head + 1].sum(dim=0) + basis[always]
            _set_head_column(layer.q_proj.weight, head, head_dim, readout, math.sqrt(head_dim) * query)
            # Key head q at slot i: e_(i - H q) in 0 .. H-1, e_H before that, nothing after: [i <= p + H q].
            for slot in range(max_length):
                offset = slot - num_heads * head
                if offset < 0:
                    _set_head_column(layer.k_proj.weight, head, head_dim, slot, basis[always])
                elif offset < num_heads:
                    _set_head_column(layer.k_proj.weight, head, head_dim, slot, basis[offset])
            # Value head q carries the symbol one-hot in coordinates [M q, M (q + 1)).
            start = head * head_dim + head * num_symbols
            layer.v_proj.weight[start : start + num_symbols, num_tokens:] = eye
        mixing = layer.head_mixing
        for pseudo in range(num_heads):  # pseudo-head p of every head takes source head p (queries, keys, values)
            mixing.alpha_q[pseudo, :, pseudo] = 1.0
            mixing.alpha_k[pseudo, :, pseudo] = 1.0
            mixing.alpha_v[pseudo, :, pseudo] = 1.0
        for head in range(num_heads):
            mixing.collapse[head, head] = 1.0  # head h keeps pseudo-query h: thresholds h, h + H, ..., h + H (H-1)
            # Pseudo-query h's weight is shared among every slot of its H prefixes.
            matches = sum(min(head + num_heads * stream + 1, max_length) for stream in range(num_heads))
            for stream in range(num_heads):
                threshold = head + num_heads * stream
                if threshold >= max_length:
                    continue
                source = head * head_dim + stream * num_symbols
                rows = slice(threshold * num_symbols, (threshold + 1) * num_symbols)
                layer.o_proj.weight[rows, source : source + num_symbols] = matches * eye
    return layer


def cpm_operator(max_length: int, num_symbols: int = NUM_SYMBOLS, dtype=torch.float64) -> torch.Tensor:
    """CPM-3's answer as a linear map of the stacked slot one-hots: [N_max M (out), N_max M (in, slot-major)]."""
    blocks = torch.tril(torch.ones(max_length, max_length, dtype=dtype))  # output block j reads slots i <= j
    return torch.kron(blocks, torch.eye(num_symbols, dtype=dtype))


def slot_kronecker_factors(operator: torch.Tensor, num_slots: int) -> torch.Tensor:
    """A linear map of stacked slots [out, num_slots * M] rearranged to [num_slots, out * M]: row i is what the map
    does to slot i, so a head with a position-only pattern (m^T (x) W) adds a rank-1 matrix m vec(W)^T."""
    out_size, in_size = operator.shape
    per_slot = operator.reshape(out_size, num_slots, in_size // num_slots)
    return per_slot.permute(1, 0, 2).reshape(num_slots, -1)


def cpm_kronecker_rank(max_length: int, num_symbols: int = NUM_SYMBOLS, tolerance: float = 1e-9) -> int:
    """The Kronecker rank of CPM-3's answer over slots: the fewest MHA heads with position-only patterns whose
    affine readout output can equal it on every input (module docstring)."""
    singular_values = torch.linalg.svdvals(slot_kronecker_factors(cpm_operator(max_length, num_symbols), max_length))
    return int((singular_values > tolerance * singular_values[0]).sum())
