"""Convert pretrained checkpoints (Llama 2/3, SmolLM/SmolLM2/SmolLM3, Mistral, Qwen2, Qwen3, Gemma 3) to Interleaved
Head Attention.

By default the converted model computes what the source computed: the weights are copied unchanged, every attention
layer becomes an IHA layer with the source's own window, the head mixing starts at identity, positions are shared
by the P pseudo-tokens of a token, the mask is the paper's flat causal mask and the collapse selects the last
pseudo-head. Other settings (virtual positions, the paper's hybrid layout, a different collapse init, a narrower
dtype) change the function: the converter says so and measures by how much.

Three entry points:

- `llama_to_iha(model, options)`: an already loaded model, in memory.
- `convert_checkpoint(source, output_dir, options)`: a local folder or Hub id to a Hub-ready folder, streaming
  the weights tensor by tensor (never two models in memory), verified against the source, written atomically.
- `iha-convert SRC DST [options]` (`iha.cli.convert`).

One job per module:

    architectures.py    the architectures that convert, and how the command line names them
    options.py          the settings, typed: IHAConversionOptions (what the model computes), CheckpointOptions
    errors.py           ConversionError and its kinds
    plan.py             source config + settings -> IHA config, and what the settings change
    in_memory.py        llama_to_iha
    readers.py          finding the source (folder or Hub id), its config, reading its weight files
    safetensors_file.py the safetensors format, read and written one tensor at a time
    writers.py          the output tensors, the shards, config and code files, tokenizer and license files
    verify.py           source and converted model on the same inputs, logits compared
    report.py           ConversionReport: what a conversion did and measured (iha_conversion.json)
    card.py             the model card of a converted folder
    checkpoint.py       convert_checkpoint
"""

from .architectures import SUPPORTED_ARCHITECTURES
from .checkpoint import convert_checkpoint
from .errors import ConversionError, UnsupportedArchitectureError, VerificationFailedError
from .in_memory import llama_to_iha
from .options import CheckpointOptions, IHAConversionOptions
from .plan import plan_conversion
from .report import ConversionReport
from .verify import verify_conversion


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointOptions",
    "ConversionError",
    "ConversionReport",
    "IHAConversionOptions",
    "UnsupportedArchitectureError",
    "VerificationFailedError",
    "convert_checkpoint",
    "llama_to_iha",
    "plan_conversion",
    "verify_conversion",
]
