# Copyright 2026 The iha authors. Licensed under the Apache License, Version 2.0: you may not use this file except in
# compliance with it (http://www.apache.org/licenses/LICENSE-2.0). SPDX-License-Identifier: Apache-2.0
"""The two linear maps of an IHA layer as matrices, written once: the model, the weight fold (`iha.models.folding`)
and the vLLM plugin build them here. Torch only; travels with the weights. The head mixing `alpha` [M, H, P]:
`out[n, h, p] = sum_m alpha[m, h, p] * x[n, m]`; the collapse R, [H, P] (per head) or [H, H, P] (global: target head,
source head, pseudo index): `out[n, h] = sum_(p, m) R[h, m, p] * o[n, p, m]`. Both pseudo-major (index p * H + h).
"""

import torch


def mixing_matrix(alpha: torch.Tensor) -> torch.Tensor:
    """alpha [M, H, P] -> [P * H, M]: row p * H + h holds alpha[:, h, p]."""
    num_sources, num_targets, num_pseudo_heads = alpha.shape
    return alpha.permute(2, 1, 0).reshape(num_pseudo_heads * num_targets, num_sources)


def collapse_matrix(collapse: torch.Tensor) -> torch.Tensor:
    """R [H, P] (per head) or [H, H, P] (global) -> [H, P * H]: column p * H + m holds R[:, m, p]."""
    if collapse.dim() == 2:
        num_heads = collapse.shape[0]
        collapse = torch.eye(num_heads, dtype=collapse.dtype, device=collapse.device)[:, :, None] * collapse[:, None]
    num_heads, _, num_pseudo_heads = collapse.shape
    return collapse.permute(0, 2, 1).reshape(num_heads, num_pseudo_heads * num_heads)
