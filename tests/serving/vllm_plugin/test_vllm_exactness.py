"""vLLM serving IHA folders computes what `IHAForCausalLM.generate()` computes: equal greedy tokens in float32 and
log-probabilities within 1e-4 of the float64 reference, on random (non-identity) mixing, for the layouts the plugin
serves (GQA and MHA, P = 2 and 3, shared and virtual positions, per-head and global collapse, Qwen2 biases, tied
and untied embeddings, standard layers among IHA ones, Qwen3's q/k norm, SmolLM3's NoPE layers), folded and with
the explicit mixing, under what vLLM does to a batch: prompts of different lengths together, prefill in chunks of
32 tokens, prefixes read from the cache, requests joining and leaving a running batch, one request decoding alone.

Each engine runs in this process (`vllm_cases.vllm_engine`); `make vllm-test` runs these in the vLLM environment, on
vLLM's CPU backend. On a CUDA GPU (the GPU check's vllm step) the same tests run the FlashAttention backend, in
bfloat16, the only precision it has besides float16: every token there is the float64 reference's best, or within
bf16 rounding of it, after the same prefix.
"""

import pytest


pytest.importorskip("vllm")

from safetensors import safe_open  # noqa: E402
from vllm_cases import (  # noqa: E402
    assert_follows_the_reference,
    completions,
    engine_dtype,
    reference_greedy,
    reference_model,
    run_batch,
    run_staggered,
    tiny_iha_folder,
    vllm_engine,
)


CASES = {
    # The converter's layout (shared positions, per-head collapse), GQA, tied embeddings.
    "gqa-shared-P2": dict(num_pseudo_heads=2, iha_position_mode="shared"),
    "mha-virtual-P3-global-qwen2-bias-untied": dict(
        num_pseudo_heads=3,
        iha_position_mode="virtual",
        num_key_value_heads=4,
        iha_collapse_mode="global",
        qkv_bias=True,
        o_proj_bias=False,
        tie_word_embeddings=False,
    ),
    "standard-and-iha-layers": dict(
        num_hidden_layers=4,
        num_pseudo_heads=2,
        iha_position_mode="virtual",
        attention_types=["iha_full_attention", "full_attention", "sliding_attention", "iha_full_attention"],
        sliding_window=24,
    ),
    # The mixing cannot fold through the per-head norm: the explicit path either way.
    "qwen3-qk-norm": dict(num_pseudo_heads=2, iha_position_mode="virtual", use_qk_norm=True),
    "smollm3-nope-biases": dict(
        num_hidden_layers=3,
        num_pseudo_heads=3,
        iha_position_mode="shared",
        no_rope_layers=[1, 0, 1],
        attention_bias=True,
        mlp_bias=True,
    ),
}
FOLDED_AND_EXPLICIT = [
    pytest.param(case, fold, id=f"{case}-{'folded' if fold else 'explicit'}")
    for case in CASES
    for fold in ((False,) if "qk-norm" in case else (True, False))
]

# Prompts of 1 to 100 tokens in one batch, each with its own number of new tokens: they leave at different steps,
# and the longest decodes its last 8 tokens alone.
PROMPTS = [[7], [3, 1, 4, 1, 5], [(11 * i) % 251 + 2 for i in range(37)], [(5 * i + 3) % 249 + 4 for i in range(100)]]
LENGTHS = [24, 6, 12, 16]
# Prompts sharing their first 70 tokens with PROMPTS[3] (two blocks of 32 come from the cache), run after it.
SHARED_PREFIX_PROMPTS = [PROMPTS[3][:70] + [9, 8, 7], PROMPTS[3][:70] + list(range(40, 60))]
SHARED_PREFIX_LENGTHS = [10, 7]
# Requests joining the running engine at steps 0, 3 and 5.
JOINING_PROMPTS = [PROMPTS[2], [21, 22, 23], PROMPTS[3][:45]]
JOINING_LENGTHS = [14, 9, 6]
JOIN_STEPS = [0, 3, 5]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each case's folder with its reference: greedy tokens of every prompt, run alone with `generate()`."""
    prepared = {}
    for case, overrides in CASES.items():
        folder = tiny_iha_folder(tmp_path_factory.mktemp(case), **overrides)
        model = reference_model(folder)
        runs = {
            "batch": (PROMPTS, LENGTHS),
            "shared_prefix": (SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS),
            "joining": (JOINING_PROMPTS, JOINING_LENGTHS),
        }
        expected = {
            name: [reference_greedy(model, prompt, length) for prompt, length in zip(prompts, lengths)]
            for name, (prompts, lengths) in runs.items()
        }
        prepared[case] = folder, model, expected
    return prepared


