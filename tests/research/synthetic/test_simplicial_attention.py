"""2-simplicial attention against a plain einsum reference of its definition."""

import math

import pytest
import torch

from research.synthetic import build_model
from research.synthetic.models import count_parameters
from research.synthetic.simplicial_attention import TwoSimplicialAttention


def reference_two_simplicial(module: TwoSimplicialAttention, hidden: torch.Tensor, key_padding_mask=None):
    """score[i, j, k] = sum_d q_i k_j k'_k / sqrt(d), softmax over pairs (j, k), output sum_jk w (v_j * v'_k)."""
    batch_size, seq_len, _ = hidden.shape

    def heads(projection):
        return projection(hidden).view(batch_size, seq_len, module.num_heads, module.head_dim).transpose(1, 2)

    query, key, second_key = heads(module.q_proj), heads(module.k_proj), heads(module.second_k_proj)
    value, second_value = heads(module.v_proj), heads(module.second_v_proj)
    scores = torch.einsum("bhid,bhjd,bhkd->bhijk", query, key, second_key) / math.sqrt(module.head_dim)
    if key_padding_mask is not None:
        pair_is_real = key_padding_mask[:, None, None, :, None] & key_padding_mask[:, None, None, None, :]
        scores = scores.masked_fill(~pair_is_real, float("-inf"))
    weights = scores.flatten(-2).softmax(-1).view_as(scores)
    output = torch.einsum("bhijk,bhjd,bhkd->bhid", weights, value, second_value)
    return module.o_proj(output.transpose(1, 2).reshape(batch_size, seq_len, -1))


@pytest.mark.parametrize("padded", [False, True])
def test_two_simplicial_attention_matches_the_einsum_reference(padded):
    torch.manual_seed(0)
    module = TwoSimplicialAttention(hidden_size=12, num_heads=3).double()
    hidden = torch.randn(3, 7, 12, dtype=torch.float64)
    mask = None
    if padded:
        mask = torch.arange(7)[None, :] < torch.tensor([7, 4, 2])[:, None]
    torch.testing.assert_close(module(hidden, mask), reference_two_simplicial(module, hidden, mask))
    if padded:  # padded keys are invisible: changing them changes no real position's output
        changed = hidden.clone()
        changed[~mask] = torch.randn(int((~mask).sum()), 12, dtype=torch.float64)
        torch.testing.assert_close(module(changed, mask)[mask], module(hidden, mask)[mask])


def test_two_simplicial_attention_is_not_plain_attention():
    # With k' and v' constant the trilinear score reduces to a bilinear one; random k', v' must change the output.
    torch.manual_seed(1)
    module = TwoSimplicialAttention(hidden_size=8, num_heads=2).double()
    hidden = torch.randn(2, 5, 8, dtype=torch.float64)
    before = module(hidden)
    with torch.no_grad():
        module.second_k_proj.weight.mul_(3.0)
    assert (module(hidden) - before).abs().max() > 1e-3


def test_parameter_counts_next_to_mha_and_iha():
    width, heads = 32, 8
    mha = build_model(10, width, heads, None, seed=0)
    simplicial = build_model(10, width, heads, None, seed=0, attention="simplicial")
    iha = build_model(10, width, heads, 8, seed=0)
    # 2-simplicial adds a second key and a second value projection; IHA adds alpha_q/k/v [H, H, P] and collapse [H, P].
    assert count_parameters(simplicial) - count_parameters(mha) == 2 * width * width
    assert count_parameters(iha) - count_parameters(mha) == 3 * heads * heads * 8 + heads * 8
    # Same seed, same shared weights: everything MHA has, the 2-simplicial model has with the same values.
    simplicial_state = simplicial.state_dict()
    for name, value in mha.state_dict().items():
        assert torch.equal(value, simplicial_state[name]), name
