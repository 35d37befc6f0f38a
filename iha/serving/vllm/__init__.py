"""The vLLM plugin that serves IHA folders: `LLM("folder")`, `vllm serve folder`.

Installed with the package, it is a `vllm.general_plugins` entry point (setup.py), so vLLM calls `register()` in
every process it starts, the user's own first: the IHA architectures go into vLLM's `ModelRegistry` (imported lazily,
when a folder names them) and its per-architecture config checks (`config_check.py`: a folder or setting the plugin
cannot serve is refused before the engine starts), and the IHA attention backends into its backend registry.
Importing `iha` registers the config classes with transformers' `AutoConfig`, so vLLM reads an IHA folder's
config.json without remote code.

The modules, by job: `support.py` (what is served: rules on configs, no vLLM), `config_check.py` (those rules where
vLLM checks its config), `model.py` (vLLM's Llama with IHA attention), `gemma3.py` (vLLM's Gemma 3 with it),
`self_attention.py` (that attention, which folds the head mixing into the projections with `iha.models.folding`),
`mixing.py` (the explicit head mixing, where it does not fold), `attention/` (the backends), `updatable_weights.py`
(weight syncs on the CPU build).
"""

# architecture -> the class that serves it.
IHA_ARCHITECTURES = {
    "IHAForCausalLM": "iha.serving.vllm.model:IHAForCausalLM",
    "IHAGemma3ForCausalLM": "iha.serving.vllm.gemma3:IHAGemma3ForCausalLM",
}


def register() -> None:
    """Register the IHA model classes, config checks and attention backends with vLLM (safe to call again)."""
    from vllm import ModelRegistry

    import iha  # noqa: F401  (registers the IHA configs with AutoConfig)

    from .attention import register_backends
    from .config_check import register_config_check

    register_backends()
    register_config_check(IHA_ARCHITECTURES)
    for architecture, class_path in IHA_ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, class_path)
