"""Blocked local attention: the fast path of sliding IHA layers on SDPA, its plan, its kernel and when it runs.

SDPA with a dense mask computes every (query, key) pair of the N * P virtual tokens and then throws most of them away:
a sliding layer would cost as much as a global one. Cutting the sequence into blocks and running SDPA on
[batch * blocks] computes only the keys a window can reach, so the cost grows with N * W. It runs without past tokens
(training, prefill); when decoding, the sliding cache already holds only the tokens the window reaches.

`iha.attention.sdpa.iha_sdpa_mask` asks `blocked_local_attention_applies` and builds the plan
(`create_blocked_local_mask`, a `BlockedLocalMask`) in place of the layer's dense mask; the attention function
`iha.attention.sdpa.iha_sdpa_attention` runs it with `blocked_local_attention`. Blocks, windows and reach come from the
layer's `IHALayerSpec` (`iha/models/iha/layer_iha.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..models.iha.layer_iha import IHALayerSpec


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

    allowed: torch.Tensor
    key_index: torch.Tensor
    block_tokens: int
    context_blocks: int

    def contiguous(self) -> "BlockedLocalMask":
        # `generate` calls `.contiguous()` on the masks it prepares for static caches.
        return BlockedLocalMask(
            self.allowed.contiguous(), self.key_index.contiguous(), self.block_tokens, self.context_blocks
        )


def local_attention_blocks(spec: IHALayerSpec) -> tuple[int, int]:
    """Block length in tokens and how many earlier blocks each block reads, for the window of a sliding layer.

    A block of W / k tokens reads k + 1 such blocks of keys to cover its window: (k + 1) / k times the work of an
    ideal kernel (2x for whole-window blocks). Quarter-window blocks (1.25x) were the fastest on CPU; smaller blocks
    make products too small to run efficiently. The earlier blocks cover every token the window reaches back to
    (`IHALayerSpec.reach_tokens`: one more than W - 1 when P > 1, which needs no extra block unless W is a multiple of
    the block length plus one token).
    """
    block_tokens = max(-(-spec.sliding_window // 4), -(-MIN_LOCAL_BLOCK_VIRTUAL_TOKENS // spec.num_pseudo_heads))
    context_blocks = -(-spec.reach_tokens // block_tokens)
    return block_tokens, context_blocks


def blocked_local_attention_applies(
    spec: IHALayerSpec, query_length: int, kv_length: int, no_past_tokens: bool
) -> bool:
    """Whether a sliding IHA layer runs blocked (lengths in tokens): without past tokens, and only where the blocks
    skip work (blocked attention computes (context_blocks + 1) blocks of keys per block of queries, dense all)."""
    if not spec.is_sliding or not no_past_tokens or kv_length != query_length:
        return False
    block_tokens, context_blocks = local_attention_blocks(spec)
    return query_length > (context_blocks + 1) * block_tokens


def create_blocked_local_mask(
    mask_function: Callable, batch_size: int, num_tokens: int, spec: IHALayerSpec, device: torch.device
) -> BlockedLocalMask:
    """Evaluate the layer's index-based mask function (causal pattern, window, padding, packed sequences) on the
    (query, key) pairs of every block, in the same virtual indices the dense mask uses."""
    num_pseudo_heads = spec.num_pseudo_heads
    block_tokens, context_blocks = local_attention_blocks(spec)
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
