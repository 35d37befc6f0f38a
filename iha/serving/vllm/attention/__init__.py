"""IHA attention on vLLM's stock paged kernels: the backends, named in vLLM's registry and picked per platform.

- `virtual.py`: what both share, the interleaved sequence in the pages' bytes and the batch in virtual units;
- `cpu.py`: vLLM's CPU attention (`IHA_CPU_ATTN`, on `CPU_ATTN`'s builder and implementation);
- `flash.py`: vLLM's FlashAttention (`IHA_FLASH_ATTN`, on `FLASH_ATTN`'s), imported only on CUDA platforms.

They subclass vLLM 0.32.0's backends and read some of their internals (`support.TESTED_VLLM_RELEASES`).
"""

import importlib


IHA_CPU_BACKEND_NAME = "IHA_CPU_ATTN"
IHA_FLASH_BACKEND_NAME = "IHA_FLASH_ATTN"
IHA_BACKENDS = {
    IHA_CPU_BACKEND_NAME: f"{__name__}.cpu.IHACPUAttentionBackend",
    IHA_FLASH_BACKEND_NAME: f"{__name__}.flash.IHAFlashAttentionBackend",
}


def iha_attention_backend() -> type:
    """The IHA backend of this platform: CPU attention on CPUs, FlashAttention on CUDA GPUs (`support.check_servable`
    refuses other platforms and other backends asked for, before the engine starts)."""
    from vllm.platforms import current_platform

    name = IHA_CPU_BACKEND_NAME if current_platform.is_cpu() else IHA_FLASH_BACKEND_NAME
    module, _, backend_class = IHA_BACKENDS[name].rpartition(".")
    return getattr(importlib.import_module(module), backend_class)


def register_backends() -> None:
    """Give the IHA backends their names in vLLM's backend registry (the `Attention` layer looks its backend up by
    name). Safe to call again: vLLM loads plugins once per process, but tests may call it more often."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, class_path in IHA_BACKENDS.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, class_path)
