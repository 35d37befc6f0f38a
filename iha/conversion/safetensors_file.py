"""The safetensors format, read and written one tensor at a time: header parsing and writing, raw byte copies.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and byte offsets
into the data; `__metadata__`), then the raw data. safetensors' own Python API does not fit the converter:
`save_file` serializes a whole dict of tensors held in memory (a 5 GB shard would take 5 GB, and more while it is
serialized), and `safe_open` hands out tensors, not byte ranges. Here, memory holds one tensor at a time; a tensor
whose dtype does not change is copied file to file, bit for bit, without being built (by the kernel, with
`copy_file_range`, where it can); and a truncated or damaged file gets one clear error instead of a crash on a
memory-mapped read. Tests load the files written here with safetensors' own `safe_open`.
"""

import errno
import json
import os
from pathlib import Path

import torch

from .errors import ConversionError


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_header(path: Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """(where the data starts, {tensor name: (dtype, shape, begin, end)}) of a .safetensors file, checked against
    the file's size; a damaged or truncated file, or a dtype iha cannot convert, is a `ConversionError`."""
    try:
        with open(path, "rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            if not 2 <= header_size <= path.stat().st_size - 8:
                raise ValueError(f"header size {header_size}")
            header = json.loads(file.read(header_size))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
        raise ConversionError(f"{path} is not a valid safetensors file ({error}).") from None
    data_start = 8 + header_size
    data_size = path.stat().st_size - data_start
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not valid_entry(entry):
            raise ConversionError(
                f"{path} is not a valid safetensors file: the header entry of tensor {name} is "
                f'{repr(entry)[:100]}, not {{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}}.'
            )
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{path.name}: tensor {name} has dtype {entry['dtype']}, which iha cannot convert.")
        if entry["data_offsets"][1] > data_size:
            raise ConversionError(
                f"{path} is truncated: tensor {name} ends at byte {entry['data_offsets'][1]} of the data, but the "
                f"file holds {data_size} bytes of data. Download or copy the checkpoint again."
            )
        entries[name] = (SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), *entry["data_offsets"])
    return data_start, entries


def valid_entry(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(size, int) and size >= 0 for size in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
        return False
    return 0 <= offsets[0] <= offsets[1]


def encode_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> bytes:
    """The bytes that start a file holding `tensors` (name, dtype, shape, size in bytes), in that order."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    return len(header_bytes).to_bytes(8, "little") + header_bytes


def write_all(file, data) -> None:
    """Write every byte to an unbuffered file (a raw write may write only part of a large buffer)."""
    view = memoryview(data).cast("B")
    while view:
        written = file.write(view)
        view = view[written:]


def copy_bytes(source_file, offset: int, length: int, out_file, chunk_size: int = 1 << 24) -> None:
    """Copy `length` bytes from `offset` of `source_file` to the unbuffered `out_file` at its position.

    The kernel copies file to file where it can (copy_file_range), else 16 MiB chunks go through memory.
    Raises EOFError when the source ends early.
    """
    if hasattr(os, "copy_file_range"):
        try:
            while length:
                copied = os.copy_file_range(source_file.fileno(), out_file.fileno(), length, offset)
                if copied == 0:
                    raise EOFError
                offset, length = offset + copied, length - copied
            return
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
    source_file.seek(offset)
    while length:
        chunk = source_file.read(min(chunk_size, length))
        if not chunk:
            raise EOFError
        write_all(out_file, chunk)
        length -= len(chunk)
