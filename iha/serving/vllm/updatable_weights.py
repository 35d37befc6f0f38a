"""Weights a trainer can update in a running engine on vLLM's CPU build: TRL's GRPO with `use_vllm=True`.

A trainer with vLLM rollouts (TRL's colocate mode) pushes its weights into the engine between steps, one
`model.load_weights([(name, tensor)])` call per tensor. On a GPU the layers read their live weights, so that works
as it does for any vLLM model. vLLM's CPU build instead repacks every linear layer's weight for its GEMM kernels once
the weights have loaded, and frees the original (`dispatch_cpu_unquantized_gemm` in 0.32.0), and packs a copy of the
output embedding: a later update has no tensor to write into, or writes into one the logits no longer read (measured
here: oneDNN's packed product keeps the old values after the weight changes in place). That holds for every model on
the CPU build, vLLM's own Llama included.

With `IHA_VLLM_UPDATABLE_WEIGHTS=1` in the environment when the engine starts, the plugin keeps its linear layers
unpacked (`torch.nn.functional.linear` over the live weight, vLLM's own fallback for layers that skip the dispatch)
and packs the output embedding again after every update of it. It is off by default: the packed kernels are faster.
Without it, an update on the CPU build is refused in one line that names the variable.
"""

import os

from torch import nn
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.platforms import current_platform

from .support import UnsupportedByVLLMError


UPDATABLE_WEIGHTS_VARIABLE = "IHA_VLLM_UPDATABLE_WEIGHTS"


def updatable_weights_requested() -> bool:
    return os.environ.get(UPDATABLE_WEIGHTS_VARIABLE, "0").strip().lower() in ("1", "true", "yes")


def packs_weights_at_load() -> bool:
    """Whether vLLM repacks the weights once they have loaded (its CPU build)."""
    return current_platform.is_cpu()


def keep_linear_weights_unpacked(model: nn.Module) -> None:
    """Mark every linear layer of `model` to skip the CPU build's repacking (called before the weights load)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            # The flag vLLM's `UnquantizedLinearMethod.process_weights_after_loading` reads on CPU.
            module._cpu_skip_gemm_dispatch = True


def engine_has_started(output_embedding: nn.Module) -> bool:
    """Whether the CPU build has processed the loaded weights (it then gives the embedding a `cpu_linear`)."""
    return hasattr(output_embedding, "cpu_linear")


def refuse_update_of_packed_weights() -> None:
    raise UnsupportedByVLLMError(
        "vLLM's CPU build packed this engine's weights when they loaded, so they cannot be updated in place (a "
        "trainer's weight sync, e.g. TRL's GRPO with use_vllm=True): set "
        f"{UPDATABLE_WEIGHTS_VARIABLE}=1 in the environment before the engine starts."
    )


def repack_output_embedding(output_embedding: nn.Module) -> None:
    """Pack the output embedding's live weight again, so that the logits read the updated values."""
    dispatch_cpu_unquantized_gemm(output_embedding, remove_weight=False)
