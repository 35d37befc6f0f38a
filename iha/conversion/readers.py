"""Reading the source checkpoint: finding it (a local folder or a Hub id), its config, and its weight files
tensor by tensor (safetensors, or pickle weights only when allowed)."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from transformers import AutoConfig

from ..utils.model_source import check_model_source
from .errors import ConversionError
from .safetensors_file import copy_bytes, read_header


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Files that travel with the weights under the source's license terms.
LICENSE_FILE_PATTERNS = ("LICENSE*", "NOTICE*", "USE_POLICY.md")
HUB_DOWNLOAD_PATTERNS = [
    "config.json",
    "generation_config.json",
    # transformers' own names only: some repos also hold other formats (e.g. Mistral's consolidated.safetensors).
    "model*.safetensors",
    "model.safetensors.index.json",
    "README.md",
    *LICENSE_FILE_PATTERNS,
    *TOKENIZER_FILES,
]
PICKLE_DOWNLOAD_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


@dataclass
class SourceTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    reader: "SafetensorsReader | PickleReader"


class SafetensorsReader:
    """Reads tensors from one .safetensors file one at a time with plain reads (no mmap of the whole file)."""

    def __init__(self, path: Path):
        self.path = path
        self.data_start, self.entries = read_header(path)
        self.file = open(path, "rb")  # kept open for the tensor reads; closed by `close`

    def tensors(self) -> list[SourceTensor]:
        return [SourceTensor(name, dtype, shape, self) for name, (dtype, shape, _, _) in self.entries.items()]

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        self.file.seek(self.data_start + begin)
        data = bytearray(self.file.read(end - begin))
        if len(data) != end - begin:
            raise ConversionError(f"{self.path} is truncated: tensor {name} is incomplete.")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def copy_raw(self, name: str, out_file) -> None:
        """Copy the tensor's bytes unchanged (same dtype in and out) to the unbuffered `out_file`; no tensor is built."""
        _, _, begin, end = self.entries[name]
        try:
            copy_bytes(self.file, self.data_start + begin, end - begin, out_file)
        except EOFError:
            raise ConversionError(f"{self.path} is truncated: tensor {name} is incomplete.") from None

    def close(self):
        self.file.close()


class PickleReader:
    """Reads a PyTorch .bin file with `torch.load(weights_only=True)`: tensors only, no arbitrary objects."""

    def __init__(self, path: Path):
        self.path = path
        try:
            try:
                self.state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                # Files in the legacy (pre-zip) format cannot be memory-mapped.
                self.state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConversionError(
                f"Could not read {path.name} with torch.load(weights_only=True): {error}. The file holds more than "
                "tensors, or is damaged; iha does not load arbitrary pickled objects."
            ) from error
        if not isinstance(self.state_dict, dict):
            raise ConversionError(f"{path.name} does not hold a state dict (got {type(self.state_dict).__name__}).")

    def tensors(self) -> list[SourceTensor]:
        return [
            SourceTensor(name, tensor.dtype, tuple(tensor.shape), self)
            for name, tensor in self.state_dict.items()
            if isinstance(tensor, torch.Tensor)
        ]

    def read(self, name: str) -> torch.Tensor:
        return self.state_dict[name]

    def close(self):
        self.state_dict = None


