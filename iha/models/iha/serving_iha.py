# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""IHA under serving engines: transformers' continuous batching, and the engines IHA refuses.

Continuous batching (`model.generate_batch`, `transformers serve --continuous-batching`, `iha serve`) runs the model on
one packed row of several requests, [1, total new tokens], with a `PagedAttentionCache` instead of a `Cache`, the
batch's read / write indices and cumulative lengths in the keyword arguments, and one token-level mask per layer type
([1, 1, new tokens, read tokens]: per request, its cached tokens then its new ones, block-diagonal across requests).
IHA serves under it in token cache mode: each layer writes its un-mixed keys and values through the paged cache's
`update` (so the pages hold exactly what a Llama's pages hold, and the engine budgets them in tokens), mixes what it
reads back, and attends request by request: each request's new pseudo-tokens against its own keys only, with its
causal pattern widened to pseudo-tokens (the engine's dense block-diagonal mask, widened, would cost P^2 times the base
model's work on pairs across requests that are thrown away). The plan (`PagedRequestsMask`, built by
`create_paged_iha_masks`), its kernel (`per_request_attention`), the implementation it runs
(`paged_attention_implementation`) and the refusals live here; `compat_iha.paged_cache_update` hides how the
cache's `update` differs between releases.

Other engines run a model's layers with their own paged kernels, whose cache slots hold one key per real token:
IHA's N * P pseudo-tokens do not fit them, and the output is wrong without any error. `check_attention_engine` stops
an IHA layer under any of them with one line naming the engine, why, and what serves IHA instead.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

import copy
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.models.llama.modeling_llama import eager_attention_forward

from .compat_iha import PAGED_SLIDING_WINDOW_RELEASE, paged_sliding_window_is_right, supported_requirement
from .configuration_iha import IHA_SLIDING, is_iha_layer, is_sliding_layer
from .masking_iha import cache_window_tokens, window_unit


# What serves IHA instead, named in every refusal.
SERVE_IHA_INSTEAD = (
    "Serve IHA with transformers' continuous batching instead: `iha serve MODEL --continuous-batching` (an "
    "OpenAI-compatible server) or `model.generate_batch(...)`, with attn_implementation 'sdpa' or 'eager'."
)

# Attention implementations whose kernels take IHA's virtual sequence as it is (attention_iha.choose_attention_path).
IHA_ATTENTION_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)

# The names continuous batching gives the implementations it runs with a mask (the `paged|` prefix is how releases
# before 5.2x named them all), and the implementation IHA runs for each once it has updated the cache itself.
PAGED_ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "paged|sdpa": "sdpa", "eager": "eager", "paged|eager": "eager"}

# Engines that run a transformers model's layers with their own attention, by the implementation name they register.
ENGINE_BACKENDS = {
    "vllm": "vLLM's Transformers backend",
    "sglang": "SGLang's Transformers backend",
}


def is_paged_cache(cache) -> bool:
    """Whether `cache` is continuous batching's paged cache (not a `Cache`: no per-row tensors, no `get_seq_length`)."""
    return isinstance(cache, PagedAttentionCache)


def check_attention_engine(attn_implementation: str | None, paged: bool, kwargs: dict) -> None:
    """Refuse, in one line, an attention interface IHA layers cannot be correct under.

    - An engine's own backend: vLLM and SGLang register their attention under "vllm" / "sglang" and hand every layer
      their paged kernels (`attention_instances`), which keep one key per real token.
    - Continuous batching with FlashAttention: its paged path reads and writes the cache per real token through block
      tables (`flash_attn_with_kvcache`), and IHA's token-causal and sliding patterns have no FlashAttention kernel.
    - Any other name: an interface IHA was not checked with (a Hub kernel, a custom function), which may run
      ordinary attention over the tokens.
    """
    name = attn_implementation or "eager"
    if name in ENGINE_BACKENDS or "attention_instances" in kwargs:
        engine = ENGINE_BACKENDS.get(name, f"an engine's attention backend ({name!r}, passing `attention_instances`)")
        raise ValueError(
            f"IHA layers cannot run under {engine} (attn_implementation={name!r}): its paged kernels and cache slots "
            "hold one key per real token, while an IHA layer attends over N * P pseudo-tokens of mixed heads, so it "
            f"would decode wrong tokens without any error. {SERVE_IHA_INSTEAD}"
        )
    if paged:
        if name not in PAGED_ATTENTION_IMPLEMENTATIONS or kwargs.get("block_table") is not None:
            reason = "an interface IHA was not checked with"
            if "flash" in name or kwargs.get("block_table") is not None:
                reason = (
                    "FlashAttention's paged path reads and writes the cache per real token (block tables), which "
                    "IHA's N * P pseudo-tokens do not fit"
                )
            raise ValueError(
                f"Continuous batching runs IHA layers with attn_implementation 'sdpa' or 'eager', not {name!r}: "
                f"{reason}. Load the model with attn_implementation='sdpa' (the default) or 'eager'."
            )
        return
    if name in PAGED_ATTENTION_IMPLEMENTATIONS and name not in IHA_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation {name!r} runs only under continuous batching, with its paged cache; a plain forward "
            f"or generate() runs IHA with {name.removeprefix('paged|')!r}."
        )
    if name not in IHA_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"IHA layers run with attn_implementation in {list(IHA_ATTENTION_IMPLEMENTATIONS)}, not {name!r}: an "
            "attention interface IHA was not checked with may run ordinary attention over the tokens and give wrong "
            "outputs without any error. Load the model with one of those."
        )


