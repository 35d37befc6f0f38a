"""Tensor parallelism on two CPU ranks: the folded projections shard by KV group like Llama's (each rank holds whole
heads with all their pseudo-heads, and `o_proj`'s partial sums reduce across ranks), and the greedy tokens equal
`generate()` on one process. The ranks are processes of their own (vLLM's multiprocessing executor, gloo)."""

import pytest


pytest.importorskip("vllm")

from vllm_cases import (  # noqa: E402
    PROMPTS_FOR_PARALLELISM,
    reference_greedy,
    reference_model,
    run_batch,
    tiny_iha_folder,
    vllm_engine,
)


LENGTHS = [10, 6, 12]


@pytest.mark.slow
def test_two_ranks_decode_what_generate_decodes(tmp_path):
    folder = tiny_iha_folder(
        tmp_path,
        num_pseudo_heads=2,
        iha_position_mode="virtual",
        iha_collapse_mode="global",  # every head's output reads the pseudo-outputs of heads on the other rank
        qkv_bias=True,
    )
    model = reference_model(folder)
    expected = [reference_greedy(model, prompt, length) for prompt, length in zip(PROMPTS_FOR_PARALLELISM, LENGTHS)]
    with vllm_engine(folder, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outputs = run_batch(llm, PROMPTS_FOR_PARALLELISM, LENGTHS)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
