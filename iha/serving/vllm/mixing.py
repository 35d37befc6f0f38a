"""The explicit head mixing of IHA layers whose mixing does not fold into the projections (`support.folds_mixing`:
Qwen3's per-head q/k norm, or `hf_overrides={"iha_fold_mixing": False}`)."""

import torch
from torch import nn

from ...models.iha.mixing_iha import collapse_matrix, mixing_matrix


class IHAHeadMixing(nn.Module):
    """An IHA layer's mixing with the folder's parameters: `alpha_q` [H, H, P], `alpha_k` and `alpha_v`
    [H_kv, H_kv, P], `collapse` [H, P] or [H, H, P].

    Kept in fp32 like the folder stores them; cast to the activations' dtype where used, as the reference does.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, num_pseudo_heads: int, collapse_mode: str):
        super().__init__()
        self.num_pseudo_heads = num_pseudo_heads
        kv_shape = (num_kv_heads, num_kv_heads, num_pseudo_heads)
        query_shape = (num_heads, num_heads, num_pseudo_heads)
        collapse_shape = (num_heads, num_pseudo_heads) if collapse_mode == "per_head" else query_shape
        self.alpha_q = nn.Parameter(torch.empty(query_shape, dtype=torch.float32), requires_grad=False)
        self.alpha_k = nn.Parameter(torch.empty(kv_shape, dtype=torch.float32), requires_grad=False)
        self.alpha_v = nn.Parameter(torch.empty(kv_shape, dtype=torch.float32), requires_grad=False)
        self.collapse = nn.Parameter(torch.empty(collapse_shape, dtype=torch.float32), requires_grad=False)

    @staticmethod
    def mix(states: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """[tokens, M * d] head states -> [tokens, P * H * d] pseudo-heads, pseudo-major: `out[n, p, h] =
        sum_m alpha[m, h, p] * states[n, m]` (one [P * H, M] @ [M, d] product per token)."""
        num_sources = alpha.shape[0]
        mixed = torch.matmul(mixing_matrix(alpha).to(states.dtype), states.reshape(states.shape[0], num_sources, -1))
        return mixed.flatten(1)

    def mix_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return self.mix(q, self.alpha_q), self.mix(k, self.alpha_k), self.mix(v, self.alpha_v)

    def collapse_heads(self, pseudo_outputs: torch.Tensor) -> torch.Tensor:
        """[tokens, P * H * d] pseudo-outputs (pseudo-major) -> [tokens, H * d]."""
        num_tokens = pseudo_outputs.shape[0]
        collapse = self.collapse.to(pseudo_outputs.dtype)
        num_heads = collapse.shape[0]
        pseudo = pseudo_outputs.view(num_tokens, self.num_pseudo_heads, num_heads, -1)
        if collapse.dim() == 2:  # per head: out[n, h] = sum_p R[h, p] * o[n, p, h]
            return (pseudo * collapse.t()[None, :, :, None]).sum(dim=1).flatten(1)
        # global: out[n, h] = sum_(p, m) R[h, m, p] * o[n, p, m]
        return torch.matmul(collapse_matrix(collapse), pseudo.flatten(1, 2)).flatten(1)
