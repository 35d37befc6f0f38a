"""Sliding IHA layers on vLLM (the paper's flat window: virtual query i sees virtual keys i - W * P < j <= i) run on
the stock kernel's own window over the virtual sequence, with a sliding-window KV cache that frees the blocks leaving
the window: greedy tokens equal `generate()` in float32 and log-probabilities within 1e-4 of the float64 reference,
for P = 1, 2 and 3, GQA and MHA, shared and virtual positions, windows of 8 to 64 tokens with prompts of 3 to 400
tokens prefilled in chunks of 32 (which cross the window's edge), prefix caching on and off, requests joining and
leaving, one request decoding hundreds of tokens past its window; in the paper's hybrid layout (IHA sliding layers
with a standard global layer) and beside standard sliding and IHA global layers. Each layer's `IHALayerSpec` is the
object its backend and the backend's metadata builder read.

On a CUDA GPU (the GPU check's vllm step) the same tests run FlashAttention's window, in bfloat16.
"""

import pytest


pytest.importorskip("vllm")

from vllm_cases import (  # noqa: E402
    assert_follows_the_reference,
    completions,
    engine_dtype,
    greedy,
    reference_greedy,
    reference_model,
    run_batch,
    run_staggered,
    tiny_iha_folder,
    tokens_prompt,
    vllm_engine,
)

from iha.models.iha.layer_iha import paper_hybrid_layout  # noqa: E402


BLOCK_SIZE = 32
CASES = {
    # The paper's hybrid: 4 sliding IHA layers, then a standard global one; W = 64 / (2 P^2) = 8 tokens.
    "paper-hybrid-gqa-shared-P2-W8": dict(
        num_hidden_layers=5,
        num_pseudo_heads=2,
        iha_position_mode="shared",
        **paper_hybrid_layout(5, 2, training_length=64),
    ),
    # Beside a standard sliding layer (window W tokens) and an IHA global layer; MHA, P = 3, global collapse.
    "mha-virtual-P3-W16-mixed": dict(
        num_hidden_layers=4,
        num_pseudo_heads=3,
        num_key_value_heads=4,
        iha_position_mode="virtual",
        iha_collapse_mode="global",
        attention_types=["iha_sliding_attention", "sliding_attention", "iha_full_attention", "iha_sliding_attention"],
        sliding_window=16,
    ),
    # One pseudo-head: the flat window is the source's window of W tokens, and so is the cache (no token more).
    "gqa-shared-P1-W8": dict(
        num_pseudo_heads=1,
        iha_position_mode="shared",
        attention_types=["iha_sliding_attention", "iha_full_attention"],
        sliding_window=8,
    ),
    # A window of two blocks, Qwen3's q/k norm (the explicit mixing), prompts up to 400 tokens.
    "gqa-virtual-P2-W64-qk-norm": dict(
        num_pseudo_heads=2,
        iha_position_mode="virtual",
        use_qk_norm=True,
        attention_types=["iha_sliding_attention", "iha_sliding_attention"],
        sliding_window=64,
    ),
}
FOLDED_AND_EXPLICIT = [
    pytest.param(case, fold, id=f"{case}-{'folded' if fold else 'explicit'}")
    for case in CASES
    for fold in ((False,) if "qk-norm" in case else (True,) if "P1" in case else (True, False))
]

