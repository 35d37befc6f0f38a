"""IHA with P >= 2 strictly contains MHA (the paper's constructive claim), checked on one attention layer.

Containment: IHA at identity mixing computes MHA exactly (tests/research/synthetic/test_synthetic_task.py,
`test_iha_at_identity_computes_mha`). Strictness needs one function IHA computes and no MHA layer can:

* With no positional encoding, on a repeated-token input (every token equal to x) all of an MHA head's queries and
  keys are equal, so its softmax is uniform and its output is the mean value W_v x: an MHA layer is linear in x,
  whatever its weights.
* In IHA every token also has P pseudo-keys. Give pseudo-key 1 the sign-flipped key mixing of pseudo-key 0: a
  query then weighs scores s(x) and -s(x), with s(x) = q(x) . k(x) / sqrt(d) quadratic in x, so the weights
  sigma(2 s(x)) and sigma(-2 s(x)) depend on x. If both pseudo-keys carried the same value the weights would sum
  away (w V + (1 - w) V = V, linear again), so pseudo-value 1 is zero: head h outputs sigma(2 s_h(x)) W_v,h x.
"""

import pytest
import torch

from research.synthetic.models import BidirectionalAttention


HIDDEN, HEADS, TOKENS = 8, 2, 5


def repeated(x: torch.Tensor) -> torch.Tensor:
    """[batch, hidden] -> [batch, TOKENS, hidden]: every token the same vector."""
    return x[:, None, :].expand(-1, TOKENS, -1)


def layer_on_repeated_tokens(layer, x):
    output = layer(repeated(x))
    # Every token sees the same input, so every token's output is the same; keep one.
    torch.testing.assert_close(output, output[:, :1].expand_as(output))
    return output[:, 0]


def sign_flip_iha_layer(num_pseudo_heads: int, seed: int = 0) -> BidirectionalAttention:
    """IHA layer built by hand: pseudo-key 1 = -key, pseudo-value 1 = 0; other pseudo-heads copy pseudo-head 0."""
    torch.manual_seed(seed)
    layer = BidirectionalAttention(HIDDEN, HEADS, num_pseudo_heads).double()
    identity = torch.eye(HEADS, dtype=torch.float64)
    with torch.no_grad():
        mixing = layer.head_mixing
        mixing.alpha_q.copy_(identity[:, :, None].expand(-1, -1, num_pseudo_heads))
        mixing.alpha_k.copy_(identity[:, :, None].expand(-1, -1, num_pseudo_heads))
        mixing.alpha_k[:, :, 1] = -identity  # scores s and -s
        mixing.alpha_v.copy_(identity[:, :, None].expand(-1, -1, num_pseudo_heads))
        mixing.alpha_v[:, :, 1] = 0.0  # pseudo-values differ, so the weights do not cancel
        mixing.collapse.zero_()
        mixing.collapse[:, 0] = 1.0  # every pseudo-query sees the same keys; read pseudo-head 0
    return layer


def linearity_gaps(function, x, y) -> tuple[float, float]:
    """Relative failure of additivity f(x + y) = f(x) + f(y) and of homogeneity f(2x) = 2 f(x)."""
    additive = function(x + y) - (function(x) + function(y))
    homogeneous = function(2 * x) - 2 * function(x)
    scale = function(x).norm() + function(y).norm()
    return (additive.norm() / scale).item(), (homogeneous.norm() / scale).item()


@pytest.mark.parametrize("seed", range(5))
def test_mha_is_linear_on_repeated_tokens_whatever_its_weights(seed):
    torch.manual_seed(seed)
    layer = BidirectionalAttention(HIDDEN, HEADS).double()
    with torch.no_grad():  # large weights too: sharp softmaxes, if the scores were not all equal
        for projection in (layer.q_proj, layer.k_proj):
            projection.weight.mul_(5.0)
    x, y = torch.randn(2, 4, HIDDEN, dtype=torch.float64)
    additive, homogeneous = linearity_gaps(lambda v: layer_on_repeated_tokens(layer, v), x, y)
    assert additive < 1e-12 and homogeneous < 1e-12
    # ... and it is exactly o_proj(v_proj(x)): the uniform mean of equal values.
    torch.testing.assert_close(layer_on_repeated_tokens(layer, x), layer.o_proj(layer.v_proj(x)))


@pytest.mark.parametrize("num_pseudo_heads", [2, 4])
def test_the_sign_flip_iha_layer_is_not_linear_on_repeated_tokens(num_pseudo_heads):
    layer = sign_flip_iha_layer(num_pseudo_heads)
    x, y = torch.randn(2, 4, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    output = layer_on_repeated_tokens(layer, x)
    # The construction computes what the derivation says: head h outputs w_h(x) * W_v,h x, where w_h is the softmax
    # weight of the + pseudo-keys (P - 1 of them score +s, one scores -s).
    batch_size = x.shape[0]
    query = layer.q_proj(x).view(batch_size, HEADS, -1)
    key = layer.k_proj(x).view(batch_size, HEADS, -1)
    score = (query * key).sum(-1) / layer.head_dim**0.5  # [batch, heads]
    plus = (num_pseudo_heads - 1) * torch.exp(score)
    weight = plus / (plus + torch.exp(-score))
    expected = layer.o_proj((weight[..., None] * layer.v_proj(x).view(batch_size, HEADS, -1)).reshape(batch_size, -1))
    torch.testing.assert_close(output, expected)
    # The weights really vary with x (not saturated at 0 or 1) ...
    assert weight.min() < 0.95 * weight.max()
    # ... so the layer is measurably not linear in x: no MHA layer computes it.
    additive, homogeneous = linearity_gaps(lambda v: layer_on_repeated_tokens(layer, v), x, y)
    assert additive > 0.05 and homogeneous > 0.05


def test_equal_pseudo_values_cancel_the_weights_and_the_layer_is_linear_again():
    layer = sign_flip_iha_layer(2)
    with torch.no_grad():
        layer.head_mixing.alpha_v[:, :, 1] = layer.head_mixing.alpha_v[:, :, 0]
    x, y = torch.randn(2, 4, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    additive, homogeneous = linearity_gaps(lambda v: layer_on_repeated_tokens(layer, v), x, y)
    assert additive < 1e-12 and homogeneous < 1e-12