def find_weight_files(folder: Path, allow_pickle: bool) -> tuple[str, list[Path]]:
    """("safetensors" | "pickle", files) for a transformers checkpoint folder; refuses pickle unless allowed."""
    for kind, index_name, single_name in (
        ("safetensors", "model.safetensors.index.json", "model.safetensors"),
        ("pickle", "pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (folder / index_name).is_file():
            try:
                weight_map = json.loads((folder / index_name).read_text(encoding="utf-8"))["weight_map"]
                files = [folder / name for name in sorted(set(weight_map.values()))]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConversionError(
                    f"{folder / index_name} is not a valid weight index (JSON with a 'weight_map' from tensor names "
                    "to file names); the checkpoint looks damaged."
                ) from None
        elif (folder / single_name).is_file():
            files = [folder / single_name]
        else:
            continue
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ConversionError(f"{folder} lists weight files that are not there: {missing}.")
        if kind == "pickle" and not allow_pickle:
            raise ConversionError(
                f"{folder} has only pickle weights ({files[0].name}). Loading a pickle can run arbitrary code, so "
                "iha refuses it by default. If you trust this checkpoint, pass --allow_pickle (allow_pickle=True): "
                "it is then read with torch.load(weights_only=True), which loads tensors only."
            )
        return kind, files
    raise ConversionError(
        f"No weights found in {folder}: expected model.safetensors, model.safetensors.index.json (sharded), or, "
        "with --allow_pickle, pytorch_model.bin."
    )


def open_weight_files(kind: str, weight_files: list[Path]) -> tuple[list, dict[str, SourceTensor]]:
    """(the open readers, every source tensor by name); a tensor in two files is an error. Close the readers."""
    reader_class = SafetensorsReader if kind == "safetensors" else PickleReader
    readers, sources = [], {}
    try:
        for path in weight_files:
            reader = reader_class(path)
            readers.append(reader)
            for tensor in reader.tensors():
                if tensor.name in sources:
                    raise ConversionError(f"Tensor {tensor.name} appears in two weight files.")
                sources[tensor.name] = tensor
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers, sources


def resolve_source(
    source: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    allow_pickle: bool = False,
) -> tuple[Path, str | None]:
    """(local folder, Hub id or None): a local folder as is; a Hub id is downloaded with huggingface_hub's
    `snapshot_download` (config, tokenizer, safetensors; pickle weights only with `allow_pickle`), which also
    serves it from the local Hugging Face cache when offline."""
    try:
        source = check_model_source(source)
    except ValueError as error:
        raise ConversionError(str(error)) from None
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None

    def download(patterns):
        return Path(
            snapshot_download(source, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=patterns)
        )

    try:
        folder = download(HUB_DOWNLOAD_PATTERNS)
        has_safetensors = any(folder.glob("model*.safetensors"))
        if not has_safetensors and allow_pickle:
            folder = download(HUB_DOWNLOAD_PATTERNS + PICKLE_DOWNLOAD_PATTERNS)
    except LocalEntryNotFoundError as error:
        raise ConversionError(
            f"{source} is not a local folder, and the Hub cannot be reached to download it ({error}). Check the "
            "network and that HF_HUB_OFFLINE is not set, or pass a local folder."
        ) from error
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ConversionError(
            f"The Hub repository {source} was not found or is not accessible ({type(error).__name__}). Check the id; "
            "for private or gated models log in with `hf auth login` or pass --token."
        ) from error
    except RevisionNotFoundError as error:
        raise ConversionError(f"The Hub repository {source} has no revision {revision!r}.") from error
    except Exception as error:  # network and HTTP errors
        raise ConversionError(f"Downloading {source} from the Hub failed: {error}") from error
    if not (folder / "config.json").is_file():
        raise ConversionError(f"The Hub repository {source} has no config.json; it is not a transformers checkpoint.")
    if not has_safetensors and not allow_pickle:
        raise ConversionError(
            f"The Hub repository {source} has no safetensors weights. If it has pickle (.bin) weights and you trust "
            "it, pass --allow_pickle (allow_pickle=True): they are then read with torch.load(weights_only=True)."
        )
    return folder, source


def read_source_config(source_dir: Path):
    """The source's config through AutoConfig, or one clear error when config.json is missing or unreadable."""

    path = source_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{source_dir} has no config.json; it is not a transformers checkpoint folder.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ConversionError(f"{path} is not valid JSON ({error}); the checkpoint folder looks damaged.") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object; it is not a model config.")
    try:
        return AutoConfig.from_pretrained(source_dir)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"transformers cannot read {path}: {error}") from None
