"""The head mixing folded into the projections, at load time.

An IHA layer computes `Q~[n, h, p] = sum_m alpha_q[m, h, p] * Q[n, m]` with `Q = x @ W_q.T + b_q`: a linear map of
a linear map, so one projection with P times the rows computes it directly (likewise K~, V~), and the collapse
`o[n, h] = sum_(m, p) R[h, m, p] * o~[n, m, p]` folds into the columns of `o_proj`. The folded layer runs no mixing
at all: its projections are ordinary vLLM linear layers whose heads are P * d wide.

The folded rows come head-major, `(h, p, d)`, so that vLLM's tensor parallelism, which shards projections by whole
heads, gives each rank whole pseudo-head groups: every folded row is a complete function of the (replicated) hidden
state, so sharding it is exact. The attention reads pseudo-major rows, `(p, h, d)` (pseudo-token (n, p) is row
n * P + p of the interleaved sequence): `head_major_to_pseudo_major` reorders each rank's shard after loading.

Pure torch: tested against the model's own mixing in any environment (`tests/serving/vllm_plugin/test_vllm_folding.py`).
"""

import torch


def fold_mixing_into_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`q_proj` (or `k_proj`, `v_proj`) followed by the mixing `alpha` [M, H, P], as one projection.

    weight [M * d, hidden] -> [H * P * d, hidden] (rows head-major, `(h, p, d)`); bias [M * d] -> [H * P * d].
    Computed in float64: the caller rounds once, to the model's dtype.
    """
    num_sources, num_targets, num_pseudo_heads = alpha.shape
    alpha = alpha.double()
    source_rows = weight.double().view(num_sources, head_dim, -1)
    folded = torch.einsum("mhp,mdk->hpdk", alpha, source_rows).reshape(num_targets * num_pseudo_heads * head_dim, -1)
    folded_bias = None
    if bias is not None:
        folded_bias = torch.einsum("mhp,md->hpd", alpha, bias.double().view(num_sources, head_dim)).reshape(-1)
    return folded, folded_bias


def fold_collapse_into_output(weight: torch.Tensor, collapse: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The collapse followed by `o_proj`, as one output projection over the H * P pseudo-outputs.

    weight [hidden, H * d]; collapse [H, P] (per head: head h reads its own P pseudo-outputs) or [H, H, P] (global:
    target head, source head, pseudo index) -> [hidden, H * P * d] (columns head-major, `(m, p, d)` for source head m).
    """
    hidden_size = weight.shape[0]
    output_columns = weight.double().view(hidden_size, -1, head_dim)  # [hidden, H, d]
    collapse = collapse.double()
    if collapse.dim() == 2:
        folded = torch.einsum("khd,hp->khpd", output_columns, collapse)
    else:
        folded = torch.einsum("khd,hmp->kmpd", output_columns, collapse)
    return folded.reshape(hidden_size, -1)


def head_major_to_pseudo_major(tensor: torch.Tensor, dim: int, num_heads: int, num_pseudo_heads: int) -> torch.Tensor:
    """Reorder `dim` of size H * P * d from `(h, p, d)` to `(p, h, d)`: a contiguous copy."""
    dim = dim % tensor.dim()
    grouped = tensor.unflatten(dim, (num_heads, num_pseudo_heads, -1))
    return grouped.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()