@pytest.mark.parametrize("case", CASES)
def test_the_mixing_changes_the_reference_tokens(case, folders):
    """Equal tokens below mean something: with identity mixing the reference decodes other tokens."""
    folder, _, expected = folders[case]
    identity = reference_model(folder, identity_mixing=True)
    unmixed = [reference_greedy(identity, prompt, length) for prompt, length in zip(PROMPTS, LENGTHS)]
    assert unmixed != expected["batch"]


@pytest.mark.parametrize(("case", "fold"), FOLDED_AND_EXPLICIT)
def test_greedy_tokens_and_logprobs_equal_the_reference(case, fold, folders):
    folder, model, expected = folders[case]
    dtype = engine_dtype()
    with vllm_engine(folder, hf_overrides={"iha_fold_mixing": fold}) as llm:
        # Which path the layers took (standard layers never fold).
        folding = llm.apply_model(lambda vllm_model: {layer.self_attn.fold_mixing for layer in vllm_model.model.layers})
        assert folding == [{fold, False} if "standard" in case else {fold}]
        outputs = run_batch(llm, PROMPTS, LENGTHS, logprobs=1)
        assert_follows_the_reference(model, PROMPTS, completions(outputs), expected["batch"], dtype)

        shared = run_batch(llm, SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS, logprobs=1)
        assert [output.num_cached_tokens for output in shared] == [64, 64]  # two blocks of 32 from the cache
        assert_follows_the_reference(
            model, SHARED_PREFIX_PROMPTS, completions(shared), expected["shared_prefix"], dtype
        )

        joined = run_staggered(llm, JOINING_PROMPTS, JOINING_LENGTHS, JOIN_STEPS, logprobs=1)
        joined = [joined[index] for index in range(len(JOINING_PROMPTS))]
        assert_follows_the_reference(model, JOINING_PROMPTS, joined, expected["joining"], dtype)

        alone = run_batch(llm, [PROMPTS[0]], [LENGTHS[0]], logprobs=1)  # a one-token prompt decoding alone
        assert_follows_the_reference(model, [PROMPTS[0]], completions(alone), expected["batch"][:1], dtype)


def test_prefix_caching_off(folders):
    folder, model, expected = folders["mha-virtual-P3-global-qwen2-bias-untied"]
    with vllm_engine(folder, enable_prefix_caching=False) as llm:
        run_batch(llm, PROMPTS[3:], LENGTHS[3:])
        shared = run_batch(llm, SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS, logprobs=1)
        assert [output.num_cached_tokens for output in shared] == [0, 0]
        assert_follows_the_reference(
            model, SHARED_PREFIX_PROMPTS, completions(shared), expected["shared_prefix"], engine_dtype()
        )


def test_bf16_weights_with_fp32_mixing(tmp_path):
    """A folder as the converter writes a bf16 checkpoint (bf16 weights, the mixing in fp32 beside them), served in
    float32 (bfloat16 on a GPU): what transformers decodes from the same folder in float32."""
    import torch

    folder = tiny_iha_folder(tmp_path, dtype=torch.bfloat16, num_pseudo_heads=2, iha_position_mode="virtual")
    with safe_open(folder / "model.safetensors", "pt") as weights:
        dtypes = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert {dtype for name, dtype in dtypes.items() if ".head_mixing." in name} == {"F32"}
    assert {dtype for name, dtype in dtypes.items() if ".head_mixing." not in name} == {"BF16"}
    model = reference_model(folder)
    expected = [reference_greedy(model, prompt, length) for prompt, length in zip(PROMPTS, LENGTHS)]
    with vllm_engine(folder) as llm:
        outputs = run_batch(llm, PROMPTS, LENGTHS, logprobs=1)
    assert_follows_the_reference(model, PROMPTS, completions(outputs), expected, engine_dtype())


def test_bfloat16_engine_follows_the_float64_reference(folders):
    """In bfloat16 (on CPUs with AMX the kernel lays its blocks out differently, read here through the same virtual
    view), with prefixes read from the cache: every greedy token is the reference's best or within bf16 rounding of
    it, and the log-probabilities stay within bf16 rounding of the float64 reference."""
    folder, model, expected = folders["gqa-shared-P2"]
    with vllm_engine(folder, dtype="bfloat16") as llm:
        outputs = run_batch(llm, PROMPTS, LENGTHS, logprobs=1)
        shared = run_batch(llm, SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS, logprobs=1)
    assert_follows_the_reference(model, PROMPTS, completions(outputs), expected["batch"], "bfloat16")
    assert [output.num_cached_tokens for output in shared] == [64, 64]
    assert_follows_the_reference(
        model, SHARED_PREFIX_PROMPTS, completions(shared), expected["shared_prefix"], "bfloat16"
    )
