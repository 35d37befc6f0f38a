"""Packed (padding-free) rows, as TRL's `--packing` sends them: restarting position_ids, no attention mask, no cache.

Every attention path for packed rows is checked, forward and gradients, against the dense masked path (SDPA with the
(N*P)^2 mask of the documents' block diagonal) and against the plain reference run on each document alone:

- SDPA: attention per document (`per_document_attention`, causal kernel per group of similar-length documents);
- sliding IHA layers: blocked local attention with the documents in its mask;
- flex attention: a BlockMask with document ids, whose blocks across documents are skipped, and one with a sliding
  window too (gradients with `--device cuda` only: torch's flex attention has no backward on CPU);
- FlashAttention: varlen over cumulative lengths in virtual units (only where flash-attn and a GPU are present).
"""

import itertools

import pytest
import torch
from testing_utils import TINY, record_sdpa_calls, sharpen_attention, tiny_iha_model

from iha.attention.blocked_local import BlockedLocalMask
from iha.attention.packed_documents import PackedDocumentsMask, group_documents_by_length
from iha.models.iha.masking_iha import create_iha_masks
from iha.models.iha.naive_iha import reference_forward, reference_mask


# Unequal documents: groups with padding inside, several groups, a one-token document.
UNEQUAL_LENGTHS = [7, 6, 3, 1, 7, 5]
EQUAL_LENGTHS = [6, 6, 6]


