"""IHA under transformers' continuous batching (`model.generate_batch`, `transformers serve --continuous-batching`,
`iha serve --continuous_batching`), registered as `iha|paged` (`iha.attention.register_attention_paths`). A folder
loaded without the package refuses continuous batching in one line (`modeling_iha.continuous_batching_path`).

Continuous batching runs the model on one packed row of several requests, [1, total new tokens], with a
`PagedAttentionCache` instead of a `Cache`, the batch's read / write indices and cumulative lengths in the keyword
arguments, and one token-level mask per layer type ([1, 1, new tokens, read tokens]: per request, its cached tokens
then its new ones, block-diagonal across requests). IHA serves under it in token cache mode: each layer writes its
un-mixed keys and values through the paged cache's `update` (so the pages hold exactly what a Llama's pages hold, and
the engine budgets them in tokens), mixes what it reads back, and attends request by request: each request's new
pseudo-tokens against its own keys only, with its causal pattern widened to pseudo-tokens (the engine's dense
block-diagonal mask, widened, would cost P^2 times the base model's work on pairs across requests that are thrown
away). Sliding IHA layers reach one token further back than the engine's sliding pages keep (`IHALayerSpec.
reach_tokens`): the pages are widened when the engine builds them.

`ContinuousBatchingPath` is what the folder's model calls: the attention (`per_request_attention`), the cache update
(`paged_cache_update`, which hides how `update` differs between releases), the masks (`create_paged_iha_masks`) and
the start of the engine (`init_continuous_batching`).
"""

import copy
import inspect
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.models.llama.modeling_llama import eager_attention_forward

from ..models.iha.layer_iha import IHA_SLIDING, IHALayerSpec
from ..models.iha.version_iha import supported_requirement


# The names continuous batching gives the implementations it runs with a mask (the `paged|` prefix is how releases
# before 5.2x named them all), and the implementation IHA runs for each once it has updated the cache itself.
PAGED_ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "paged|sdpa": "sdpa", "eager": "eager", "paged|eager": "eager"}
# The first release whose paged sliding-window cache reads back the right tokens: 5.16.0 fixed the rolling-buffer
# slot of the first token read and written (on 5.15.1 a Mistral under continuous batching decodes wrongly).
PAGED_SLIDING_WINDOW_RELEASE = Version("5.16.0")
FLASH_UNDER_CONTINUOUS_BATCHING = (
    "Continuous batching runs IHA layers with attn_implementation 'sdpa' or 'eager': FlashAttention's paged path reads "
    "and writes the cache per real token (block tables), which IHA's N * P pseudo-tokens do not fit. Load the model "
    "with attn_implementation='sdpa' (the default) or 'eager'."
)


# Whether `PagedAttentionCache.update(key, value, layer_idx, kwargs)` takes the engine's keyword arguments.
PAGED_UPDATE_TAKES_KWARGS = "kwargs" in inspect.signature(PagedAttentionCache.update).parameters


def check_paged_sliding_window(version: str = transformers.__version__) -> None:
    """Refuse sliding-window layers under continuous batching on releases whose sliding pages read wrong tokens."""
    if Version(version).release < PAGED_SLIDING_WINDOW_RELEASE.release:
        raise ValueError(
            f"Continuous batching of sliding-window layers reads back the wrong cached tokens on transformers "
            f"{version} (fixed in {PAGED_SLIDING_WINDOW_RELEASE}; a stock Mistral decodes wrongly there too). Upgrade: "
            f"pip install '{supported_requirement(str(PAGED_SLIDING_WINDOW_RELEASE))}', or generate with `generate()`."
        )


