"""IHA on MLX (the model file `iha export mlx` adds) against stock mlx-lm on the source Llama, side by side in one run:

    python benchmarks/bench_mlx.py --iha-folder iha-demo/model   # writes benchmarks/results/mlx.md and mlx.json
    python benchmarks/bench_mlx.py --quick                       # a smoke run: results/mlx_quick.{md,json}
    python benchmarks/bench_mlx.py --skip speed --perturb-mixing 0.05 --predictions-dir DIR  # resumable

The source is the built-in SmolLM2-135M-Instruct (float32; `iha.conversion.builtin`), copied with its RoPE base also
under the key `rope_theta`: stock mlx-lm 0.32 reads only that key, not transformers 5's `rope_parameters`, and would
otherwise run the source at its default base of 10,000 instead of 100,000.

1. Quantization: `mlx_lm.convert -q` at 4 and 8 bits of the source and of an IHA folder of the same source
   (`--iha-folder`: a trained one, such as the demo's output, whose mixing moved; default: the converted one, identity
   mixing). Each quantized model is compared with its own float32 version, teacher-forced on GSM8K questions and
   answers from tests/fixtures/data: top-1 agreement of the next-token predictions, and the mean absolute gap of the
   log-probability of the text's next token. The IHA folder's mixing must stay float32.
2. Decode speed, batch 1, float32: tokens/s of `generate_step` after a `--prompt-tokens` prompt (time from the first
   new token to the last, so the prefill cancels out), the models taking turns, the order flipping every round,
   `--repeats` rounds, median and range. IHA (P = 2, the converter's layout) with the token cache (the folder's
   default: the base model's memory) and with the pseudo-token cache; against the inverse of the FLOP ratio of the
   models benchmarked (benchmarks/flops.py: one decoding step in the middle of the decoded tokens). Target (issue
   45): tokens/s ratio x FLOP ratio >= 0.8. Cache bytes per token are read off the models' caches after the run.
"""

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from flops import model_flops  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402
from mlx_quantization import prediction_store, quantization_part, quantization_report  # noqa: E402

from iha import conversion  # noqa: E402
from iha.conversion.builtin import smollm2_dir  # noqa: E402
from iha.export.mlx import add_mlx_model_file  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"


