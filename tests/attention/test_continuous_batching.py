"""Continuous batching (`generate_batch`, the manager behind `transformers serve --continuous-batching`) against
`generate()`: IHA layers write un-mixed keys and values through the paged cache, mix what they read back and attend
request by request, each request's causal pattern widened to pseudo-tokens (iha/attention/continuous_batching.py, the
installed package's; a folder loaded without it refuses continuous batching: tests/models/iha/test_remote_code.py).

Every run passes a small `ContinuousBatchingConfig`: an unsized paged cache takes about 90% of free memory.
"""

import time

import pytest
import torch
from testing_utils import TINY, tiny_iha_model
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching import PagedAttentionCache

import iha
from iha.attention import continuous_batching as serving_iha
from iha.models.iha.layer_iha import IHALayerSpec


# A cache of 8 pages of 16 tokens per layer and at most 16 new tokens per forward: prompts are prefilled in chunks,
# requests decode side by side, and they join and leave the batch at different steps.
SMALL_CACHE = dict(num_blocks=8, page_size=16, max_batch_tokens=16)
RESULT_DEADLINE_SECONDS = 120

LAYOUTS = {
    "flat": dict(),
    "token-causal": dict(iha_mask_mode="token_causal"),
    "gqa": dict(num_key_value_heads=2),
    # The paged cache holds un-mixed keys and values whatever the cache mode says.
    "virtual-positions-pseudo-cache-mode": dict(
        iha_position_mode="virtual", num_pseudo_heads=3, iha_cache_mode="pseudo"
    ),
    # The paper's window: the sliding pages keep one token more (prompts and decoding past W = 3).
    "hybrid": dict(
        num_hidden_layers=5, **iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=24)
    ),
    "hybrid-token-causal": dict(
        num_hidden_layers=5,
        iha_mask_mode="token_causal",
        num_key_value_heads=2,
        **iha.paper_hybrid_layout(num_hidden_layers=5, num_pseudo_heads=2, training_length=24),
    ),
    # Standard sliding layers beside sliding IHA layers, whose pages keep one token more (past W = 3).
    "standard-sliding-token-causal-p3": dict(
        num_hidden_layers=4,
        num_pseudo_heads=3,
        num_key_value_heads=2,
        iha_mask_mode="token_causal",
        sliding_window=3,
        attention_types=["iha_sliding_attention", "full_attention", "sliding_attention", "iha_full_attention"],
    ),
}


def prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (length,), generator=generator).tolist() for length in lengths]


def greedy_config(max_new_tokens):
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def generate_reference(model, prompt, max_new_tokens):
    """The tokens `generate()` decodes greedily for one prompt, alone (DynamicCache, no padding)."""
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return output[0, len(prompt) :].tolist()


def serve_in_two_waves(model, first_wave, second_wave):
    """Run requests (prompt, max_new_tokens) through one continuous batching manager: the first wave at once, the
    second once a first request has finished, so requests join a running batch and leave it at different steps.
    Returns the generated tokens per request, in the order given."""
    requests = {}
    results = {}
    deadline = time.monotonic() + RESULT_DEADLINE_SECONDS

    def collect(count):
        while len(results) < count:
            assert time.monotonic() < deadline, f"only {len(results)} of {count} requests finished in time"
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result.generated_tokens

    with model.continuous_batching_context_manager(
        generation_config=greedy_config(max(n for _, n in first_wave + second_wave)),
        continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
        block=True,
        timeout=10,
    ) as manager:
        for prompt, max_new_tokens in first_wave:
            requests[manager.add_request(prompt, max_new_tokens=max_new_tokens)] = (prompt, max_new_tokens)
        collect(1)
        for prompt, max_new_tokens in second_wave:
            requests[manager.add_request(prompt, max_new_tokens=max_new_tokens)] = (prompt, max_new_tokens)
        collect(len(requests))
    return [results[request_id] for request_id in requests]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])  # what the engine offers on CPU (eager: paged|eager)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_requests_joining_and_leaving_decode_what_generate_decodes(layout, attn_implementation):
    options = {"num_pseudo_heads": 2, **LAYOUTS[layout]}
    model = tiny_iha_model(attn_implementation=attn_implementation, **options)  # random, trained-looking mixing
    first_wave = list(zip(prompts([5, 19, 3]), [14, 6, 10]))
    second_wave = list(zip(prompts([11, 2], seed=2), [9, 12]))
    batched = serve_in_two_waves(model, first_wave, second_wave)
    expected = [generate_reference(model, prompt, n) for prompt, n in first_wave + second_wave]
    assert batched == expected
    assert model.config._attn_implementation == attn_implementation  # the engine gave the implementation back


def test_generate_batch_decodes_what_generate_decodes():
    model = tiny_iha_model(num_pseudo_heads=2, num_key_value_heads=2)
    batch = prompts([7, 4, 12, 1, 9])
    outputs = model.generate_batch(
        batch, generation_config=greedy_config(8), continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE)
    )
    assert [output.generated_tokens for output in outputs.values()] == [
        generate_reference(model, prompt, 8) for prompt in batch
    ]


