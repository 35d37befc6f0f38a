"""Writing the IHA checkpoint: which tensors it holds and where each comes from, the safetensors shards (streamed
tensor by tensor), the config with the code files that let it load without `iha`, and the source's tokenizer,
license and generation config."""

import copy
import inspect
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from ..models.iha.configuration_iha import IHAConfig
from ..models.iha.modeling_iha import IHAHeadMixing
from ..utils.atomic_files import write_text_atomic
from .errors import ConversionError
from .plan import IGNORED_SOURCE_SUFFIXES, iha_causal_lm_class
from .readers import LICENSE_FILE_PATTERNS, TOKENIZER_FILES, SafetensorsReader, SourceTensor
from .safetensors_file import encode_header, write_all


logger = logging.getLogger(__name__)

# The folder that travels with the weights (`iha/models/iha/`): every module in it but its `__init__` and the plain
# reference `naive_iha` is copied next to the weights, so that a converted folder loads with `trust_remote_code`
# where `iha` is not installed. The list is read from the folder, never written by hand.
MODEL_FOLDER = Path(inspect.getfile(IHAConfig)).resolve().parent
NOT_TRAVELLING = ("__init__.py", "naive_iha.py")
TRAVELLING_FILES = tuple(sorted(path.name for path in MODEL_FOLDER.glob("*.py") if path.name not in NOT_TRAVELLING))
# Gemma 3's block imports the Llama-family files; those do not need Gemma 3's.
GEMMA3_CODE_FILES = tuple(name for name in TRAVELLING_FILES if name.endswith("_gemma3.py"))
CODE_FILES = tuple(name for name in TRAVELLING_FILES if name not in GEMMA3_CODE_FILES)
# The `auto_map` of each IHA model type.
AUTO_MAPS = {
    "iha": {
        "AutoConfig": "configuration_iha.IHAConfig",
        "AutoModel": "modeling_iha.IHAModel",
        "AutoModelForCausalLM": "modeling_iha.IHAForCausalLM",
    },
    "iha_gemma3": {
        "AutoConfig": "configuration_iha_gemma3.IHAGemma3Config",
        "AutoModel": "modeling_iha_gemma3.IHAGemma3TextModel",
        "AutoModelForCausalLM": "modeling_iha_gemma3.IHAGemma3ForCausalLM",
    },
}


def code_files(model_type: str) -> tuple[str, ...]:
    return CODE_FILES + GEMMA3_CODE_FILES if model_type == "iha_gemma3" else CODE_FILES


@dataclass
class OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: SourceTensor | None = None
    value: torch.Tensor | None = None  # generated tensors (the head mixing at identity)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def natural_key(name: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def plan_output_tensors(
    iha_config: IHAConfig, sources: dict[str, SourceTensor], dtype: torch.dtype | None
) -> tuple[list[OutputTensor], set[tuple[torch.dtype, torch.dtype]]]:
    """Every tensor of the IHA checkpoint with its source (or identity value); checks names and shapes.

    The expected names and shapes come from the IHA model itself, built on the meta device (no memory).
    Returns the tensors and the set of (source dtype, output dtype) casts for floating-point weights.
    """
    with torch.device("meta"):
        meta_model = iha_causal_lm_class(iha_config.model_type)(iha_config)
    expected = {name: tuple(tensor.shape) for name, tensor in meta_model.state_dict().items()}
    if iha_config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ignored = {name for name in sources if name.endswith(IGNORED_SOURCE_SUFFIXES)}
    if iha_config.tie_word_embeddings and "lm_head.weight" in sources:
        ignored.add("lm_head.weight")  # tied: the model rebuilds it from the embedding

    generated_names = {name for name in expected if ".head_mixing." in name}
    missing = sorted(set(expected) - generated_names - set(sources), key=natural_key)
    unexpected = sorted(set(sources) - set(expected) - ignored, key=natural_key)
    if missing or unexpected:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " The config says tie_word_embeddings=false but the checkpoint has no lm_head.weight."
        raise ConversionError(
            f"The checkpoint's tensors do not match its config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
            + hint
        )
    mismatched = [
        f"{name}: {sources[name].shape} vs {shape}"
        for name, shape in expected.items()
        if name in sources and sources[name].shape != shape
    ]
    if mismatched:
        raise ConversionError(f"Tensor shapes do not match the config: {mismatched[:8]}.")

    embedding_dtype = sources["model.embed_tokens.weight"].dtype
    identity = IHAHeadMixing(
        iha_config.num_attention_heads,
        iha_config.num_key_value_heads,
        iha_config.num_pseudo_heads,
        collapse_mode=iha_config.iha_collapse_mode,
        collapse_init=iha_config.iha_collapse_init,
    ).identity_tensors()

    outputs, casts = [], set()
    for name in sorted(expected, key=natural_key):
        if name in generated_names:
            # The mixing stays fp32 in a 16-bit checkpoint: in bf16 its identity entries could not learn.
            target_dtype = torch.promote_types(dtype or embedding_dtype, torch.float32)
            value = identity[name.rpartition(".")[2]].to(target_dtype).contiguous()
            outputs.append(OutputTensor(name, target_dtype, tuple(value.shape), value=value))
            continue
        source = sources[name]
        target_dtype = dtype if (dtype is not None and source.dtype.is_floating_point) else source.dtype
        if source.dtype.is_floating_point:
            casts.add((source.dtype, target_dtype))
        outputs.append(OutputTensor(name, target_dtype, source.shape, source=source))
    return outputs, casts


