"""The plugin's checks where vLLM checks a model's config: before the engine starts, in the user's own process.

vLLM runs a per-architecture hook, `MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)`, when it
builds its `VllmConfig` (`VllmConfig.try_verify_and_update_config`): in the process that parses `vllm serve`'s
arguments or runs `LLM(...)`, before any engine process starts. `register_config_check` puts the IHA architectures
there, so a folder or a setting the plugin cannot serve stops with the plugin's sentence as the last line printed,
not inside a worker's traceback under "Engine core initialization failed". The model checks again when it is built
(`model.IHAForCausalLM`), for engines whose config was made another way.
"""

import vllm
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

from .support import check_servable, check_vllm_release


def check_engine_config(vllm_config) -> None:
    """Refuse, in one line, a vLLM release, folder or engine setting the plugin does not serve exactly."""
    from vllm.platforms import current_platform

    check_vllm_release(vllm.__version__)
    parallel = vllm_config.parallel_config
    requested_backend = vllm_config.attention_config.backend
    check_servable(
        vllm_config.model_config.hf_config,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        device_type=current_platform.device_type,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        decode_context_parallel_size=parallel.decode_context_parallel_size,
        prefill_context_parallel_size=parallel.prefill_context_parallel_size,
        attention_backend=getattr(requested_backend, "name", requested_backend),
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        lora=vllm_config.lora_config is not None,
    )


class IHAConfigCheck(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook for the IHA architectures: checks, changes nothing."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_engine_config(vllm_config)


def register_config_check(architectures) -> None:
    for architecture in architectures:
        MODELS_CONFIG_MAP[architecture] = IHAConfigCheck
