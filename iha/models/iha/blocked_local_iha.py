# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Blocked local attention: the fast path of sliding IHA layers on SDPA, its plan, its kernel and when it runs.

SDPA with a dense mask computes every (query, key) pair of the N * P virtual tokens and then throws most of them away:
a sliding layer would cost as much as a global one. Cutting the sequence into blocks and running SDPA on
[batch * blocks] computes only the keys a window can reach, so the cost grows with N * W. It runs without past tokens
(training, prefill); when decoding, the sliding cache already holds only the tokens the window reaches.

`masking_iha.create_interleaved_mask` asks `blocked_local_attention_applies` and builds the plan
(`create_blocked_local_mask`, a `BlockedLocalMask`) in place of the layer's dense mask; the plan names its kernel,
`blocked_local_attention`, which `attention_iha.choose_attention_path` hands the call to.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn


# Below this many virtual tokens per block, the overhead of many tiny products outweighs the skipped work.
MIN_LOCAL_BLOCK_VIRTUAL_TOKENS = 64


@dataclass
class BlockedLocalMask:
    """The plan of a sliding IHA layer's attention: its mask, cut into blocks for `blocked_local_attention`.

    The N * P virtual tokens are cut into blocks of `block_tokens` tokens (`block_len = block_tokens * P` virtual
    tokens); block i attends to itself and to the `context_blocks` blocks before it, which hold every key its window
    can reach. `key_index` [num_blocks * window_len] lists the virtual index of every key of every block's window
    (clamped into the sequence) and `allowed` [B * num_blocks, 1, block_len, window_len] is the exact mask on them,
    False for window positions outside the sequence.
    """

    # The kernel that runs this plan, by its name in `attention_iha.IHA_ATTENTION_PATHS`.
    attention_path: ClassVar[str] = "blocked_local"

    allowed: torch.Tensor
    key_index: torch.Tensor
    block_tokens: int
    context_blocks: int

    def contiguous(self) -> "BlockedLocalMask":
        # `generate` calls `.contiguous()` on the masks it prepares for static caches.
        return BlockedLocalMask(
            self.allowed.contiguous(), self.key_index.contiguous(), self.block_tokens, self.context_blocks
        )


