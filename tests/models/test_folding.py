"""The head mixing folded into the projections (`iha.models.folding`, shared by the Llama export and the vLLM plugin)
computes what the model's own layer computes: the folded q/k/v projections give the mixed pseudo-heads, the folded `o_proj` the collapse and
output projection, in float64 to rounding, for GQA and MHA, biases, per-head and global collapse."""

import pytest
import torch
from testing_utils import tiny_iha_model

from iha.models.folding import fold_collapse_into_output, fold_mixing_into_projection, head_major_to_pseudo_major


LAYOUTS = {
    "gqa-per-head": dict(num_key_value_heads=2, num_pseudo_heads=2),
    "mha-global-bias": dict(num_pseudo_heads=3, iha_collapse_mode="global", qkv_bias=True, o_proj_bias=True),
}


def pseudo_major_rows(folded_rows: torch.Tensor, num_heads: int, num_pseudo_heads: int) -> torch.Tensor:
    """[tokens, H * P * d] head-major -> [tokens, P, H, d]: pseudo-token p of each token, as the attention reads it."""
    tokens = folded_rows.shape[0]
    return head_major_to_pseudo_major(folded_rows, 1, num_heads, num_pseudo_heads).view(
        tokens, num_pseudo_heads, num_heads, -1
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_folded_projections_give_the_mixed_pseudo_heads(layout):
    model = tiny_iha_model(**LAYOUTS[layout]).double()
    attention = model.model.layers[0].self_attn
    mixing = attention.head_mixing
    hidden = torch.randn(7, model.config.hidden_size, dtype=torch.float64)
    head_dim, num_pseudo = attention.head_dim, mixing.num_pseudo_heads
    # The layer's own mixing of each projection's heads: [1, heads, N * P, d], virtual index n * P + p.
    own_mixing = {
        "q": lambda states: mixing.mix_queries(states),
        "k": lambda states: mixing.mix_keys_values(states, states)[0],
        "v": lambda states: mixing.mix_keys_values(states, states)[1],
    }
    for name, alpha, num_heads in (
        ("q", mixing.alpha_q, mixing.num_heads),
        ("k", mixing.alpha_k, mixing.num_key_value_heads),
        ("v", mixing.alpha_v, mixing.num_key_value_heads),
    ):
        projection = getattr(attention, f"{name}_proj")
        expected = own_mixing[name](projection(hidden).view(1, 7, -1, head_dim).transpose(1, 2))
        weight, bias = fold_mixing_into_projection(projection.weight, projection.bias, alpha, head_dim)
        folded = torch.nn.functional.linear(hidden, weight, bias)
        got = pseudo_major_rows(folded, num_heads, num_pseudo).reshape(7 * num_pseudo, num_heads, head_dim)
        torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_folded_output_projection_gives_the_collapse(layout):
    model = tiny_iha_model(**LAYOUTS[layout]).double()
    attention = model.model.layers[0].self_attn
    mixing = attention.head_mixing
    num_heads, num_pseudo, head_dim = mixing.num_heads, mixing.num_pseudo_heads, attention.head_dim
    pseudo_outputs = torch.randn(1, 5 * num_pseudo, num_heads, head_dim, dtype=torch.float64)  # [B, N * P, H, d]
    expected = attention.o_proj(mixing.collapse_heads(pseudo_outputs).reshape(1, 5, -1))[0]
    weight = fold_collapse_into_output(attention.o_proj.weight, mixing.collapse, head_dim)
    # The folded o_proj reads each token's pseudo-outputs pseudo-major, reordered as the plugin reorders its shard.
    weight = head_major_to_pseudo_major(weight, 1, num_heads, num_pseudo)
    got = torch.nn.functional.linear(pseudo_outputs.reshape(5, -1), weight, attention.o_proj.bias)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_head_major_to_pseudo_major_reorders_heads_and_pseudo_heads():
    num_heads, num_pseudo, head_dim = 3, 2, 4
    rows = torch.arange(num_heads * num_pseudo * head_dim).view(-1, 1)  # row (h, p, j) holds (h * P + p) * d + j
    reordered = head_major_to_pseudo_major(rows, 0, num_heads, num_pseudo).view(num_pseudo, num_heads, head_dim)
    for pseudo in range(num_pseudo):
        for head in range(num_heads):
            start = (head * num_pseudo + pseudo) * head_dim
            assert reordered[pseudo, head].tolist() == list(range(start, start + head_dim))