# Prompts of 3 to 400 tokens together, each with its own number of new tokens (they leave at different steps).
PROMPTS = [
    [5, 6, 7],
    [(11 * i) % 251 + 2 for i in range(37)],
    [(5 * i + 3) % 249 + 4 for i in range(100)],
    [(7 * i + 1) % 247 + 3 for i in range(400)],
]
LENGTHS = [40, 12, 20, 9]
# Two prompts sharing their first 200 tokens with PROMPTS[3], run one after the other after it: the second reads the
# blocks of the first from the cache. (vLLM 0.32.0 reads none of PROMPTS[3]'s own blocks for the first: it keeps no
# hits for blocks that left a sliding window during a request; measured the same for its own Llama with sliding
# layers.) vLLM reads a hybrid model's prefix in multiples of every group's block size: with P = 3 the standard
# layers' blocks hold 96 tokens (the same bytes as the IHA layers' blocks of 32), so 192 of the 200 in every case.
SHARED_PREFIX_PROMPTS = [PROMPTS[3][:200] + [9, 8, 7], PROMPTS[3][:200] + list(range(40, 60))]
SHARED_PREFIX_LENGTHS = [10, 7]
JOINING_PROMPTS = [PROMPTS[1], [21, 22, 23], PROMPTS[2][:45]]
JOINING_LENGTHS = [14, 9, 6]
JOIN_STEPS = [0, 3, 5]
# One request decoding hundreds of tokens past its window (W = 8 in the hybrid: 37 windows).
LONG_DECODE = ([9, 4, 2], 300)
ENGINE = dict(max_model_len=512, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    prepared = {}
    for case, overrides in CASES.items():
        folder = tiny_iha_folder(tmp_path_factory.mktemp(case), max_position_embeddings=512, **overrides)
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


def test_the_window_and_its_width_change_the_reference_tokens(folders, tmp_path):
    """Equal tokens below mean the flat window of W * P virtual tokens was applied: the same weights with the IHA
    layers global, or with a window one token narrower (W - 1), decode other tokens."""
    case = "paper-hybrid-gqa-shared-P2-W8"
    _, _, expected = folders[case]
    global_layers = {**CASES[case], "attention_types": ["iha_full_attention"] * 4 + ["full_attention"]}
    narrower = {**CASES[case], "sliding_window": CASES[case]["sliding_window"] - 1}
    global_model = reference_model(tiny_iha_folder(tmp_path / "global", max_position_embeddings=512, **global_layers))
    narrower_model = reference_model(tiny_iha_folder(tmp_path / "narrower", max_position_embeddings=512, **narrower))
    for other in (global_model, narrower_model):
        assert [reference_greedy(other, prompt, n) for prompt, n in zip(PROMPTS, LENGTHS)] != expected["batch"]


def sliding_groups(llm) -> list[tuple[str, int | None, list[str]]]:
    """The engine's KV-cache groups: (spec class, its window in tokens, the layers)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return [
        (type(group.kv_cache_spec).__name__, getattr(group.kv_cache_spec, "sliding_window", None), group.layer_names)
        for group in scheduler.kv_cache_config.kv_cache_groups
    ]


def spec_holders(worker) -> list[dict]:
    """In the running engine's worker, for every layer of a KV-cache group on an IHA backend: the layer's
    `IHALayerSpec` (`IHAAttention.spec`), and whether its backend implementation and its group's metadata builder
    hold that very object."""
    runner = worker.model_runner
    model = runner.get_model()
    held = []
    for groups in runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if not hasattr(builder, "iha_layer"):  # a standard layer's group
                    continue
                for name in group.layer_names:
                    layer = model.get_submodule(name.removesuffix(".attn"))
                    held.append(
                        dict(
                            layer=int(name.split(".")[2]),
                            spec=layer.spec,
                            first_of_group=name == group.layer_names[0],
                            group_size=len(group.layer_names),
                            implementation_holds_it=layer.attn.impl.iha_layer is layer.spec,
                            builder_holds_it=builder.iha_layer is layer.spec,
                            builder_holds_its_equal=builder.iha_layer == layer.spec,
                        )
                    )
    return held


@pytest.mark.parametrize("layout", ["sliding-standard-and-global-P3", "global-P2"])
def test_each_layer_its_implementation_and_builder_share_the_layers_spec(layout, folders, tmp_path):
    """The spec an IHA layer builds once is the object its backend implementation holds and the one its KV-cache
    group's metadata builder reads back (a group of several layers: the first layer's, the others' equal to it). For
    sliding IHA layers beside a standard sliding and an IHA global layer at P = 3 (a group per layer), and for a
    model of two global IHA layers (one group of both)."""
    if layout == "global-P2":
        model = reference_model(tiny_iha_folder(tmp_path, num_pseudo_heads=2))
        folder, iha_layers, cache_windows, group_sizes = tmp_path, [0, 1], {None}, [2]
    else:
        folder, model, _ = folders["mha-virtual-P3-W16-mixed"]
        iha_layers, cache_windows, group_sizes = [0, 2, 3], {17, None}, [1, 1, 1]  # W + 1 = 17 tokens of cache
    with vllm_engine(folder, **ENGINE) as llm:
        (held,) = llm.collective_rpc(spec_holders)
    assert sorted(entry["layer"] for entry in held) == model.config.iha_layer_indices == iha_layers
    assert sorted(entry["group_size"] for entry in held if entry["first_of_group"]) == group_sizes
    for entry in held:
        assert entry["spec"] == model.config.layer_spec(entry["layer"])
        assert entry["implementation_holds_it"] and entry["builder_holds_its_equal"], entry
        assert entry["builder_holds_it"] or not entry["first_of_group"], entry
    assert {entry["spec"].cache_window for entry in held} == cache_windows


@pytest.mark.parametrize(("case", "fold"), FOLDED_AND_EXPLICIT)
def test_greedy_tokens_and_logprobs_equal_the_reference(case, fold, folders):
    folder, model, expected = folders[case]
    dtype = engine_dtype()
    window = CASES[case]["sliding_window"]
    with vllm_engine(folder, hf_overrides={"iha_fold_mixing": fold}, **ENGINE) as llm:
        # Sliding IHA layers keep W + 1 tokens at P > 1 (W at P = 1), standard sliding layers W, in caches of their own.
        iha_cache_window = window + 1 if CASES[case]["num_pseudo_heads"] > 1 else window
        for spec, spec_window, layers in sliding_groups(llm):
            kinds = {model.config.attention_types[int(name.split(".")[2])] for name in layers}
            if kinds == {"iha_sliding_attention"}:
                assert (spec, spec_window) == ("SlidingWindowSpec", iha_cache_window)
            elif kinds == {"sliding_attention"}:
                assert (spec, spec_window) == ("SlidingWindowSpec", window)
            else:
                assert spec == "FullAttentionSpec" and kinds <= {"iha_full_attention", "full_attention"}

        outputs = run_batch(llm, PROMPTS, LENGTHS, logprobs=1)
        assert_follows_the_reference(model, PROMPTS, completions(outputs), expected["batch"], dtype)

        shared = [
            run_batch(llm, [prompt], [length], logprobs=1)[0]
            for prompt, length in zip(SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS)
        ]
        assert shared[1].num_cached_tokens == 192
        assert_follows_the_reference(
            model, SHARED_PREFIX_PROMPTS, completions(shared), expected["shared_prefix"], dtype
        )

        joined = run_staggered(llm, JOINING_PROMPTS, JOINING_LENGTHS, JOIN_STEPS, logprobs=1)
        joined = [joined[index] for index in range(len(JOINING_PROMPTS))]
        assert_follows_the_reference(model, JOINING_PROMPTS, joined, expected["joining"], dtype)


def test_prefix_caching_off(folders):
    folder, model, expected = folders["mha-virtual-P3-W16-mixed"]
    with vllm_engine(folder, enable_prefix_caching=False, **ENGINE) as llm:
        run_batch(llm, PROMPTS[3:], LENGTHS[3:])
        shared = [
            run_batch(llm, [prompt], [length], logprobs=1)[0]
            for prompt, length in zip(SHARED_PREFIX_PROMPTS, SHARED_PREFIX_LENGTHS)
        ]
    assert [output.num_cached_tokens for output in shared] == [0, 0]
    assert_follows_the_reference(
        model, SHARED_PREFIX_PROMPTS, completions(shared), expected["shared_prefix"], engine_dtype()
    )


def blocks_held(llm) -> list[int]:
    """Blocks each KV-cache group holds for the one running request (a block that left a window is vLLM's null
    block, holding nothing)."""
    managers = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers
    return [
        sum(not block.is_null for blocks in manager.req_to_blocks.values() for block in blocks) for manager in managers
    ]


def test_one_request_decodes_hundreds_of_tokens_past_its_window_in_bounded_cache(folders):
    """The hybrid's sliding IHA layers hold at most the blocks of W + 1 tokens (here 2 blocks of 32: the window's
    tokens may straddle a block edge) while the global layer's cache grows with the context; the tokens stay the
    reference's."""
    folder, model, _ = folders["paper-hybrid-gqa-shared-P2-W8"]
    prompt, length = LONG_DECODE
    wanted = reference_greedy(model, prompt, length)
    with vllm_engine(folder, **ENGINE) as llm:
        groups = sliding_groups(llm)
        engine = llm.llm_engine
        engine.add_request("long", tokens_prompt(prompt), greedy(length, logprobs=1))
        most_held = [0] * len(groups)
        completion = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    completion = output.outputs[0]
            most_held = [max(most, held) for most, held in zip(most_held, blocks_held(llm))]
    for (spec, _, _), most in zip(groups, most_held):
        if spec == "SlidingWindowSpec":
            assert most <= 2, f"a sliding IHA group held {most} blocks"
        else:
            assert most >= 4, f"the global group held only {most} blocks for {len(prompt) + length} tokens"
    assert_follows_the_reference(model, [prompt], [completion], [wanted], engine_dtype())