def packed_row(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, TINY["vocab_size"], (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return input_ids, position_ids


def documents_of(input_ids, lengths):
    return torch.split(input_ids, lengths, dim=1)


def reference_per_document(model, input_ids, lengths):
    """The reference run on every document alone, concatenated: what packing must not change."""
    return torch.cat([reference_forward(model, document) for document in documents_of(input_ids, lengths)], dim=1)


def dense_masks(model, lengths):
    """The (N*P)^2 masks of the documents' block diagonal, from the reference's own mask definition.

    Passed to the model as prepared masks (a dict per attention type), IHA layers on SDPA run the dense masked path.
    """
    sequence_ids = torch.cat([torch.full((n,), index) for index, n in enumerate(lengths)])[None]
    config = model.config
    masks = {}
    for attention_type in set(config.attention_types):
        is_iha = attention_type.startswith("iha_")
        window = config.sliding_window if attention_type.endswith("sliding_attention") else None
        num_pseudo = config.num_pseudo_heads if is_iha else 1
        mask_mode = config.iha_mask_mode if is_iha else "flat_causal"
        masks[attention_type] = reference_mask(sum(lengths), num_pseudo, mask_mode, window, None, sequence_ids)[:, None]
    return masks


def parameter_gradients(model, loss_of_logits):
    model.zero_grad()
    loss_of_logits().backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    return gradients


def assert_gradients_close(actual, expected, precision):
    for name, gradient in expected.items():
        # transformers computes RoPE angles in float32 even in a float64 model: ~1e-6 relative differences.
        scale = gradient.abs().max().item()
        precision.assert_close(actual[name], gradient, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name, gradient=True)


PACKED_MODES = list(itertools.product(["flat_causal", "token_causal"], ["virtual", "shared"], [1, 2, 3], [4, 2]))


def packed_mode_id(mode):
    mask_mode, position_mode, num_pseudo, num_key_value_heads = mode
    return f"{mask_mode}-{position_mode}-P{num_pseudo}-{'mha' if num_key_value_heads == 4 else 'gqa'}"


# --- SDPA: attention per document -----------------------------------------------------------------------------------


def assert_packed_row_matches_dense_and_reference(model, input_ids, position_ids, lengths, precision) -> dict:
    """The packed row's logits and parameter gradients equal those of the dense masked path and of the reference run
    per document; returns the packed path's gradients. The packed and dense paths run on `precision`'s device and
    dtype, the reference on `model` itself."""
    weights = torch.randn(sum(lengths), TINY["vocab_size"], generator=torch.Generator().manual_seed(5)).double()
    tested = precision.model(model)
    tested_weights = precision.to_device(weights.to(next(tested.parameters()).dtype))
    input_ids_here, position_ids_here, masks_here = precision.to_device(
        input_ids, position_ids, dense_masks(model, lengths)
    )

    def packed():
        return tested(input_ids_here, position_ids=position_ids_here, use_cache=False).logits[0]

    def dense():
        return tested(
            input_ids_here, position_ids=position_ids_here, attention_mask=masks_here, use_cache=False
        ).logits[0]

    def reference():
        return reference_per_document(model, input_ids, lengths)[0]

    with torch.no_grad():
        logits = packed()
        precision.assert_close(logits, dense(), rtol=0, atol=1e-6)
        precision.assert_close(logits, reference(), rtol=0, atol=1e-6)
    gradients = parameter_gradients(tested, lambda: (packed() * tested_weights).sum())
    dense_gradients = parameter_gradients(tested, lambda: (dense() * tested_weights).sum())
    assert_gradients_close(gradients, dense_gradients, precision)
    reference_gradients = parameter_gradients(model, lambda: (reference() * weights).sum())
    assert_gradients_close(gradients, reference_gradients, precision)
    return gradients


@pytest.mark.parametrize("lengths", [UNEQUAL_LENGTHS, EQUAL_LENGTHS], ids=["unequal", "equal"])
@pytest.mark.parametrize("mode", PACKED_MODES, ids=packed_mode_id)
def test_per_document_attention_matches_dense_mask_and_reference(mode, lengths, precision):
    mask_mode, position_mode, num_pseudo, num_key_value_heads = mode
    model = tiny_iha_model(
        num_key_value_heads=num_key_value_heads,
        num_pseudo_heads=num_pseudo,
        iha_mask_mode=mask_mode,
        iha_position_mode=position_mode,
    )
    model = sharpen_attention(model).double().train()
    input_ids, position_ids = packed_row(lengths)
    masks = create_iha_masks(model.config, model.model.embed_tokens(input_ids), None, None, position_ids)
    assert isinstance(masks["iha_full_attention"], PackedDocumentsMask)
    # Equal documents in order are a reshape of the row: no gathers.
    assert (masks["iha_full_attention"].output_index is None) == (lengths == EQUAL_LENGTHS)

    gradients = assert_packed_row_matches_dense_and_reference(model, input_ids, position_ids, lengths, precision)
    assert gradients["model.layers.0.self_attn.head_mixing.alpha_k"].abs().sum() > 0


def test_per_document_attention_runs_one_causal_kernel_per_group_without_a_row_sized_mask(monkeypatch, precision):
    lengths = [8, 8, 7, 2, 2]  # groups {8, 8, 7} (padded to 8) and {2, 2}
    assert group_documents_by_length(lengths) == [[0, 1, 2], [3, 4]]
    model = precision.model(tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=3))
    input_ids, position_ids = precision.to_device(*packed_row(lengths))
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        model(input_ids, position_ids=position_ids, use_cache=False)
    per_layer = [(call["queries"], call["keys"], call["mask"] is None, call["is_causal"]) for call in calls]
    assert per_layer == [(8 * 3, 8 * 3, True, True), (2 * 3, 2 * 3, True, True)] * model.config.num_hidden_layers


def test_token_causal_per_document_mask_is_the_documents_own_size(monkeypatch, precision):
    model = precision.model(tiny_iha_model(num_pseudo_heads=2, iha_mask_mode="token_causal"))
    input_ids, position_ids = precision.to_device(*packed_row([5, 5, 5]))
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        model(input_ids, position_ids=position_ids, use_cache=False)
    assert len(calls) == model.config.num_hidden_layers
    for call in calls:
        assert call["mask"].shape == (10, 10) and not call["is_causal"]
        token = torch.arange(10) // 2
        assert torch.equal(call["mask"].cpu(), token[None, :] <= token[:, None])


def test_grouping_bounds_the_padded_work():
    lengths = [512, 500, 480, 300, 290, 12, 1]
    groups = group_documents_by_length(lengths)
    assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))
    for members in groups:
        longest = lengths[members[0]]
        assert all(lengths[member] <= longest for member in members)
        assert len(members) * longest**2 <= 1.25 * sum(lengths[member] ** 2 for member in members)
    assert groups[0] == [0, 1, 2]