def paged_cache_update(cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict):
    """Write the new keys and values [1, H_kv, T, d] of one layer into continuous batching's paged cache and read
    back every key and value the batch attends to, [1, H_kv, K, d] (per request its cached tokens, then its new ones).

    `kwargs` are the forward's keyword arguments, where the engine puts the read / write indices; the cache's own
    `update` selects this layer's entries by replacing them in the dict it is given, so it gets a copy.
    """
    if PAGED_UPDATE_TAKES_KWARGS:
        return cache.update(key_states, value_states, layer_idx, kwargs=dict(kwargs))
    keys, values = cache.update(
        key_states, value_states, layer_idx, read_index=kwargs["read_index"], write_index=kwargs["write_index"]
    )
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def request_pseudo_mask(query_len: int, key_len: int, spec: IHALayerSpec, device: torch.device) -> torch.Tensor | None:
    """The mask [1, 1, q * P, k * P] of one request's new tokens against its keys, or None when it hides nothing.

    A request's keys are its cached tokens followed by its new ones (on full and sliding layers alike), so new
    token t has its own key at k - q + t and sees the keys up to it. Pseudo-token (t, p) sees (j, r) wherever token t
    sees token j: the token-causal pattern. Under the flat-causal mask a pseudo-query also must not see the later
    pseudo-keys of its own token (r > p): the own-token block is lower triangular. On sliding layers pseudo-query
    (t, p) sees the last `virtual_window` virtual keys (the widened pages keep them: `widen_paged_sliding_window`).
    """
    num_pseudo_heads = spec.num_pseudo_heads
    own_key = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key = torch.arange(key_len, device=device)[None, :]
    allowed = key <= own_key
    own_token = key == own_key

    def widen(token_level: torch.Tensor) -> torch.Tensor:  # [q, k] tokens -> [q * P, k * P] pseudo-tokens
        return token_level.repeat_interleave(num_pseudo_heads, dim=0).repeat_interleave(num_pseudo_heads, dim=1)

    allowed = widen(allowed)
    pseudo = torch.arange(num_pseudo_heads, device=device)
    if spec.mask_mode == "flat_causal" and num_pseudo_heads > 1:
        later_pseudo_key = pseudo.repeat(key_len)[None, :] > pseudo.repeat(query_len)[:, None]
        allowed = allowed & ~(widen(own_token) & later_pseudo_key)
    if spec.is_sliding:
        virtual_query = (own_key * num_pseudo_heads + pseudo).flatten()  # [q * P]
        virtual_key = torch.arange(key_len * num_pseudo_heads, device=device)
        allowed = allowed & (virtual_key[None, :] > virtual_query[:, None] - spec.virtual_window)
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

    query_ranges: list[tuple[int, int]]
    key_ranges: list[tuple[int, int]]
    masks: list[torch.Tensor | None]

    def contiguous(self) -> "PagedRequestsMask":
        return self


