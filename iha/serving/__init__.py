"""Serving IHA models: `iha serve` (an OpenAI-compatible server for local and small-scale use, on transformers) and
the vLLM plugin (`iha.serving.vllm`, registered through vLLM's `vllm.general_plugins` entry point) for serving at
scale."""