def source_for_stock_mlx(work: Path) -> Path:
    """The built-in source, with `rope_theta` beside `rope_parameters` (see the module docstring)."""
    folder = work / "source"
    shutil.copytree(smollm2_dir(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def perturbed_copy(folder: Path, target: Path, scale: float) -> Path:
    """A copy of `folder` whose mixing tensors carry seeded Gaussian noise of `scale` (float32 kept)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, target)
    rng = np.random.default_rng(0)
    for path in target.glob("model*.safetensors"):
        tensors = load_file(path)
        for name, value in tensors.items():
            if ".head_mixing." in name:
                tensors[name] = (value + scale * rng.standard_normal(value.shape)).astype(value.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return target


def decode_rate(model, prompt: list[int], decode_tokens: int, **model_kwargs) -> tuple[float, int]:
    """(new tokens per second after the first, cache bytes per token) of one greedy run."""
    cache = make_prompt_cache(model)
    stamps = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=decode_tokens + 1, prompt_cache=cache):
        stamps.append(time.perf_counter())
    tokens = len(prompt) + decode_tokens
    cache_bytes = sum(layer.nbytes for layer in cache)
    return decode_tokens / (stamps[-1] - stamps[0]), cache_bytes // tokens


def speed_part(source: Path, iha_folder: Path, prompt_tokens: int, decode_tokens: int, repeats: int) -> dict:
    models = {
        "source Llama (stock mlx-lm)": load(str(source))[0],
        "IHA P=2, token cache": load(str(iha_folder), model_config={"iha_cache_mode": "token"}, trust_remote_code=True)[
            0
        ],
        "IHA P=2, pseudo cache": load(
            str(iha_folder), model_config={"iha_cache_mode": "pseudo"}, trust_remote_code=True
        )[0],
    }
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 40000, prompt_tokens)]
    rates = {name: [] for name in models}
    cache_bytes = {}
    names = list(models)
    for name in names:  # warm-up: compile and allocate once
        decode_rate(models[name], prompt[:16], 4)
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            rate, cache_bytes[name] = decode_rate(models[name], prompt, decode_tokens)
            rates[name].append(rate)
            print(round_index, name, f"{rate:.1f} tok/s", flush=True)
    config = json.loads((iha_folder / "config.json").read_text())
    shape = {key: config[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    shape.update(intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"])
    past = prompt_tokens + decode_tokens // 2
    layers = config["num_hidden_layers"]
    base_flops = model_flops(shape, ["full_attention"] * layers, 1, past_tokens=past, logits_tokens=1)["total"]
    results = {}
    for name in names:
        median = statistics.median(rates[name])
        entry = {"tok_s_median": median, "tok_s_min": min(rates[name]), "tok_s_max": max(rates[name])}
        entry["cache_bytes_per_token"] = cache_bytes[name]
        if name.startswith("IHA"):
            cache_mode = "token" if "token cache" in name else "pseudo"
            iha_flops = model_flops(
                shape,
                config["attention_types"],
                1,
                past_tokens=past,
                num_pseudo_heads=config["num_pseudo_heads"],
                mask_mode=config["iha_mask_mode"],
                collapse_mode=config["iha_collapse_mode"],
                cache_mode=cache_mode,
                logits_tokens=1,
            )["total"]
            base_median = statistics.median(rates[names[0]])
            entry["tok_s_ratio"] = median / base_median
            entry["flop_ratio"] = iha_flops / base_flops
            entry["ratio_x_flop_ratio"] = entry["tok_s_ratio"] * entry["flop_ratio"]
        results[name] = entry
    return results


def measured_on(results: dict, part: str) -> tuple[str, dict]:
    """When and on what a part was measured (a part skipped in this run keeps its earlier run's regime)."""
    regime = results.get("regime_of_skipped", {}).get(part, {"date": results["date"], **results["regime"]})
    return (
        f"Measured {regime['date']} on {regime['machine']} ({regime['processor']}), mlx {regime['mlx']}, mlx-lm "
        f"{regime['mlx_lm']}, MLX's CPU build (mlx[cpu]), a shared 2-core machine (other jobs running; nice). Source: "
        f"the built-in SmolLM2-135M-Instruct, float32. IHA folder: {regime['iha_folder']}."
    ), regime


def speed_report(results: dict) -> list[str]:
    when, regime = measured_on(results, "speed")
    lines = [
        f"## Decode speed, batch 1, float32: prompt {regime['prompt_tokens']} tokens, {regime['decode_tokens']} new "
        f"tokens, {regime['repeats']} rounds (median, range)",
        "",
        when,
        "",
        "| model | tok/s | tok/s ratio | FLOP ratio (IHA / base) | ratio x FLOP ratio (target >= 0.8) | cache bytes/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, entry in results["speed"].items():
        ratio = f"{entry['tok_s_ratio']:.3f}" if "tok_s_ratio" in entry else "1"
        flop = f"{entry['flop_ratio']:.3f}" if "flop_ratio" in entry else "1"
        target = f"{entry['ratio_x_flop_ratio']:.3f}" if "ratio_x_flop_ratio" in entry else ""
        lines.append(
            f"| {name} | {entry['tok_s_median']:.1f} ({entry['tok_s_min']:.1f}-{entry['tok_s_max']:.1f}) | {ratio} | "
            f"{flop} | {target} | {entry['cache_bytes_per_token']} |"
        )
    return lines


def report(results: dict) -> str:
    lines = ["# IHA on MLX against stock mlx-lm on the source Llama (`benchmarks/bench_mlx.py`)", ""]
    lines += quantization_report(results, *measured_on(results, "quantization")) + [""] + speed_report(results)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iha-folder", help="a trained IHA folder of the built-in source (default: its conversion)")
    parser.add_argument(
        "--perturb-mixing",
        type=float,
        default=0.0,
        help="add seeded Gaussian noise of this scale to the IHA folder's mixing before the quantization part (a "
        "stand-in for trained mixing when no trained folder is given: identity mixing quantizes exactly as the source)",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--num-texts",
        type=int,
        default=4,
        help="GSM8K texts of the quantization part (the first 4: 568 next-token predictions). MLX's Linux CPU wheel "
        "(mlx[cpu] 0.32) bundles the reference BLAS: its float32 matmul runs at about 2 GFLOP/s and its quantized "
        "matmul at about 1, so one forward pass of SmolLM2-135M over one text takes 10-70 s on this project's shared "
        "machine, and the part (6 passes per text) about 15 minutes with 4 texts",
    )
    parser.add_argument(
        "--predictions-dir",
        help="keep each text's predictions of the quantization part here: a run stopped part-way and started again "
        "with the same flags and folder computes only what is missing",
    )
    parser.add_argument("--skip", choices=["quantization", "speed"], action="append", default=[])
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.repeats, args.num_texts = 32, 8, 1, 2
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        source = source_for_stock_mlx(work)
        converted = work / "smollm2-iha"
        conversion.convert_checkpoint(source, converted, verify=False, show_progress=False)
        add_mlx_model_file(converted)
        trained = converted
        if args.iha_folder:
            trained = work / "trained-iha"
            shutil.copytree(args.iha_folder, trained)
            add_mlx_model_file(trained)
        if args.perturb_mixing:
            trained = perturbed_copy(trained, work / "perturbed-iha", args.perturb_mixing)
        results = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "regime": {
                "machine": platform.machine(),
                "processor": platform.processor() or platform.platform(),
                "mlx": mx.__version__,
                "mlx_lm": __import__("mlx_lm").__version__,
                "iha_folder": (args.iha_folder or "the conversion of the source (identity mixing)")
                + (f", mixing + N(0, {args.perturb_mixing}^2) noise (seed 0)" if args.perturb_mixing else ""),
                "prompt_tokens": args.prompt_tokens,
                "decode_tokens": args.decode_tokens,
                "repeats": args.repeats,
                "num_texts": args.num_texts,
            },
            "quantization": {},
            "speed": {},
        }
        if "quantization" not in args.skip:
            start = time.perf_counter()
            settings = {"iha_folder": results["regime"]["iha_folder"], "mlx": mx.__version__, "texts": "gsm8k"}
            store = prediction_store(args.predictions_dir, settings)
            if store is not None:  # what an earlier run left there for these texts (the report says how many)
                saved = [path for path in store.glob("*-text*.npz") if not path.name.endswith(".partial.npz")]
                reused = [path for path in saved if int(path.stem.rsplit("-text", 1)[1]) < args.num_texts]
                results["regime"]["predictions_reused"] = len(reused)
            results["quantization"], results["quantization_paired"] = quantization_part(
                source, trained, work, args.num_texts, store
            )
            results["regime"]["quantization_seconds"] = round(time.perf_counter() - start)
        if "speed" not in args.skip:
            results["speed"] = speed_part(source, converted, args.prompt_tokens, args.decode_tokens, args.repeats)
    name = "mlx_quick" if args.quick else "mlx"
    earlier = RESULTS / f"{name}.json"
    if args.skip and earlier.is_file():  # a part skipped keeps its last measurement (and that run's regime line)
        previous = json.loads(earlier.read_text())
        for part in args.skip:
            results[part] = previous.get(part, {})
            # The regime of the run that measured it: the previous run's, unless that run had skipped it too.
            measured = previous.get("regime_of_skipped", {}).get(part, {"date": previous["date"], **previous["regime"]})
            results.setdefault("regime_of_skipped", {})[part] = measured
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