def create_paged_requests_mask(
    cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, spec: IHALayerSpec
) -> PagedRequestsMask:
    """Plan one IHA attention type of a continuous batch from its cumulative lengths (in tokens)."""
    query_bounds = cu_seq_lens_q.tolist()
    key_bounds = cu_seq_lens_k.tolist()
    device = cu_seq_lens_q.device
    num_pseudo_heads = spec.num_pseudo_heads
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
        plan.masks.append(request_pseudo_mask(query_len, key_len, spec, device))
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
    `PagedRequestsMask` built from `cu_seq_lens_q` and their layer type's `cu_seq_lens_k`. A model whose sliding IHA
    layers reach past the engine's sliding pages runs only on pages widened by `init_continuous_batching`.
    """
    if kwargs.get("block_table") is not None:
        raise ValueError(FLASH_UNDER_CONTINUOUS_BATCHING)
    if config.sliding_window is not None:
        check_paged_sliding_window()
    if cache is not None:
        check_paged_window(config, cache)
    check_no_empty_request(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    masks = {}
    for layer_idx, attention_type in enumerate(config.attention_types):
        if attention_type in masks:
            continue
        spec = config.layer_spec(layer_idx)
        layer_type = "sliding_attention" if spec.is_sliding else "full_attention"
        if not spec.is_iha:
            masks[attention_type] = layer_type_entry(attention_mask, layer_type)
            continue
        cu_seq_lens_k = layer_type_entry(kwargs["cu_seq_lens_k"], layer_type)
        masks[attention_type] = create_paged_requests_mask(kwargs["cu_seq_lens_q"], cu_seq_lens_k, spec)
    return masks


# --- the sliding pages that keep what the paper's window reaches ----------------------------------------------------


def paged_cache_window(config) -> int | None:
    """The window the engine's sliding pages must be built with (`IHALayerSpec.cache_window`), or None when the pages
    the engine builds from `config.sliding_window` already keep it (no sliding IHA layer, or P = 1)."""
    if IHA_SLIDING not in config.attention_types:
        return None
    window = config.layer_spec(config.attention_types.index(IHA_SLIDING)).cache_window
    return None if window == config.sliding_window else window


def paged_sliding_allocator(cache):
    """The allocator of the paged cache's sliding-window pages (one for every sliding layer), or None on a release
    whose paged cache is laid out otherwise."""
    allocators = getattr(cache, "cache_allocators", None)
    allocator = allocators.get("sliding_attention") if isinstance(allocators, dict) else None
    return allocator if isinstance(getattr(allocator, "sliding_window", None), int) else None


def paged_window_refusal(config) -> str:
    return (
        f"Continuous batching of this model's sliding IHA layers needs sliding pages that keep "
        f"{paged_cache_window(config) - 1} past tokens, one more than transformers {transformers.__version__} gives a "
        "sliding layer, and IHA could not widen them on this release. Generate with `generate()`, or upgrade "
        "transformers to the newest release IHA supports."
    )


def widen_paged_sliding_window(cache, config) -> None:
    """Let the sliding pages of a paged cache keep what the window reaches (`paged_cache_window`), before the engine
    computes any index from them. Standard sliding layers share the pages; their mask (built by the engine from
    `config.sliding_window`) still keeps their own window."""
    allocator = paged_sliding_allocator(cache)
    if allocator is None:
        raise ValueError(paged_window_refusal(config))
    if allocator.sliding_window == config.sliding_window:
        allocator.sliding_window = paged_cache_window(config)
        # Only-sliding models: the scheduler reads at most the window per request.
        if getattr(cache, "read_cache_limit", None) == config.sliding_window:
            cache.read_cache_limit = allocator.sliding_window


def widen_pages_when_built(manager, config) -> None:
    """Make a continuous batching manager widen its paged cache's sliding pages as soon as it builds them.

    The manager builds its paged cache (and the allocator of its sliding pages, from `config.sliding_window`) in its
    own thread, when it starts; the first pseudo-query of a token reaches one token further back than those pages
    keep. The manager's step that builds the cache is wrapped, so the pages are widened before any request is
    scheduled. A release without that step is refused here, in the caller's thread.
    """
    if paged_cache_window(config) is None:
        return
    # Before 5.16 no sliding pages read back the right tokens, widened or not: that refusal names the fix.
    check_paged_sliding_window()
    create_batch_processor = getattr(manager, "_create_batch_processor", None)
    if create_batch_processor is None:
        raise ValueError(paged_window_refusal(config))

    def create_batch_processor_with_virtual_window(*args, **kwargs):
        batch_processor = create_batch_processor(*args, **kwargs)
        widen_paged_sliding_window(batch_processor.cache, config)
        return batch_processor

    manager._create_batch_processor = create_batch_processor_with_virtual_window


def check_paged_window(config, cache) -> None:
    """Refuse a forward on a paged cache whose sliding pages drop the token the window reaches (a manager not started
    through `init_continuous_batching`)."""
    if paged_cache_window(config) is None:
        return
    allocator = paged_sliding_allocator(cache)
    if allocator is None or allocator.sliding_window != paged_cache_window(config):
        raise ValueError(paged_window_refusal(config))


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


class ContinuousBatchingPath:
    """What the folder's IHA model calls under continuous batching, registered as the attention function `iha|paged`:
    called, it is the attention of IHA layers (`per_request_attention`); its methods are the rest of the glue."""

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return per_request_attention(module, query, key, value, attention_mask, dropout, scaling)

    @staticmethod
    def attention_implementation(name: str) -> str:
        """The implementation IHA's layers run under continuous batching, once they have updated the paged cache."""
        if "flash" in name:
            raise ValueError(FLASH_UNDER_CONTINUOUS_BATCHING)
        if name not in PAGED_ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"Continuous batching runs IHA layers with attn_implementation 'sdpa' or 'eager', not {name!r}. Load "
                "the model with attn_implementation='sdpa' (the default) or 'eager'."
            )
        return PAGED_ATTENTION_IMPLEMENTATIONS[name]

    @staticmethod
    def update_cache(cache, key_states, value_states, layer_idx: int, kwargs: dict):
        return paged_cache_update(cache, key_states, value_states, layer_idx, kwargs)

    @staticmethod
    def create_masks(config, attention_mask, kwargs: dict, cache) -> dict:
        return create_paged_iha_masks(config, attention_mask, kwargs, cache)

    @staticmethod
    def init_continuous_batching(
        model, start, generation_config=None, continuous_batching_config=None, *args, **kwargs
    ):
        """Start the engine (`start`: transformers' own `init_continuous_batching`) as IHA needs it: never switched to
        FlashAttention, and with sliding pages that keep what the window reaches."""
        continuous_batching_config = continuous_batching_config_for_iha(continuous_batching_config, generation_config)
        manager = start(generation_config, continuous_batching_config, *args, **kwargs)
        widen_pages_when_built(manager, model.config)
        return manager
