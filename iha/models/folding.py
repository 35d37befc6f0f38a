"""The head mixing folded into the projections: what the P = 1 Llama export writes and the vLLM plugin loads.

An IHA layer computes `Q~[n, h, p] = sum_m alpha_q[m, h, p] * Q[n, m]` with `Q = x @ W_q.T + b_q`: a linear map of
a linear map, so one projection with P times the rows computes it directly (likewise K~, V~), and the collapse
`o[n, h] = sum_(m, p) R[h, m, p] * o~[n, m, p]` folds into the columns of `o_proj`. The folded layer runs no mixing
at all. The matrices are the model's own (`iha.models.iha.mixing_iha`).

The folded rows come head-major, `(h, p, d)`, so that vLLM's tensor parallelism, which shards projections by whole
heads, gives each rank whole pseudo-head groups: every folded row is a complete function of the (replicated) hidden
state, so sharding it is exact. The attention reads pseudo-major rows, `(p, h, d)` (pseudo-token (n, p) is row
n * P + p of the interleaved sequence): `head_major_to_pseudo_major` reorders each rank's shard after loading.
Computed in float64; the caller rounds once, to the model's dtype.
"""

import torch

from .iha.mixing_iha import collapse_matrix, mixing_matrix


def pseudo_major_to_head_major(tensor: torch.Tensor, dim: int, num_heads: int, num_pseudo_heads: int) -> torch.Tensor:
    """Reorder `dim` of size P * H * d from `(p, h, d)` to `(h, p, d)`: a contiguous copy."""
    dim = dim % tensor.dim()
    grouped = tensor.unflatten(dim, (num_pseudo_heads, num_heads, -1))
    return grouped.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def head_major_to_pseudo_major(tensor: torch.Tensor, dim: int, num_heads: int, num_pseudo_heads: int) -> torch.Tensor:
    """Reorder `dim` of size H * P * d from `(h, p, d)` to `(p, h, d)`: a contiguous copy."""
    dim = dim % tensor.dim()
    grouped = tensor.unflatten(dim, (num_heads, num_pseudo_heads, -1))
    return grouped.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def fold_mixing_into_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`q_proj` (or `k_proj`, `v_proj`) followed by the mixing `alpha` [M, H, P], as one projection.

    weight [M * d, hidden] -> [H * P * d, hidden] (rows head-major); bias [M * d] -> [H * P * d].
    """
    num_sources, num_targets, num_pseudo_heads = alpha.shape
    mixing = mixing_matrix(alpha.double())  # [P * H, M]
    source_rows = weight.double().view(num_sources, -1)  # [M, d * hidden]
    folded = (mixing @ source_rows).view(-1, weight.shape[-1])  # rows (p, h, d)
    folded = pseudo_major_to_head_major(folded, 0, num_targets, num_pseudo_heads)
    if bias is None:
        return folded, None
    folded_bias = (mixing @ bias.double().view(num_sources, head_dim)).flatten()
    return folded, pseudo_major_to_head_major(folded_bias, 0, num_targets, num_pseudo_heads)


def fold_collapse_into_output(weight: torch.Tensor, collapse: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The collapse R ([H, P] or [H, H, P]) followed by `o_proj` [hidden, H * d], as one output projection over the
    H * P pseudo-outputs: [hidden, H * P * d], columns head-major (`(m, p, d)` for source head m)."""
    hidden_size = weight.shape[0]
    num_heads, num_pseudo_heads = collapse.shape[0], collapse.shape[-1]
    output_columns = weight.double().view(hidden_size, num_heads, head_dim)  # [hidden, H, d]
    # out = W_o[:, h] @ sum_(p, m) R[h, m, p] o~[p, m]: column (p, m) of the folded weight is sum_h W_o[:, h] R[h, (p, m)]
    folded = torch.einsum("khd,hc->kcd", output_columns, collapse_matrix(collapse.double()))  # [hidden, P * H, d]
    return pseudo_major_to_head_major(folded.reshape(hidden_size, -1), 1, num_heads, num_pseudo_heads)
