"""`iha export llama FOLDER OUT` (a P = 1 IHA folder as a stock Llama / Mistral / Qwen2 / SmolLM3 folder) and
`iha export mlx FOLDER` (the MLX model file that stock mlx-lm reads with --trust-remote-code): `iha.export`."""

import argparse
from collections.abc import Sequence

from .arguments import ArgumentParser
from .running import run_command


def make_parser(prog: str = "iha export") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Export an IHA folder for other runtimes: `llama` folds a single-pseudo-head (P = 1) folder into "
        "a stock folder of its source architecture (no IHA code needed anywhere); `mlx` adds the MLX model file "
        "that `mlx_lm.generate --trust-remote-code` reads.",
    )
    targets = parser.add_subparsers(dest="target", required=True, metavar="{llama,mlx}")
    llama = targets.add_parser(
        "llama",
        help="fold a P = 1 IHA folder into a stock Llama / Mistral / Qwen2 / SmolLM3 folder",
        description="Fold the head mixing and collapse of a P = 1 IHA folder into q_proj, k_proj, v_proj and "
        "o_proj, and write a stock folder of the source's architecture (config, weights, tokenizer). Refused: "
        "P > 1, and per-head q/k norms before the mixing (Qwen3, Gemma 3).",
    )
    llama.add_argument("folder", help="the IHA folder (converted or trained) with num_pseudo_heads = 1")
    llama.add_argument("output_dir", help="folder to write; must not exist or be empty unless --overwrite")
    llama.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder once written")
    llama.add_argument(
        "--no_verify",
        dest="verify",
        action="store_false",
        help="skip comparing the two folders' logits in float32 (on by default)",
    )
    mlx = targets.add_parser(
        "mlx",
        help="add the MLX model file to an IHA folder (mlx_lm.generate --trust-remote-code)",
        description="Copy the MLX model file into FOLDER and name it in config.json (`model_file`), so that stock "
        "mlx-lm loads the folder with --trust-remote-code. Converted and trained folders carry it already.",
    )
    mlx.add_argument("folder", help="the IHA folder (converted or trained)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha export") -> int:
    args = make_parser(prog).parse_args(argv)

    def export() -> int:
        if args.target == "llama":
            from ..export.llama import export_llama

            report = export_llama(args.folder, args.output_dir, overwrite=args.overwrite, verify=args.verify)
            print(f"Exported {report.source} -> {report.output_dir} ({report.architecture}, {report.dtype})")
            from ..conversion.plan import describe_layers

            print(f"  folded the mixing of layers {describe_layers(report.folded_layers) or 'none'}")
            if report.max_abs_diff is not None:
                print(
                    f"  verification in float32: max |logit difference| {report.max_abs_diff:.2e}, top-1 agreement "
                    f"{100 * report.top1_agreement:.2f}%"
                )
            for note in report.notes:
                print(f"  note: {note}")
            return 0
        from ..export.mlx import add_mlx_model_file

        path = add_mlx_model_file(args.folder)
        print(f"Wrote {path}; load with: mlx_lm.generate --model {args.folder} --trust-remote-code")
        return 0

    return run_command(prog, export)
