"""The architectures `iha-convert` converts, by the names config.json gives them, and how the command line, its
refusal of anything else and the README describe them. Imports nothing: `iha-convert --help` reads it."""

# Architecture name in config.json -> the model_type it must come with.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma3ForCausalLM": "gemma3_text",
}
# What each converts from, in the words a user looks for.
SUPPORTED_MODELS = {
    "LlamaForCausalLM": "Llama 2, Llama 3 incl. llama3 rope scaling, SmolLM, SmolLM2",
    "MistralForCausalLM": "with or without sliding window",
    "Qwen2ForCausalLM": "q/k/v bias",
    "Qwen3ForCausalLM": "dense Qwen3: per-head q/k norm",
    "SmolLM3ForCausalLM": "NoPE layers",
    "Gemma3ForCausalLM": "Gemma 3 text models such as 270M and 1B",
}
SUPPORTED_DESCRIPTION = ", ".join(f"{name} ({models})" for name, models in SUPPORTED_MODELS.items())
# The families, for one-line summaries (`iha-convert --help`, `iha --help`).
SUPPORTED_FAMILIES = "Llama 2/3, SmolLM/SmolLM2/SmolLM3, Mistral, Qwen2, Qwen3, Gemma 3"
