"""Stock vLLM serves what `iha export llama` writes: a P = 1 IHA folder folded into a stock Llama (and Qwen2) folder
gives the IHA folder's greedy tokens (`IHAForCausalLM.generate()`) on vLLM's own Llama / Qwen2 classes, no IHA code
involved. `make vllm-test` runs it in the vLLM environment."""

import json

import pytest


pytest.importorskip("vllm")

import torch  # noqa: E402
from testing_utils import randomize_mixing  # noqa: E402
from vllm_cases import TINY_VLLM, reference_greedy, run_batch, vllm_engine  # noqa: E402

import iha  # noqa: E402
from iha.export import export_llama  # noqa: E402


CASES = {
    # Exported as a Llama (no conversion report: the config says Llama), GQA, global collapse.
    "llama-gqa-global": dict(iha_collapse_mode="global"),
    # q/k/v biases without an o_proj bias read as Qwen2; untied head.
    "qwen2-bias-untied": dict(qkv_bias=True, o_proj_bias=False, tie_word_embeddings=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stock_vllm_serves_the_exported_folder(case, tmp_path):
    torch.manual_seed(0)
    model = iha.IHAForCausalLM(iha.IHAConfig(**{**TINY_VLLM, "num_pseudo_heads": 1, **CASES[case]})).eval()
    randomize_mixing(model, scale=0.5)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "iha")
    report = export_llama(tmp_path / "iha", tmp_path / "stock")
    architecture = json.loads((tmp_path / "stock" / "config.json").read_text())["architectures"][0]
    assert architecture == report.architecture == ("Qwen2ForCausalLM" if "qwen2" in case else "LlamaForCausalLM")

    prompts = [[1, 5, 7, 9], list(range(3, 40)), [11] * 3 + list(range(20, 60))]
    lengths = [16, 12, 20]
    expected = [reference_greedy(model, prompt, length) for prompt, length in zip(prompts, lengths)]
    with vllm_engine(tmp_path / "stock") as llm:
        config_class = type(llm.llm_engine.model_config.hf_config).__name__
        outputs = run_batch(llm, prompts, lengths)
    assert config_class in ("LlamaConfig", "Qwen2Config")
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