def test_packed_rows_in_a_batch_of_two_match_the_reference(precision):
    model = sharpen_attention(tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=2)).double()
    rows = [[4, 6, 2], [3, 3, 3, 3]]  # no document spans two rows
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=generator)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    input_ids_here, position_ids_here = precision.to_device(input_ids, position_ids)
    with torch.no_grad():
        logits = precision.model(model)(input_ids_here, position_ids=position_ids_here, use_cache=False).logits
        expected = torch.cat([reference_per_document(model, input_ids[i : i + 1], rows[i]) for i in range(2)])
    precision.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_gradient_checkpointing_through_per_document_attention_gives_the_same_gradients(precision):
    model = precision.model(tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=2).double().train())
    input_ids, position_ids = precision.to_device(*packed_row(UNEQUAL_LENGTHS))

    def loss():
        return model(input_ids, position_ids=position_ids, labels=input_ids, use_cache=False).loss

    plain = parameter_gradients(model, loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_gradients_close(parameter_gradients(model, loss), plain, precision)


# --- when the per-document path runs ----------------------------------------------------------------------------------


def test_packing_is_read_only_without_a_mask_or_a_cache():
    model = tiny_iha_model(num_pseudo_heads=2)
    input_ids, position_ids = packed_row(EQUAL_LENGTHS)
    embeds = model.model.embed_tokens(input_ids)
    with_mask = create_iha_masks(model.config, embeds, torch.ones_like(input_ids), None, position_ids)
    assert not isinstance(with_mask["iha_full_attention"], PackedDocumentsMask)
    one_document = create_iha_masks(model.config, embeds, None, None, torch.arange(18)[None])
    assert one_document["iha_full_attention"] is None  # SDPA's is_causal kernel over the whole row


# --- sliding IHA layers and standard layers in packed rows ----------------------------------------------------------


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_hybrid_model_on_packed_rows_matches_dense_mask_and_reference(mask_mode, precision):
    # A sliding IHA layer (blocked local path), a full IHA layer (per document) and a standard layer (dense mask).
    window = 6
    model = tiny_iha_model(
        num_hidden_layers=3,
        num_key_value_heads=2,
        num_pseudo_heads=2,
        iha_mask_mode=mask_mode,
        attention_types=["iha_sliding_attention", "iha_full_attention", "full_attention"],
        sliding_window=window,
    )
    model = sharpen_attention(model).double().train()
    lengths = [70, 45, 60]  # longer than a block; boundaries inside blocks
    input_ids, position_ids = packed_row(lengths, seed=3)
    masks = create_iha_masks(model.config, model.model.embed_tokens(input_ids), None, None, position_ids)
    assert isinstance(masks["iha_sliding_attention"], BlockedLocalMask)
    assert isinstance(masks["iha_full_attention"], PackedDocumentsMask)

    assert_packed_row_matches_dense_and_reference(model, input_ids, position_ids, lengths, precision)


# --- flex attention: a BlockMask with document ids, and sliding windows ---------------------------------------------

FLEX_LENGTHS = [128, 64, 64, 128]  # 256, 128, 128, 256 virtual tokens at P = 2: documents fill whole 128-blocks
# Inductor's CPU flex-attention template needs a head dim that is a multiple of 16.
FLEX_OPTIONS = dict(hidden_size=64, num_key_value_heads=2, num_pseudo_heads=2)
# Against the reference: a packed row of full IHA layers (documents in the BlockMask), and a sliding IHA layer before a
# full one on two documents (window and documents in one BlockMask; the window of 40 tokens is 80 virtual tokens).
FLEX_REFERENCE_CASES = {
    "documents": ({}, FLEX_LENGTHS),
    "sliding": (
        {
            "num_hidden_layers": 2,
            "attention_types": ["iha_sliding_attention", "iha_full_attention"],
            "sliding_window": 40,
        },
        [200, 120],
    ),
}


def flex_and_sdpa_models(mask_mode, precision, **layout):
    """A flex-attention model on the test device and the same weights on SDPA, on the CPU in float32."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    options = dict(FLEX_OPTIONS, iha_mask_mode=mask_mode, **layout)
    flex = sharpen_attention(tiny_iha_model(attn_implementation="flex_attention", **options))
    sdpa = sharpen_attention(tiny_iha_model(**options))
    return precision.model(flex), sdpa


def run_flex(flex, input_ids, position_ids, precision):
    input_ids, position_ids = precision.to_device(input_ids, position_ids)
    try:
        return flex(input_ids, position_ids=position_ids, use_cache=False).logits
    except Exception as error:  # torch's CPU inductor may fail to compile the flex template
        on_cpu = precision.device.type == "cpu"
        if on_cpu and ("CppCompileError" in repr(error) or "InductorError" in type(error).__name__):
            pytest.xfail("torch's CPU inductor cannot compile this flex-attention kernel")
        raise


def require_flex_backward(precision):
    if precision.device.type != "cuda":
        pytest.skip("torch's flex attention has no backward on CPU; this runs with --device cuda")


@pytest.mark.slow
@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
def test_flex_attention_on_packed_rows_skips_blocks_across_documents_and_matches_dense_mask_and_reference(
    mask_mode, precision
):
    flex, sdpa = flex_and_sdpa_models(mask_mode, precision)
    input_ids, position_ids = packed_row(FLEX_LENGTHS, seed=4)
    embeds = flex.model.embed_tokens(precision.to_device(input_ids))
    block_mask = create_iha_masks(flex.config, embeds, None, None, precision.to_device(position_ids))
    block_mask = block_mask["iha_full_attention"]
    # Query blocks see only the key blocks of their own document: 1 + 2 + 1 + 1 + 1 + 2 = 8 blocks, where causal
    # attention over the row computes 1 + 2 + ... + 6 = 21.
    full_blocks = 0 if block_mask.full_kv_num_blocks is None else block_mask.full_kv_num_blocks.sum().item()
    assert block_mask.kv_num_blocks.sum().item() + full_blocks == 8
    with torch.no_grad():
        logits = run_flex(flex, input_ids, position_ids, precision).double().cpu()
        sdpa = sdpa.double()
        masks = dense_masks(sdpa, FLEX_LENGTHS)
        dense = sdpa(input_ids, position_ids=position_ids, attention_mask=masks, use_cache=False).logits
        expected = reference_per_document(sdpa, input_ids, FLEX_LENGTHS)
    precision.assert_close(logits, dense, rtol=1e-4, atol=1e-5)
    precision.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_flex_attention_gradients_on_packed_rows_match_the_per_document_path(precision):
    require_flex_backward(precision)
    flex, sdpa = flex_and_sdpa_models("flat_causal", precision)
    sdpa = precision.model(sdpa).train()
    flex.train()
    input_ids, position_ids = precision.to_device(*packed_row(FLEX_LENGTHS, seed=4))
    for model in (flex, sdpa):
        model(input_ids, position_ids=position_ids, labels=input_ids, use_cache=False).loss.backward()
    for (name, flex_parameter), sdpa_parameter in zip(flex.named_parameters(), sdpa.parameters()):
        scale = sdpa_parameter.grad.abs().max().item()
        precision.assert_close(
            flex_parameter.grad, sdpa_parameter.grad, rtol=1e-3, atol=1e-4 * scale, msg=name, gradient=True
        )


@pytest.mark.slow
@pytest.mark.parametrize("masks", ["sliding"])
def test_flex_attention_with_a_sliding_window_matches_the_reference(masks, precision):
    # (The documents case is the test above.)
    layout, lengths = FLEX_REFERENCE_CASES[masks]
    flex, sdpa = flex_and_sdpa_models("flat_causal", precision, **layout)
    input_ids, position_ids = packed_row(lengths, seed=7)
    with torch.no_grad():
        logits = run_flex(flex, input_ids, position_ids, precision).double()
        expected = reference_per_document(sdpa.double(), input_ids, lengths)
    precision.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masks", list(FLEX_REFERENCE_CASES))
def test_flex_attention_gradients_match_the_reference(masks, precision):
    require_flex_backward(precision)
    layout, lengths = FLEX_REFERENCE_CASES[masks]
    flex, sdpa = flex_and_sdpa_models("flat_causal", precision, **layout)
    reference_model = sdpa.double().train()
    flex.train()
    input_ids, position_ids = packed_row(lengths, seed=7)
    weights = torch.randn(sum(lengths), TINY["vocab_size"], generator=torch.Generator().manual_seed(5)).double()
    logits = run_flex(flex, input_ids, position_ids, precision)[0]
    (logits * precision.to_device(weights.to(logits.dtype))).sum().backward()
    expected = reference_per_document(reference_model, input_ids, lengths)[0]
    (expected * weights).sum().backward()
    precision.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    for (name, flex_parameter), reference_parameter in zip(flex.named_parameters(), reference_model.parameters()):
        scale = reference_parameter.grad.abs().max().item()
        precision.assert_close(
            flex_parameter.grad, reference_parameter.grad, rtol=1e-4, atol=1e-4 * scale, msg=name, gradient=True
        )


# --- FlashAttention: varlen over cumulative lengths in virtual units ------------------------------------------------


def test_flash_attention_on_packed_rows_matches_reference():
    pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("FlashAttention needs a CUDA device")
    lengths = [40, 17, 33]
    input_ids, position_ids = packed_row(lengths, seed=6)
    model = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=2)
    flash = tiny_iha_model(num_key_value_heads=2, num_pseudo_heads=2, attn_implementation="flash_attention_2")
    flash.load_state_dict(model.state_dict())
    flash = flash.to("cuda", torch.bfloat16).train()
    logits = flash(input_ids.cuda(), position_ids=position_ids.cuda(), use_cache=False).logits
    with torch.no_grad():
        expected = reference_per_document(model.double(), input_ids, lengths)
    torch.testing.assert_close(logits.detach().double().cpu(), expected, rtol=0.05, atol=0.05)
    # Gradients reach the mixing on the varlen path, and agree with the SDPA path in bfloat16 on the same device.
    logits.float().square().mean().backward()
    sdpa = model.float().to("cuda", torch.bfloat16).train()
    sdpa(input_ids.cuda(), position_ids=position_ids.cuda(), use_cache=False).logits.float().square().mean().backward()
    for (name, flash_parameter), sdpa_parameter in zip(flash.named_parameters(), sdpa.parameters()):
        scale = sdpa_parameter.grad.float().abs().max().item()
        torch.testing.assert_close(
            flash_parameter.grad.float(), sdpa_parameter.grad.float(), rtol=0.1, atol=0.05 * scale, msg=name
        )