def check_paged_sliding_window(version: str | None = None) -> None:
    """Refuse sliding-window layers under continuous batching on releases whose sliding pages read wrong tokens."""

    version = version or transformers.__version__
    if not paged_sliding_window_is_right(version):
        fixed = ".".join(map(str, PAGED_SLIDING_WINDOW_RELEASE))
        raise ValueError(
            f"Continuous batching of sliding-window layers reads back the wrong cached tokens on transformers "
            f"{version} (fixed in {fixed}; a stock Mistral decodes wrongly there too). Upgrade: pip install "
            f"'{supported_requirement(fixed)}', or generate with `generate()`."
        )


def paged_attention_implementation(attn_implementation: str) -> str:
    """The implementation IHA's layers run under continuous batching, once they have updated the paged cache."""
    return PAGED_ATTENTION_IMPLEMENTATIONS[attn_implementation]


def request_pseudo_mask(
    query_len: int,
    key_len: int,
    num_pseudo_heads: int,
    flat_causal: bool,
    sliding_window: int | None,
    device: torch.device,
    window_unit: str = "token",
) -> torch.Tensor | None:
    """The mask [1, 1, q * P, k * P] of one request's new tokens against its keys, or None when it hides nothing.

    A request's keys are its cached tokens followed by its new ones (on full and sliding layers alike), so new
    token t has its own key at k - q + t and sees the keys up to it. On sliding layers with the token window it sees
    the last `sliding_window` tokens (the engine's sliding pages keep `sliding_window - 1` of them); with the virtual
    window (`window_unit="virtual"`), pseudo-query (t, p) sees the last `sliding_window * P` virtual keys (the pages
    keep `sliding_window` tokens then: `keep_virtual_windows_in_paged_cache`). Pseudo-token (t, p) sees (j, r)
    wherever token t sees token j: the token-causal pattern. Under the flat-causal mask a pseudo-query also must not
    see the later pseudo-keys of its own token (r > p): the own-token block is lower triangular.
    """
    own_key = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key = torch.arange(key_len, device=device)[None, :]
    allowed = key <= own_key
    if sliding_window is not None and window_unit == "token":
        allowed = allowed & (key > own_key - sliding_window)
    own_token = key == own_key

    def widen(token_level: torch.Tensor) -> torch.Tensor:  # [q, k] tokens -> [q * P, k * P] pseudo-tokens
        return token_level.repeat_interleave(num_pseudo_heads, dim=0).repeat_interleave(num_pseudo_heads, dim=1)

    allowed = widen(allowed)
    if flat_causal and num_pseudo_heads > 1:
        pseudo = torch.arange(num_pseudo_heads, device=device)
        later_pseudo_key = pseudo.repeat(key_len)[None, :] > pseudo.repeat(query_len)[:, None]
        allowed = allowed & ~(widen(own_token) & later_pseudo_key)
    if sliding_window is not None and window_unit == "virtual":
        pseudo = torch.arange(num_pseudo_heads, device=device)
        virtual_query = (own_key * num_pseudo_heads + pseudo).flatten()  # [q * P]
        virtual_key = torch.arange(key_len * num_pseudo_heads, device=device)
        allowed = allowed & (virtual_key[None, :] > virtual_query[:, None] - sliding_window * num_pseudo_heads)
    if bool(allowed.all()):
        return None
    return allowed[None, None]


@dataclass
class PagedRequestsMask:
    """The mask of an IHA layer under continuous batching, request by request, for `per_request_attention`.

    The engine's own mask is one dense [new tokens, read tokens] product over every request of the batch
    (block-diagonal, everything across requests thrown away): widened to pseudo-tokens it would cost P^2 times the
    base model's already wasted work. Here every request attends only its own keys: rows [query_start, query_end)
    of the packed virtual queries against keys [key_start, key_end), with its own small mask (None when it hides
    nothing, as when a token-causal request decodes one token).
    """

    attention_path = "per_request"
    query_ranges: list[tuple[int, int]]
    key_ranges: list[tuple[int, int]]
    masks: list[torch.Tensor | None]

    def contiguous(self) -> "PagedRequestsMask":
        return self


