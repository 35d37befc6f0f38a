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
"""Everything that differs between the transformers releases IHA supports, in one place.

A model folder carries this file next to `configuration_iha.py` and `modeling_iha.py`, and whoever loads it brings
their own transformers. The model files never test a version themselves: they call the names below.

- The supported range and its guard: a release below `MINIMUM_TRANSFORMERS` is refused at import with one message
  that names the fix; a release above `NEWEST_TESTED_TRANSFORMERS` is allowed only after a self-check of the cache path
  on a tiny model (`check_untested_release`, called at the end of `modeling_iha.py`).
- The cache argument: transformers 5.24 renamed `past_key_values` to `cache` in model inputs, model outputs, mask
  helpers and `create_masks_for_generate`. A model that only knows the old name receives the cache in `**kwargs`,
  ignores it and decodes garbage without any error, so the name is resolved here for every call.
- The query offset of a cache: `Cache.get_query_offset` exists from 5.14; earlier releases' own mask helpers use
  `get_seq_length()`.
- Continuous batching's paged cache: `PagedAttentionCache.update` reads the batch's read / write indices from the
  engine's keyword arguments (and returns [1, heads, tokens, d]) in recent releases; earlier ones take the indices as
  arguments and return [tokens, heads, d]. `paged_cache_update` calls either. Before 5.16 its sliding-window pages
  read back the wrong cached tokens (a stock Mistral decodes other tokens than `generate()`), so sliding layers under
  continuous batching need 5.16 (`PAGED_SLIDING_WINDOW_RELEASE`).

This file may import only torch and transformers (it travels with the weights), and must import nothing from
transformers before the version check: an unsupported release may lack any of it.
"""

import os
import re

import transformers


MINIMUM_TRANSFORMERS = (5, 4, 0)
# Newest release line the version matrix (`scripts/transformers_matrix.py`) ran; patch releases of it count.
NEWEST_TESTED_TRANSFORMERS = (5, 24)
INSTALL_COMMAND = 'pip install "transformers>=5.4.0,<5.25"'
SKIP_SELF_CHECK_VARIABLE = "IHA_SKIP_TRANSFORMERS_SELF_CHECK"


def release_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "5.24.0" or "5.25.0.dev0"."""
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if numbers is None:
        raise ValueError(f"Cannot read the transformers version {version!r}.")
    return tuple(int(number or 0) for number in numbers.groups())


def supported_range_text() -> str:
    minimum = ".".join(map(str, MINIMUM_TRANSFORMERS))
    newest = ".".join(map(str, NEWEST_TESTED_TRANSFORMERS))
    return f"transformers >= {minimum} (tested up to {newest}.x)"


class UnsupportedTransformersError(ImportError):
    """The installed transformers cannot run IHA models correctly."""


def check_minimum_release(version: str = transformers.__version__):
    if release_tuple(version) < MINIMUM_TRANSFORMERS:
        raise UnsupportedTransformersError(
            f"IHA models need {supported_range_text()}, but transformers {version} is installed. Fix: {INSTALL_COMMAND}"
        )


def is_untested_release(version: str = transformers.__version__) -> bool:
    return release_tuple(version)[:2] > NEWEST_TESTED_TRANSFORMERS


check_minimum_release()

# Imported only once the release is known to have them.
import inspect  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.continuous_batching import PagedAttentionCache  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: E402


# The name transformers uses for the cache in model inputs, outputs and mask helpers.
CACHE_ARGUMENT = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# Every name the cache goes by in some supported release (what device placement must leave alone).
CACHE_ARGUMENT_NAMES = ["past_key_values", "cache"]


def take_cache_argument(past_key_values, kwargs: dict):
    """The cache passed to a forward under either name; removes the other name from `kwargs`.

    `generate` passes `cache=` from transformers 5.24 on and `past_key_values=` before; users, TRL and PEFT may use
    either. Both at once is ambiguous and refused, like transformers itself does.
    """
    other = kwargs.pop("cache", None)
    if other is not None and past_key_values is not None:
        raise ValueError("Pass the cache as `cache` or as `past_key_values`, not both.")
    return past_key_values if past_key_values is not None else other


def cache_keyword(cache) -> dict:
    """`{name: cache}` with the name this release's mask helpers and model outputs take."""
    return {CACHE_ARGUMENT: cache}


def output_cache(outputs):
    """The cache a model output carries, read under this release's field name (no deprecation warning)."""
    return getattr(outputs, CACHE_ARGUMENT)


def cache_query_offset(cache, layer_idx: int):
    """How many tokens precede the current queries in `cache` (an int, or a tensor for static caches)."""
    if hasattr(cache, "get_query_offset"):
        return cache.get_query_offset(layer_idx)
    # Before 5.14 transformers' own mask helpers use the number of cached tokens.
    return cache.get_seq_length()


# Whether `PagedAttentionCache.update(key, value, layer_idx, kwargs)` takes the engine's keyword arguments.
PAGED_UPDATE_TAKES_KWARGS = "kwargs" in inspect.signature(PagedAttentionCache.update).parameters
# The first release whose paged sliding-window cache reads back the right tokens: 5.16.0 fixed the rolling-buffer
# slot of the first token read and written (on 5.15.1 a Mistral under continuous batching decodes wrongly).
PAGED_SLIDING_WINDOW_RELEASE = (5, 16, 0)


