"""IHA's exact fast paths for transformers, installed with the package and registered when `iha` is imported.

A converted folder's model (`iha/models/iha/`, what travels with the weights) attends with transformers' own functions,
which are correct for IHA's virtual sequence but do work a cheaper exact kernel skips, and it cannot run under
continuous batching by itself. It looks up faster paths by name in transformers' registries, `iha|<backend>`; this
wing registers them (`register_attention_paths`, called by `import iha`):

- `iha|sdpa` (`sdpa.py`): blocked sliding windows (`blocked_local.py`), attention per packed document
  (`packed_documents.py`) and a dense-mask SDPA that shares KV heads on CPU; mask and attention function.
- `iha|paged` (`continuous_batching.py`): continuous batching, request by request on the paged cache.

docs/serving.md measures what a folder loaded without the package costs.
"""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..models.iha.masking_iha import INSTALLED_PATH_PREFIX
from .continuous_batching import ContinuousBatchingPath
from .sdpa import iha_sdpa_attention, iha_sdpa_mask


def register_attention_paths() -> None:
    """Register the fast paths with transformers' attention and mask registries (safe to call again)."""
    AttentionInterface.register(INSTALLED_PATH_PREFIX + "sdpa", iha_sdpa_attention)
    AttentionMaskInterface.register(INSTALLED_PATH_PREFIX + "sdpa", iha_sdpa_mask)
    AttentionInterface.register(INSTALLED_PATH_PREFIX + "paged", ContinuousBatchingPath())


__all__ = ["register_attention_paths"]