def window_reach_tokens(sliding_window: int, num_pseudo_heads: int, window_unit: str = "token") -> int:
    """How many tokens before its own a pseudo-query of a sliding IHA layer can reach (`iha_window_unit`).

    A window of W tokens reaches W - 1 tokens back. The flat window of W * P virtual tokens reaches from the first
    pseudo-query (n, 0) back to virtual index (n - W) * P + 1: into token n - W, one token further, when P > 1.
    """
    if window_unit == "virtual":
        return -(-(sliding_window * num_pseudo_heads - 1) // num_pseudo_heads)
    return sliding_window - 1


def local_attention_blocks(sliding_window: int, num_pseudo_heads: int, window_unit: str = "token") -> tuple[int, int]:
    """Block length in tokens and how many earlier blocks each block reads, for a window of `sliding_window` tokens.

    A block of W / k tokens reads k + 1 such blocks of keys to cover its window: (k + 1) / k times the work of an
    ideal kernel (2x for whole-window blocks). Quarter-window blocks (1.25x) were the fastest on CPU; smaller blocks
    make products too small to run efficiently. The earlier blocks cover every token the window reaches back to
    (`window_reach_tokens`: one more under the virtual window, which needs no extra block unless W is a multiple of
    the block length plus one token).
    """
    block_tokens = max(-(-sliding_window // 4), -(-MIN_LOCAL_BLOCK_VIRTUAL_TOKENS // num_pseudo_heads))
    context_blocks = -(-window_reach_tokens(sliding_window, num_pseudo_heads, window_unit) // block_tokens)
    return block_tokens, context_blocks


def blocked_local_attention_saves_work(
    num_tokens: int, sliding_window: int, num_pseudo_heads: int, window_unit: str = "token"
) -> bool:
    """Blocked attention computes (context_blocks + 1) blocks of keys per block of queries, dense attention all of them."""
    block_tokens, context_blocks = local_attention_blocks(sliding_window, num_pseudo_heads, window_unit)
    return num_tokens > (context_blocks + 1) * block_tokens


def create_blocked_local_mask(
    mask_function: Callable,
    batch_size: int,
    num_tokens: int,
    num_pseudo_heads: int,
    sliding_window: int,
    device: torch.device,
    window_unit: str = "token",
) -> BlockedLocalMask:
    """Evaluate the layer's index-based mask function (causal pattern, window, padding, packed sequences) on the
    (query, key) pairs of every block, in the same virtual indices the dense mask uses."""
    block_tokens, context_blocks = local_attention_blocks(sliding_window, num_pseudo_heads, window_unit)
    num_blocks = -(-num_tokens // block_tokens)
    block_len = block_tokens * num_pseudo_heads
    window_len = (context_blocks + 1) * block_len
    virtual_len = num_tokens * num_pseudo_heads

    block_starts = torch.arange(num_blocks, device=device) * block_len
    query_index = block_starts[:, None, None] + torch.arange(block_len, device=device)[None, :, None]
    key_index = (block_starts - context_blocks * block_len)[:, None, None] + torch.arange(window_len, device=device)
    # The last block runs past the sequence and the first windows start before it: clamped indices keep the lookups
    # (padding, packed ids, the keys themselves) in range, and the mask drops the keys outside the sequence.
    key_in_sequence = (key_index >= 0) & (key_index < virtual_len)
    query_index = query_index.clamp(max=virtual_len - 1)
    key_index = key_index.clamp(min=0, max=virtual_len - 1)
    allowed = mask_function(
        torch.arange(batch_size, device=device)[:, None, None, None],
        torch.arange(1, device=device),
        query_index[None],
        key_index[None],
    )
    allowed = (allowed & key_in_sequence).expand(batch_size, num_blocks, block_len, window_len)
    return BlockedLocalMask(
        allowed=allowed.reshape(batch_size * num_blocks, 1, block_len, window_len),
        key_index=key_index.flatten(),
        block_tokens=block_tokens,
        context_blocks=context_blocks,
    )


def blocked_local_attention_applies(
    attn_implementation: str,
    sliding_window: int | None,
    query_length: int,
    kv_length: int,
    no_past_tokens: bool,
    num_pseudo_heads: int,
    window_unit: str = "token",
) -> bool:
    """Whether a sliding IHA layer runs blocked: on SDPA, without past tokens, and only where the blocks skip work."""
    return (
        sliding_window is not None
        and attn_implementation == "sdpa"
        and no_past_tokens
        and kv_length == query_length
        and blocked_local_attention_saves_work(query_length, sliding_window, num_pseudo_heads, window_unit)
    )


def blocked_local_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockedLocalMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA of query block i against key blocks i - context_blocks .. i, batched over all blocks.

    query [B, H, N * P, d], key / value [B, H_kv, N * P, d]; returns [B, N * P, H, d] and no weights, like
    transformers' attention functions.
    """
    batch_size, num_heads, virtual_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != virtual_len:
        raise ValueError(
            f"Blocked local attention needs as many keys as queries (no past tokens), got {key.shape[2]} keys for "
            f"{virtual_len} queries: build the mask with `create_iha_masks` for the cache that is passed."
        )
    num_blocks = attention_mask.allowed.shape[0] // batch_size
    block_len = attention_mask.allowed.shape[2]
    window_len = attention_mask.allowed.shape[3]
    padded_len = num_blocks * block_len

    # In the token-major [B, N * P, heads, d] layout a block is a run of rows: [B * blocks, block_len, ...] is a view.
    query_blocks = query.transpose(1, 2)
    if padded_len > virtual_len:  # repeat the last query into the padding rows; their outputs are dropped below
        fill_index = torch.arange(padded_len, device=query.device).clamp(max=virtual_len - 1)
        query_blocks = query_blocks.index_select(1, fill_index)
    query_blocks = query_blocks.reshape(batch_size * num_blocks, block_len, num_heads, head_dim).transpose(1, 2)

    def key_windows(states: torch.Tensor) -> torch.Tensor:
        # One gather builds every window (overlapping by `context_blocks` blocks); its backward is one scatter-add.
        windows = states.transpose(1, 2).index_select(1, attention_mask.key_index)
        return windows.view(batch_size * num_blocks, window_len, num_kv_heads, head_dim).transpose(1, 2)

    attn_output = nn.functional.scaled_dot_product_attention(
        query_blocks,
        key_windows(key),
        key_windows(value),
        attn_mask=attention_mask.allowed,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=num_heads != num_kv_heads,
    )
    attn_output = attn_output.transpose(1, 2).reshape(batch_size, padded_len, num_heads, head_dim)
    return attn_output[:, :virtual_len], None