def create_paged_requests_mask(
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    num_pseudo_heads: int,
    flat_causal: bool,
    sliding_window: int | None,
    window_unit: str = "token",
) -> PagedRequestsMask:
    """Plan one IHA attention type of a continuous batch from its cumulative lengths (in tokens)."""
    query_bounds = cu_seq_lens_q.tolist()
    key_bounds = cu_seq_lens_k.tolist()
    device = cu_seq_lens_q.device
    plan = PagedRequestsMask(query_ranges=[], key_ranges=[], masks=[])
    for request in range(len(query_bounds) - 1):
        query_len = query_bounds[request + 1] - query_bounds[request]
        key_len = key_bounds[request + 1] - key_bounds[request]
        if query_len == 0:  # padding requests of static shapes
            continue
        plan.query_ranges.append(
            (query_bounds[request] * num_pseudo_heads, query_bounds[request + 1] * num_pseudo_heads)
        )
        plan.key_ranges.append((key_bounds[request] * num_pseudo_heads, key_bounds[request + 1] * num_pseudo_heads))
        plan.masks.append(
            request_pseudo_mask(query_len, key_len, num_pseudo_heads, flat_causal, sliding_window, device, window_unit)
        )
    return plan


def per_request_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: PagedRequestsMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of every request of a continuous batch against its own keys only.

    query [1, H, T * P, d] (the packed row's new pseudo-tokens), key / value [1, H_kv, K * P, d] (every request's
    keys read back from the paged cache and mixed); returns [1, T * P, H, d] and no weights, like transformers'
    attention functions. Eager models run eager attention per request, the others SDPA (reading each KV head for its
    whole query group).
    """
    _, num_heads, virtual_len, head_dim = query.shape
    output = query.new_zeros(1, virtual_len, num_heads, head_dim)  # rows of padding tokens stay zero
    eager = module.config._attn_implementation in ("eager", "paged|eager")
    for (query_start, query_end), (key_start, key_end), mask in zip(
        attention_mask.query_ranges, attention_mask.key_ranges, attention_mask.masks
    ):
        request_query = query[:, :, query_start:query_end]
        request_key, request_value = key[:, :, key_start:key_end], value[:, :, key_start:key_end]
        if eager:
            float_mask = None
            if mask is not None:
                float_mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
                float_mask.masked_fill_(~mask, torch.finfo(query.dtype).min)
            request_output, _ = eager_attention_forward(
                module, request_query, request_key, request_value, float_mask, scaling=scaling, dropout=dropout
            )
        else:
            request_output = nn.functional.scaled_dot_product_attention(
                request_query,
                request_key,
                request_value,
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=num_heads != key.shape[1],
            ).transpose(1, 2)
        output[:, query_start:query_end] = request_output
    return output, None


def layer_type_entry(value, layer_type: str):
    """Continuous batching passes one entry per layer type as a dict, or the entry itself when the model has one."""
    return value[layer_type] if isinstance(value, dict) else value


def check_no_empty_request(cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor | dict) -> None:
    """Refuse a batch in which a request has no token at all (an empty prompt): the engine gives it no query and no
    key, and would read its first token from the logits of the request before it, without an error."""
    keys = next(iter(cu_seq_lens_k.values())) if isinstance(cu_seq_lens_k, dict) else cu_seq_lens_k
    empty = ((cu_seq_lens_q.diff() == 0) & (keys.diff() == 0)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"continuous batching got {len(empty)} request(s) with an empty prompt (no tokens): IHA needs at least "
            "one token per request; drop empty prompts or give them a token (a BOS token, for instance)"
        )


def create_paged_iha_masks(config, attention_mask, kwargs: dict, cache=None) -> dict:
    """One mask per attention type of the model under continuous batching, from the engine's token masks (a dict
    per layer type, or one mask) and the batch's cumulative lengths in the forward's keyword arguments.

    Standard layers take the engine's mask as it is (their attention is a Llama's); IHA layers take a
    `PagedRequestsMask` built from `cu_seq_lens_q` and their layer type's `cu_seq_lens_k`. A model with virtual-window
    IHA layers runs only on a paged `cache` whose sliding pages keep the token their first pseudo-query reaches.
    """
    if any(is_sliding_layer(attention_type) for attention_type in config.attention_types):
        check_paged_sliding_window()
    if cache is not None:
        check_paged_virtual_window(config, cache)
    check_no_empty_request(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    masks = {}
    for attention_type in config.attention_types:
        if attention_type in masks:
            continue
        layer_type = "sliding_attention" if is_sliding_layer(attention_type) else "full_attention"
        if not is_iha_layer(attention_type):
            masks[attention_type] = layer_type_entry(attention_mask, layer_type)
            continue
        masks[attention_type] = create_paged_requests_mask(
            kwargs["cu_seq_lens_q"],
            layer_type_entry(kwargs["cu_seq_lens_k"], layer_type),
            config.num_pseudo_heads,
            flat_causal=config.iha_mask_mode == "flat_causal",
            sliding_window=config.sliding_window if is_sliding_layer(attention_type) else None,
            window_unit=window_unit(config),
        )
    return masks


# --- the virtual window's one more token in the engine's sliding pages --------------------------------------------------


def has_virtual_window_layers(config) -> bool:
    return window_unit(config) == "virtual" and IHA_SLIDING in config.attention_types


def paged_sliding_allocator(cache):
    """The allocator of the paged cache's sliding-window pages (one for every sliding layer), or None on a release
    whose paged cache is laid out otherwise."""
    allocators = getattr(cache, "cache_allocators", None)
    allocator = allocators.get("sliding_attention") if isinstance(allocators, dict) else None
    return allocator if isinstance(getattr(allocator, "sliding_window", None), int) else None


def virtual_window_paged_refusal(config) -> str:
    return (
        f"Continuous batching of this model's sliding IHA layers (iha_window_unit='virtual') needs sliding pages that "
        f"keep {cache_window_tokens(config) - 1} past tokens, one more than transformers {transformers.__version__} "
        "gives a sliding layer, and IHA could not widen them on this release. Generate with `generate()`, or upgrade "
        "transformers to the newest release IHA supports."
    )


def widen_paged_sliding_window(cache, config) -> None:
    """Let the sliding pages of a paged cache keep `sliding_window` past tokens (`masking_iha.cache_window_tokens`),
    before the engine computes any index from them. Standard sliding layers share the pages; their mask (built by the
    engine from `config.sliding_window`) still keeps their own window."""
    allocator = paged_sliding_allocator(cache)
    if allocator is None:
        raise ValueError(virtual_window_paged_refusal(config))
    if allocator.sliding_window == config.sliding_window:
        allocator.sliding_window = cache_window_tokens(config)
        # Only-sliding models: the scheduler reads at most the window per request.
        if getattr(cache, "read_cache_limit", None) == config.sliding_window:
            cache.read_cache_limit = allocator.sliding_window


def keep_virtual_windows_in_paged_cache(manager, config) -> None:
    """Make a continuous batching manager widen its paged cache's sliding pages as soon as it builds them.

    The manager builds its paged cache (and the allocator of its sliding pages, from `config.sliding_window`) in its
    own thread, when it starts; the first pseudo-query of a token under the virtual window reaches one token further
    back than those pages keep. The manager's step that builds the cache is wrapped, so the pages are widened before
    any request is scheduled. A release without that step is refused here, in the caller's thread.
    """
    if not has_virtual_window_layers(config):
        return
    # Before 5.16 no sliding pages read back the right tokens, widened or not: that refusal names the fix.
    check_paged_sliding_window()
    create_batch_processor = getattr(manager, "_create_batch_processor", None)
    if create_batch_processor is None:
        raise ValueError(virtual_window_paged_refusal(config))

    def create_batch_processor_with_virtual_window(*args, **kwargs):
        batch_processor = create_batch_processor(*args, **kwargs)
        widen_paged_sliding_window(batch_processor.cache, config)
        return batch_processor

    manager._create_batch_processor = create_batch_processor_with_virtual_window


def check_paged_virtual_window(config, cache) -> None:
    """Refuse a forward on a paged cache whose sliding pages drop the token the virtual window reaches (a manager not
    started through `init_continuous_batching`)."""
    if not has_virtual_window_layers(config):
        return
    allocator = paged_sliding_allocator(cache)
    if allocator is None or allocator.sliding_window != cache_window_tokens(config):
        raise ValueError(virtual_window_paged_refusal(config))


def continuous_batching_config_for_iha(continuous_batching_config, generation_config=None):
    """The continuous batching config IHA runs with: the one given (or the default), never switching to flash.

    From 5.2x continuous batching switches sdpa / eager models to FlashAttention by itself when a flash kernel is
    installed (`auto_switch_to_flash`); IHA refuses FlashAttention under continuous batching, so the switch would
    only turn a working setup into an error. The caller's object is copied, never changed; releases without the
    switch get it as it is.
    """
    if continuous_batching_config is None:
        # A config passed inside the generation config (deprecated, still read by 5.2x) is the caller's choice.
        continuous_batching_config = getattr(generation_config, "continuous_batching_config", None)
    if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
        continuous_batching_config = ContinuousBatchingConfig()
    if not getattr(continuous_batching_config, "auto_switch_to_flash", False):
        return continuous_batching_config
    continuous_batching_config = copy.copy(continuous_batching_config)
    continuous_batching_config.auto_switch_to_flash = False
    return continuous_batching_config