def test_identity_mixing_decodes_what_the_llama_decodes():
    # A converted model at identity mixing is its source model: continuous batching must keep that too.
    shape = {key: TINY[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model = iha.IHAForCausalLM(iha.IHAConfig(**shape, num_pseudo_heads=2)).eval()
    model.load_state_dict(llama.state_dict(), strict=False)
    batch = prompts([6, 13, 2])
    config = ContinuousBatchingConfig(**SMALL_CACHE)
    llama_outputs = llama.generate_batch(batch, generation_config=greedy_config(10), continuous_batching_config=config)
    iha_outputs = model.generate_batch(batch, generation_config=greedy_config(10), continuous_batching_config=config)
    assert [o.generated_tokens for o in iha_outputs.values()] == [o.generated_tokens for o in llama_outputs.values()]


def test_paged_cache_is_sized_in_tokens_like_the_llama(monkeypatch):
    """The pages hold un-mixed keys and values (in pseudo cache mode too): the same bytes as the base model's."""
    caches = []
    original_init = PagedAttentionCache.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(self)

    monkeypatch.setattr(PagedAttentionCache, "__init__", recording_init)
    shape = dict(TINY, num_key_value_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model = tiny_iha_model(num_pseudo_heads=4, num_key_value_heads=2, iha_cache_mode="pseudo")
    config = ContinuousBatchingConfig(**SMALL_CACHE)
    for each in (llama, model):
        each.generate_batch(prompts([5]), generation_config=greedy_config(2), continuous_batching_config=config)
    llama_cache, iha_cache = caches
    assert iha_cache.cache_tensor.nbytes == llama_cache.cache_tensor.nbytes
    assert iha_cache.num_blocks == llama_cache.num_blocks


def test_the_engine_does_not_switch_iha_to_flash():
    config = ContinuousBatchingConfig(**SMALL_CACHE)
    assert config.auto_switch_to_flash
    used = serving_iha.continuous_batching_config_for_iha(config)
    assert used.auto_switch_to_flash is False
    assert config.auto_switch_to_flash, "the caller's config must not change"
    assert used.num_blocks == config.num_blocks
    assert serving_iha.continuous_batching_config_for_iha(None).auto_switch_to_flash is False


def test_flash_attention_under_continuous_batching_is_refused():
    model = tiny_iha_model(num_pseudo_heads=2)
    # What a model loaded with FlashAttention looks like to the engine (no flash kernel on a CPU machine).
    model.config._attn_implementation_internal = "flash_attention_2"
    outputs = model.generate_batch(
        prompts([4]),
        generation_config=greedy_config(3),
        continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
    )
    (output,) = outputs.values()
    assert output.generated_tokens == []
    assert "FlashAttention's paged path" in output.error
    assert "attn_implementation='sdpa'" in output.error


def test_sliding_windows_under_continuous_batching_need_the_fixed_release():
    # Before 5.16 the engine's sliding pages read back the wrong tokens (a stock Mistral decodes wrongly too).
    with pytest.raises(ValueError, match=r"fixed in 5\.16\.0.*pip install 'transformers>=5\.16\.0"):
        serving_iha.check_paged_sliding_window("5.15.1")
    serving_iha.check_paged_sliding_window("5.16.0")
    serving_iha.check_paged_sliding_window("5.24.0")


@pytest.mark.parametrize("mask_mode", ["flat_causal", "token_causal"])
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("query_len, key_len", [(1, 1), (1, 7), (4, 4), (3, 9)])
def test_a_request_mask_is_the_reference_mask_of_its_new_tokens(query_len, key_len, sliding_window, mask_mode):
    """A request with key_len - query_len cached tokens: its mask is the last query_len tokens' rows of the plain
    reference mask over all its tokens (None when those rows hide nothing)."""
    from iha.models.iha.naive_iha import reference_mask

    num_pseudo = 3
    attention_type = "iha_full_attention" if sliding_window is None else "iha_sliding_attention"
    spec = IHALayerSpec(attention_type, num_pseudo, sliding_window, mask_mode=mask_mode)
    mask = serving_iha.request_pseudo_mask(query_len, key_len, spec, torch.device("cpu"))
    expected = reference_mask(key_len, num_pseudo, mask_mode, sliding_window, None)[
        0, (key_len - query_len) * num_pseudo :
    ]
    if mask is None:
        assert expected.all()
    else:
        assert torch.equal(mask[0, 0], expected)


def test_the_window_keeps_one_more_token_in_the_sliding_pages(monkeypatch):
    caches = []
    original_init = PagedAttentionCache.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(self)

    monkeypatch.setattr(PagedAttentionCache, "__init__", recording_init)
    options = dict(sliding_window=3, attention_types=["iha_sliding_attention", "full_attention"])
    config = ContinuousBatchingConfig(**SMALL_CACHE)
    for num_pseudo_heads in (1, 2):  # P = 1: transformers' own window; P = 2: the paper's reaches a token more
        model = tiny_iha_model(num_pseudo_heads=num_pseudo_heads, **options)
        model.generate_batch(prompts([9]), generation_config=greedy_config(2), continuous_batching_config=config)
    standard_cache, widened_cache = caches
    assert serving_iha.paged_sliding_allocator(standard_cache).sliding_window == 3
    assert serving_iha.paged_sliding_allocator(widened_cache).sliding_window == 4
    # A paged cache the manager did not widen is refused at the first forward, not read wrongly.
    serving_iha.paged_sliding_allocator(widened_cache).sliding_window = 3
    with pytest.raises(ValueError, match="keep 3 past tokens, one more than"):
        serving_iha.check_paged_window(model.config, widened_cache)


def test_an_empty_prompt_is_refused_with_one_clear_error_instead_of_borrowed_logits():
    # The engine gives an empty request no query and no key: without the check its first token would be read from
    # the logits of the request before it, silently.
    model = tiny_iha_model(num_pseudo_heads=2)
    outputs = model.generate_batch(
        [prompts([3])[0], []],
        generation_config=greedy_config(3),
        continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
    )
    assert len(outputs) == 2
    for output in outputs.values():
        assert output.generated_tokens == []
        assert "empty prompt" in str(output.error) and "at least one token" in str(output.error)