def shard_tensors(tensors: list[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    """Fill shards in order up to `max_shard_bytes` (a tensor bigger than that gets a shard of its own)."""
    shards, current, current_bytes = [], [], 0
    for tensor in tensors:
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current:
        shards.append(current)
    return shards


def tensor_bytes(tensor: torch.Tensor):
    """A tensor's raw little-endian bytes as a buffer (works for bfloat16, which numpy cannot hold)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors_file(path: Path, tensors: list[OutputTensor], progress) -> None:
    """Write one .safetensors file tensor by tensor: the header first (all shapes are known), then the data."""
    header = encode_header([(tensor.name, tensor.dtype, tensor.shape, tensor.nbytes) for tensor in tensors])
    # Unbuffered: raw tensor copies go straight to the file descriptor, interleaved with our own writes.
    with open(path, "wb", buffering=0) as file:
        write_all(file, header)
        for tensor in tensors:
            source = tensor.source
            if source is None:
                write_all(file, tensor_bytes(tensor.value))
            elif source.dtype == tensor.dtype and isinstance(source.reader, SafetensorsReader):
                source.reader.copy_raw(source.name, file)
            else:
                write_all(file, tensor_bytes(source.reader.read(source.name).to(tensor.dtype)))
            progress.update(tensor.nbytes)


def write_weights(folder: Path, tensors: list[OutputTensor], max_shard_bytes: int, show_progress: bool) -> list[str]:
    """Write the safetensors shard(s), and the index when there is more than one. Returns the file names."""

    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total_bytes = sum(tensor.nbytes for tensor in tensors)
    with tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="Writing IHA weights",
        disable=not show_progress,
    ) as progress:
        for name, shard in zip(names, shards):
            write_safetensors_file(folder / name, shard, progress)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {tensor.name: name for name, shard in zip(names, shards) for tensor in shard},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_config_and_code(folder: Path, config: IHAConfig) -> None:
    """config.json with `auto_map`, and the code files (`code_files`), so the folder loads without `iha`."""
    config = copy.deepcopy(config)
    config.auto_map = AUTO_MAPS[config.model_type]
    config.save_pretrained(folder)
    for name in code_files(config.model_type):
        shutil.copyfile(MODEL_FOLDER / name, folder / name)


def pin_tokenizer_class(source_dir: Path, folder: Path) -> None:
    """Name the source's tokenizer class in the converted `tokenizer_config.json` where the source leaves it out.

    Without a `tokenizer_class`, `AutoTokenizer` picks the class from the model type in `config.json`: `llama`,
    `qwen2`, ... for the source, but `iha` (unknown to transformers) for the converted folder, which would then get
    a generic tokenizer instead of the source's. Naming the class the source resolves to keeps them the same.
    """

    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if tokenizer_config.get("tokenizer_class"):
        return
    try:
        tokenizer_class = type(AutoTokenizer.from_pretrained(source_dir)).__name__
    except Exception as error:  # an unusable tokenizer stays as copied; verification reports on the weights anyway
        logger.warning(f"The tokenizer of {source_dir} does not load ({error}); copied as it is.")
        return
    tokenizer_config["tokenizer_class"] = tokenizer_class
    write_text_atomic(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", config_path)


def copy_source_files(source_dir: Path, folder: Path, source_config) -> None:
    """Tokenizer files (with the chat template), license files, and the generation config (made if absent)."""
    tokenizer_files = [name for name in TOKENIZER_FILES if (source_dir / name).is_file()]
    for name in tokenizer_files:
        shutil.copyfile(source_dir / name, folder / name)
    if not tokenizer_files:
        logger.warning(
            f"{source_dir} has no tokenizer files, so the converted folder has none either: copy the tokenizer in "
            "before using it with pipeline() or pushing it."
        )
    else:
        pin_tokenizer_class(source_dir, folder)
    for pattern in LICENSE_FILE_PATTERNS:
        for path in source_dir.glob(pattern):
            if path.is_file():
                shutil.copyfile(path, folder / path.name)
    if (source_dir / "generation_config.json").is_file():
        shutil.copyfile(source_dir / "generation_config.json", folder / "generation_config.json")
    else:
        GenerationConfig.from_model_config(source_config).save_pretrained(folder)
