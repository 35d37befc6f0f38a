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
reads back, and attends with the engine's token mask widened to pseudo-tokens. The plan (`create_paged_iha_masks`),
the kernel choice (`paged_attention_implementation`) and the refusals live here; `compat_iha.paged_cache_update` hides
how the cache's `update` differs between releases.

Other engines run a model's layers with their own paged kernels, whose cache slots hold one key per real token:
IHA's N * P pseudo-tokens do not fit them, and the output is wrong without any error. `check_attention_engine` stops
an IHA layer under any of them with one line naming the engine, why, and what serves IHA instead.

This file travels with the weights (`save_pretrained` copies it next to `modeling_iha.py`), so it imports only torch,
transformers and its siblings.
"""

import copy

import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache

from .compat_iha import PAGED_SLIDING_WINDOW_RELEASE, paged_sliding_window_is_right
from .configuration_iha import is_iha_layer, is_sliding_layer


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
    import transformers

    version = version or transformers.__version__
    if not paged_sliding_window_is_right(version):
        fixed = ".".join(map(str, PAGED_SLIDING_WINDOW_RELEASE))
        raise ValueError(
            f"Continuous batching of sliding-window layers reads back the wrong cached tokens on transformers "
            f"{version} (fixed in {fixed}; a stock Mistral decodes wrongly there too). Upgrade: pip install "
            f"'transformers>={fixed},<5.25', or generate with `generate()`."
        )


def paged_attention_implementation(attn_implementation: str) -> str:
    """The implementation IHA's layers run under continuous batching, once they have updated the paged cache."""
    return PAGED_ATTENTION_IMPLEMENTATIONS[attn_implementation]


def own_token_key_index(
    cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, num_query_tokens: int
) -> torch.Tensor:
    """For every query token of the packed row, the column of its own key among the keys read back from the cache.

    A request's keys are its cached tokens followed by its new tokens (the new ones are the last of its key range, on
    full and sliding layers alike), so query t of request b has its own key at cu_k[b + 1] - (cu_q[b + 1] - t).
    Padding queries past the last request (CUDA-graph padding) point at the last key; their rows are masked anyway.
    """
    cu_seq_lens_q = cu_seq_lens_q.to(torch.long)
    cu_seq_lens_k = cu_seq_lens_k.to(device=cu_seq_lens_q.device, dtype=torch.long)
    query_token = torch.arange(num_query_tokens, device=cu_seq_lens_q.device)
    num_requests = cu_seq_lens_q.numel() - 1
    request = torch.searchsorted(cu_seq_lens_q[1:], query_token, right=True).clamp(max=num_requests - 1)
    own_key = cu_seq_lens_k[request + 1] - (cu_seq_lens_q[request + 1] - query_token)
    return own_key.clamp(min=0, max=max(int(cu_seq_lens_k[-1]) - 1, 0))


def widen_token_mask(
    token_mask: torch.Tensor, own_key_index: torch.Tensor, num_pseudo_heads: int, flat_causal: bool
) -> torch.Tensor:
    """The engine's token mask [1, 1, T, K] widened to pseudo-tokens, [1, 1, T * P, K * P].

    Pseudo-token (t, p) sees (k, r) wherever token t sees token k: that is the token-causal pattern, and the sliding
    window in tokens (`token_window_overlay`) whenever the engine's mask has one. Under the flat-causal mask a
    pseudo-query also must not see the later pseudo-keys of its own token (r > p): the own-token block is made
    lower triangular.
    """
    virtual_mask = token_mask.repeat_interleave(num_pseudo_heads, dim=-2).repeat_interleave(num_pseudo_heads, dim=-1)
    if not flat_causal or num_pseudo_heads == 1:
        return virtual_mask
    num_pseudo = num_pseudo_heads
    device = token_mask.device
    virtual_row = torch.arange(own_key_index.numel() * num_pseudo, device=device)
    query_pseudo = virtual_row % num_pseudo
    key_pseudo = torch.arange(num_pseudo, device=device)
    later = key_pseudo[None, :] > query_pseudo[:, None]  # [T * P, P]: own-token pseudo-keys after the query's
    own_columns = own_key_index.to(device).repeat_interleave(num_pseudo)[:, None] * num_pseudo + key_pseudo[None, :]
    rows = virtual_row[:, None].expand_as(own_columns)[later]
    hidden = False if token_mask.dtype == torch.bool else torch.finfo(token_mask.dtype).min
    virtual_mask[..., rows, own_columns[later]] = hidden
    return virtual_mask


def layer_type_entry(value, layer_type: str):
    """Continuous batching passes one entry per layer type as a dict, or the entry itself when the model has one."""
    return value[layer_type] if isinstance(value, dict) else value


def create_paged_iha_masks(config, attention_mask, kwargs: dict) -> dict:
    """One mask per attention type of the model, from the engine's token masks (a dict per layer type or one mask)
    and the batch's cumulative lengths in the forward's keyword arguments (`cu_seq_lens_q`, `cu_seq_lens_k`).

    Standard layers take the engine's mask as it is; IHA layers take it widened to pseudo-tokens (`widen_token_mask`)
    with the own-token block of the flat-causal mask. Sliding IHA layers read the sliding mask: its window is counted
    in tokens, as IHA's is, and the engine's sliding pages keep the last `sliding_window - 1` tokens, as the sliding
    caches of `generate` do.
    """
    if any(is_iha_layer(attention_type) for attention_type in config.attention_types):
        check_attention_engine(config._attn_implementation, paged=True, kwargs=kwargs)
    if any(is_sliding_layer(attention_type) for attention_type in config.attention_types):
        check_paged_sliding_window()
    masks = {}
    for attention_type in config.attention_types:
        if attention_type in masks:
            continue
        layer_type = "sliding_attention" if is_sliding_layer(attention_type) else "full_attention"
        token_mask = layer_type_entry(attention_mask, layer_type)
        if not is_iha_layer(attention_type):
            masks[attention_type] = token_mask
            continue
        own_key = own_token_key_index(
            kwargs["cu_seq_lens_q"], layer_type_entry(kwargs["cu_seq_lens_k"], layer_type), token_mask.shape[-2]
        )
        masks[attention_type] = widen_token_mask(
            token_mask, own_key, config.num_pseudo_heads, flat_causal=config.iha_mask_mode == "flat_causal"
        )
    return masks


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
