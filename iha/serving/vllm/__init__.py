"""The vLLM plugin that serves IHA folders: `LLM("folder")`, `vllm serve folder`.

Installed with the package, it is a `vllm.general_plugins` entry point (setup.py), so vLLM calls `register()` in
every process it starts: the IHA architectures go into vLLM's `ModelRegistry` (imported lazily, when a folder names
them) and the IHA attention backends into its backend registry. Importing `iha` registers the config classes with
transformers' `AutoConfig`, so vLLM reads an IHA folder's config.json without remote code.
"""

IHA_ARCHITECTURES = ("IHAForCausalLM", "IHAGemma3ForCausalLM")


def register() -> None:
    """Register the IHA model classes and attention backends with vLLM (safe to call again)."""
    from vllm import ModelRegistry

    import iha  # noqa: F401  (registers the IHA configs with AutoConfig)

    from .attention import register_backends

    register_backends()
    for architecture in IHA_ARCHITECTURES:
        # One class for both: Gemma 3 folders are refused in one line when their model is built.
        ModelRegistry.register_model(architecture, "iha.serving.vllm.model:IHAForCausalLM")