def paged_sliding_window_is_right(version: str = transformers.__version__) -> bool:
    return release_tuple(version) >= PAGED_SLIDING_WINDOW_RELEASE


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


def check_untested_release(config_class, causal_lm_class, version: str = transformers.__version__):
    """On a transformers newer than the newest tested release, prove the cache path before any model runs.

    Silent wrong output is what an API change in a new release does to a model that keeps running (5.24 renamed the
    cache argument: models that missed it decode garbage with no error). So on an untested release this builds a tiny
    IHA model and checks, in a few seconds at most: (1) at identity mixing it gives the logits and the cached greedy
    tokens of a Llama model with the same weights, on a left-padded batch; (2) with random mixing and a sliding IHA
    layer, greedy tokens with DynamicCache and StaticCache equal those without a cache. If either fails, importing
    the model fails with the fix; if both pass, a warning says the release is untested.
    IHA_SKIP_TRANSFORMERS_SELF_CHECK=1 skips the check.
    """
    if not is_untested_release(version) or os.environ.get(SKIP_SELF_CHECK_VARIABLE) == "1":
        return
    failure = cache_path_self_check(config_class, causal_lm_class)
    if failure is not None:
        raise UnsupportedTransformersError(
            f"transformers {version} is newer than the releases IHA was tested with ({supported_range_text()}), and "
            f"IHA's self-check on it failed: {failure}. Output would be wrong. Fix: {INSTALL_COMMAND} (or update the "
            f"model's code files to a newer iha release). Set {SKIP_SELF_CHECK_VARIABLE}=1 to load anyway."
        )
    transformers.logging.get_logger(__name__).warning(
        f"transformers {version} is newer than the releases IHA was tested with ({supported_range_text()}); its "
        "cache self-check passed."
    )


def cache_path_self_check(config_class, causal_lm_class) -> str | None:
    """Run the self-check of `check_untested_release`; returns what failed, or None.

    Everything is built and initialised here, on the CPU, with its own random generator: the check may run while
    the caller is inside a default-device or no-init context, and must leave the global random state as it was.
    """
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
            return _run_cache_path_self_check(config_class, causal_lm_class)
    except Exception as error:  # an API change can just as well make the check itself crash
        return f"the check could not run ({type(error).__name__}: {error})"


def _initialise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter set by hand (no-init contexts turn the usual initialisation off): norms to one, IHA mixing
    to identity (the modules that offer `identity_tensors`), everything else small and random."""
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if hasattr(module, "identity_tensors"):
                parameter.copy_(module.identity_tensors()[name])
            elif parameter.ndim == 1:
                parameter.fill_(1.0)
            else:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def _run_cache_path_self_check(config_class, causal_lm_class) -> str | None:

    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, sizes["vocab_size"], (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)

    llama = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    if any(parameter.is_meta for parameter in llama.parameters()):
        return (
            "it ran where new weights have no data (an empty-weights context): import the model class once outside it"
        )
    _initialise(llama, generator)
    exact = dict(iha_position_mode="shared", iha_mask_mode="flat_causal", iha_collapse_init="last")
    iha = causal_lm_class(config_class(**sizes, **exact, num_pseudo_heads=2)).eval()
    _initialise(iha, generator)
    missing, _ = iha.load_state_dict(llama.state_dict(), strict=False)
    if any(".head_mixing." not in name for name in missing):
        return f"the Llama weights did not fit the IHA model ({missing})"
    logits_difference = (
        llama(input_ids, attention_mask=attention_mask).logits - iha(input_ids, attention_mask=attention_mask).logits
    )
    largest = logits_difference.abs().max().item()
    if not largest < 1e-4:
        return f"logits differ from Llama's by {largest:.2e} at identity mixing"
    llama_tokens = llama.generate(input_ids, attention_mask=attention_mask, **greedy)
    if not torch.equal(iha.generate(input_ids, attention_mask=attention_mask, **greedy), llama_tokens):
        return "cached greedy generation differs from Llama's at identity mixing"

    # Random mixing, a sliding IHA layer beside a full one: every cache class against no cache at all. The window in
    # virtual units, as conversions write it: its sliding caches keep one token more (`masking_iha`).
    mixed = causal_lm_class(
        config_class(
            **sizes,
            num_pseudo_heads=2,
            attention_types=["iha_sliding_attention", "iha_full_attention"],
            sliding_window=4,
            iha_window_unit="virtual",
        )
    ).eval()
    _initialise(mixed, generator)
    for parameter_name, parameter in mixed.named_parameters():
        if ".head_mixing." in parameter_name:
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    uncached = mixed.generate(input_ids, attention_mask=attention_mask, use_cache=False, **greedy)
    for cache_name, options in {"DynamicCache": {}, "StaticCache": {"cache_implementation": "static"}}.items():
        if not torch.equal(mixed.generate(input_ids, attention_mask=attention_mask, **options, **greedy), uncached):
            return f"greedy generation with {cache_name} differs from generation without a cache"
    return None
