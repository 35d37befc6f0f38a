"""The decomposition reference of docs/serving.md (`iha.models.iha.naive_iha.decomposed_attention`): IHA attention as P stock
causal passes over token positions, one per key pseudo-index, merged by their log-sum-exp, against the model."""

import pytest
import torch
from testing_utils import generation_position_ids, left_padded_batch, tiny_iha_model

import iha
from iha.models.iha.naive_iha import reference_forward


def logits_and_decomposition(model, seq_len=9):
    input_ids, attention_mask = left_padded_batch(seq_len=seq_len)
    position_ids = generation_position_ids(attention_mask)
    real = attention_mask.bool()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        decomposed = reference_forward(model, input_ids, attention_mask, position_ids, decomposed=True)
    return logits[real], decomposed[real]


@pytest.mark.parametrize("position_mode", ["shared", "virtual"])
@pytest.mark.parametrize("num_key_value_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("num_pseudo", [2, 3])
@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_decomposition_is_exact(mask_mode, num_pseudo, num_key_value_heads, position_mode):
    model = tiny_iha_model(
        num_pseudo_heads=num_pseudo,
        num_key_value_heads=num_key_value_heads,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
    ).double()
    logits, decomposed = logits_and_decomposition(model)
    # float64 throughout; transformers computes the RoPE angles in float32, which leaves ~1e-8.
    torch.testing.assert_close(decomposed, logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_decomposition_of_the_hybrid_layout(mask_mode):
    layout = iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=24)
    model = tiny_iha_model(num_hidden_layers=5, num_pseudo_heads=2, iha_mask_mode=mask_mode, **layout).double()
    logits, decomposed = logits_and_decomposition(model, seq_len=12)
    torch.testing.assert_close(decomposed, logits, rtol=0, atol=1e-6)


def test_flat_causal_needs_the_strictly_causal_passes():
    # Plain causal passes for every key pseudo-index compute the token-causal pattern: under the flat-causal mask a
    # pseudo-query would see its own token's later pseudo-keys, and the logits move far beyond rounding.
    model = tiny_iha_model(num_pseudo_heads=2, iha_mask_mode="flat_causal").double()
    logits, _ = logits_and_decomposition(model)
    model.config.iha_mask_mode = "token_causal"  # the reference reads the mask mode from the config
    _, plain_passes = logits_and_decomposition(model)
    assert (plain_passes - logits).abs().max() > 1e-3
