"""The one-layer bidirectional models compared: MHA, IHA (the package's head mixing) and 2-simplicial attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from iha.models.iha.modeling_iha import IHAHeadMixing

from .simplicial_attention import TwoSimplicialAttention
from .task import valid_positions


def reset_mixing_random(mixing: IHAHeadMixing, generator: torch.Generator) -> None:
    """Random mixing for training from scratch: alphas N(0, 1/H) (fan-in H), collapse N(0, 1/P). (An identity
    start would keep every pseudo-copy of a key identical forever under a mask-free attention.)"""
    with torch.no_grad():
        for name in ("alpha_q", "alpha_k", "alpha_v"):
            parameter = getattr(mixing, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(mixing.num_heads))
        mixing.collapse.copy_(
            torch.randn(mixing.collapse.shape, generator=generator) / math.sqrt(mixing.num_pseudo_heads)
        )


class BidirectionalAttention(nn.Module):
    """Mask-free softmax attention: multi-head (`num_pseudo_heads=None`) or Interleaved Head Attention.

    Only padding is masked: `key_padding_mask` [B, N] (True = real token) hides padded keys from every query; for
    IHA it is repeated over the P pseudo-tokens of each token (virtual index n * P + p belongs to token n).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_pseudo_heads: int | None = None):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"`hidden_size` ({hidden_size}) must be a multiple of `num_heads` ({num_heads}).")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.head_mixing = None
        if num_pseudo_heads is not None:
            self.head_mixing = IHAHeadMixing(num_heads, num_heads, num_pseudo_heads, collapse_mode="per_head")

    def reset_mixing_random(self, generator: torch.Generator) -> None:
        if self.head_mixing is not None:
            reset_mixing_random(self.head_mixing, generator)

    def forward(self, hidden_states: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.head_mixing is not None:
            query = self.head_mixing.mix_queries(query)  # [B, H, N * P, d]
            key, value = self.head_mixing.mix_keys_values(key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.repeat_interleave(self.head_mixing.num_pseudo_heads, dim=1)
        attention_mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        output = output.transpose(1, 2)  # [B, N (* P), H, d]
        if self.head_mixing is not None:
            output = self.head_mixing.collapse_heads(output)  # [B, N, H, d]
        return self.o_proj(output.reshape(batch_size, seq_len, -1))


ATTENTIONS = ("mha", "iha", "simplicial")


class CompositionModel(nn.Module):
    """One bidirectional transformer block over the m^2 relation bits (m up to `max_m`), one logit per position."""

    def __init__(
        self,
        max_m: int,
        hidden_size: int,
        num_heads: int,
        attention: str = "mha",
        num_pseudo_heads: int | None = None,
    ):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"Unknown attention {attention!r}: choose one of {ATTENTIONS}.")
        if (attention == "iha") != (num_pseudo_heads is not None):
            raise ValueError("`num_pseudo_heads` is given for IHA and only for IHA.")
        self.max_m = max_m
        self.bit_embedding = nn.Embedding(2, hidden_size)
        self.row_embedding = nn.Embedding(max_m, hidden_size)
        self.column_embedding = nn.Embedding(max_m, hidden_size)
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size)
        )
        self.final_norm = nn.LayerNorm(hidden_size)
        self.readout = nn.Linear(hidden_size, 1)
        # Built last, so that every model of one seed draws the same embeddings, MLP and readout (and MHA, IHA and
        # 2-simplicial the same q/k/v/o projections).
        if attention == "simplicial":
            self.attention = TwoSimplicialAttention(hidden_size, num_heads)
        else:
            self.attention = BidirectionalAttention(hidden_size, num_heads, num_pseudo_heads)

    def forward(self, bits: torch.Tensor, sizes: torch.Tensor | None = None) -> torch.Tensor:
        """bits [B, L] (row-major, right-padded), sizes [B] (m of every example; default: all sqrt(L))."""
        batch_size, length = bits.shape
        if sizes is None:
            side = math.isqrt(length)
            if side * side != length:
                raise ValueError(f"{length} tokens are no m x m relation: pass `sizes` for padded batches.")
            sizes = torch.full((batch_size,), side, device=bits.device)
        if int(sizes.max()) > self.max_m or int(sizes.max()) ** 2 > length:
            raise ValueError(
                f"Relations up to m = {int(sizes.max())} need {int(sizes.max()) ** 2} tokens and a model with "
                f"max_m >= m; got {length} tokens and max_m = {self.max_m}."
            )
        positions = torch.arange(length, device=bits.device)[None, :]
        is_real = valid_positions(sizes, length)
        rows = torch.where(is_real, positions // sizes[:, None], 0)  # token t = i * m + j sits at row i, column j
        columns = torch.where(is_real, positions % sizes[:, None], 0)
        hidden = self.bit_embedding(bits) + self.row_embedding(rows) + self.column_embedding(columns)
        key_padding_mask = None if bool(is_real.all()) else is_real
        hidden = hidden + self.attention(self.attention_norm(hidden), key_padding_mask)
        hidden = hidden + self.mlp(self.mlp_norm(hidden))
        return self.readout(self.final_norm(hidden)).squeeze(-1)


def build_model(
    max_m: int,
    hidden_size: int,
    num_heads: int,
    num_pseudo_heads: int | None,
    seed: int,
    attention: str | None = None,
) -> CompositionModel:
    """The same seed gives every attention the same embeddings, projections, MLP and readout at initialisation.

    `attention` defaults to IHA when `num_pseudo_heads` is given, MHA otherwise.
    """
    attention = attention or ("mha" if num_pseudo_heads is None else "iha")
    torch.manual_seed(seed)
    model = CompositionModel(max_m, hidden_size, num_heads, attention, num_pseudo_heads)
    if attention != "simplicial":
        model.attention.reset_mixing_random(torch.Generator().manual_seed(seed + 1))
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
