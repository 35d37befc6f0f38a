"""The quantization part of `bench_mlx.py`: `mlx_lm.convert -q` at 8 and 4 bits of the source and of an IHA folder,
each quantized model teacher-forced against its own float32 version on GSM8K questions with answers
(tests/fixtures/data), side by side; and its section of the report (see bench_mlx.py's docstring)."""

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.utils import load


GSM8K = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "data" / "gsm8k"


def texts(count: int) -> list[str]:
    rows = []
    for path in sorted(GSM8K.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"Question: {row['question']}\nAnswer: {row['answer']}" for row in rows[:count]]


def next_token_predictions(model, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 prediction, log-probability of the text's next token) at each position but the last."""
    logits = model(mx.array([token_ids]))[0, :-1].astype(mx.float32)
    targets = mx.array(token_ids[1:])
    target_logits = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    logprobs = target_logits - mx.logsumexp(logits, axis=-1)
    return np.array(logits.argmax(-1)), np.array(logprobs)


def agreement(reference: list[tuple], quantized: list[tuple]) -> tuple[dict, np.ndarray, np.ndarray]:
    """Top-1 agreement and mean |log p gap| of the text's next tokens, quantized against float, over all texts; and
    the per-token agreement and gaps, for the paired comparison of the two models."""
    same = np.concatenate([r[0] == q[0] for r, q in zip(reference, quantized)])
    gaps = np.concatenate([np.abs(r[1] - q[1]) for r, q in zip(reference, quantized)])
    entry = {"tokens": int(same.size), "top1_agreement": float(same.mean()), "mean_logprob_gap": float(gaps.mean())}
    return entry, same, gaps


def paired(source: tuple[np.ndarray, np.ndarray], iha: tuple[np.ndarray, np.ndarray]) -> dict:
    """The two models on the same tokens: where only one quantized model keeps its float model's top-1, and the mean
    per-token difference of the log-prob gaps (IHA - source) with its standard error."""
    (source_same, source_gaps), (iha_same, iha_gaps) = source, iha
    difference = iha_gaps - source_gaps
    return {
        "only_source_agrees": int((source_same & ~iha_same).sum()),
        "only_iha_agrees": int((iha_same & ~source_same).sum()),
        "gap_difference_mean": float(difference.mean()),
        "gap_difference_standard_error": float(difference.std(ddof=1) / np.sqrt(difference.size)),
    }


def predictions(model, encoded: list[list[int]], label: str, store: Path | None, start: float) -> list[tuple]:
    """`next_token_predictions` of each text; with a `store` (`--predictions-dir`) each text's are saved there as
    they come and read back by a rerun instead of being computed again."""
    found = []
    for index, token_ids in enumerate(encoded):
        saved = store / f"{label.replace(' ', '_')}-text{index}.npz" if store is not None else None
        if saved is not None and saved.is_file():
            with np.load(saved) as data:
                found.append((data["top1"], data["logprobs"]))
            print(f"{label}, text {index + 1}/{len(encoded)}: read from {saved}", flush=True)
            continue
        top1, logprobs = next_token_predictions(model, token_ids)
        if saved is not None:
            np.savez(saved.with_suffix(".partial.npz"), top1=top1, logprobs=logprobs)
            saved.with_suffix(".partial.npz").rename(saved)  # whole files only: a run killed mid-write leaves none
        found.append((top1, logprobs))
        print(f"{time.perf_counter() - start:.0f} s: {label}, text {index + 1}/{len(encoded)}", flush=True)
    return found


def quantization_part(
    source: Path, iha_folder: Path, work: Path, num_texts: int, store: Path | None = None
) -> tuple[dict, dict]:
    """Each float32 model's predictions are computed once and compared with both of its quantizations: on MLX's Linux
    CPU build every forward pass is slow (see `--num-texts`), so none is repeated, and with `store` none is repeated
    by a rerun either."""
    results, per_token = {}, {}
    start = time.perf_counter()
    source_encoded = None
    models = (("source Llama (stock mlx-lm)", source), ("IHA (MLX model file)", iha_folder))
    for (name, folder), short in zip(models, ("source", "iha")):
        float_model, tokenizer = load(str(folder), trust_remote_code=True)
        encoded = [tokenizer.encode(text) for text in texts(num_texts)]
        # The IHA folder carries the source's tokenizer: both models are measured on the same tokens.
        assert source_encoded is None or encoded == source_encoded, "the two folders tokenize the texts differently"
        source_encoded = encoded
        reference = predictions(float_model, encoded, f"{short} float32", store, start)
        del float_model
        # How sure the float model is of the text: a less sure model has smaller top-1 margins for quantization to flip.
        float_logprob = float(np.concatenate([logprobs for _, logprobs in reference]).mean())
        for bits in (8, 4):
            quantized_folder = work / f"{folder.name}-q{bits}"
            convert(str(folder), str(quantized_folder), quantize=True, q_bits=bits, trust_remote_code=True)
            quantized_model, _ = load(str(quantized_folder), trust_remote_code=True)
            quantized = predictions(quantized_model, encoded, f"{short} {bits}-bit", store, start)
            entry, same, gaps = agreement(reference, quantized)
            mixing = {
                str(v.dtype).removeprefix("mlx.core.")
                for k, v in tree_flatten(quantized_model.parameters())
                if ".head_mixing." in k
            }
            entry["mixing_dtypes"] = sorted(mixing)
            entry["float32_mean_logprob"] = float_logprob
            results[f"{name}, {bits}-bit"] = entry
            per_token[name, bits] = (same, gaps)
            print(name, bits, entry, flush=True)
    (source_name, _), (iha_name, _) = models
    comparison = {f"{bits}-bit": paired(per_token[source_name, bits], per_token[iha_name, bits]) for bits in (8, 4)}
    print(comparison, flush=True)
    return results, comparison


def prediction_store(directory: str | None, settings: dict) -> Path | None:
    """`--predictions-dir`: the folder, which must hold predictions of the same IHA folder and texts if any (its
    settings.json says which)."""
    if directory is None:
        return None
    store = Path(directory)
    store.mkdir(parents=True, exist_ok=True)
    written = store / "settings.json"
    if written.is_file() and json.loads(written.read_text()) != settings:
        raise SystemExit(
            f"--predictions-dir {store} holds predictions of other settings ({written.read_text().strip()}, now "
            f"{json.dumps(settings)}): pass an empty folder, or the flags of the run that wrote it"
        )
    written.write_text(json.dumps(settings) + "\n")
    return store


def quantization_report(results: dict, when: str, regime: dict) -> list[str]:
    """The report's quantization section; `when`, `regime`: when and how the part was measured."""
    entries = results["quantization"]
    tokens = next(iter(entries.values()))["tokens"] if entries else 0
    took = ""
    if "quantization_seconds" in regime:
        reused = regime.get("predictions_reused", 0)
        took = f" The part took {regime['quantization_seconds']} s" + (
            f" ({reused} of its {6 * regime['num_texts']} per-text predictions read from an earlier run's "
            "`--predictions-dir`)."
            if reused
            else "."
        )
    lines = [
        "## Quantization (`mlx_lm.convert -q`), each model against its own float32 version",
        "",
        when,
        f"Teacher-forced on {regime['num_texts']} GSM8K questions with answers (tests/fixtures/data), {tokens} "
        f"next-token predictions per model, the same tokens for both (the IHA folder carries the source's "
        f"tokenizer). Default group size (64); the float32 predictions computed once per model.{took}",
    ]
    source, iha = "source Llama (stock mlx-lm)", "IHA (MLX model file)"
    comparison = results.get("quantization_paired", {})
    if not comparison:
        return lines
    lines += [
        "",
        "Side by side, source / IHA: top-1 agreement of the next-token predictions with the model's own float32 "
        "version, the tokens where only one of the two keeps its float model's top-1, the mean absolute gap of the "
        "text's next-token log-probability, and the paired per-token difference of those gaps (IHA - source; > 0: "
        "IHA's quantization moves its log-probs more) with its standard error.",
        "",
        "| bits | top-1 agreement, source / IHA | only the source keeps / only IHA keeps | mean abs log-prob gap, "
        "source / IHA | gap difference (IHA - source) | IHA mixing dtype |",
        "|---|---:|---:|---:|---:|---|",
    ]
    verdicts, mixing_dtypes = [], set()
    for bits, pair in comparison.items():
        plain, ours = entries[f"{source}, {bits}"], entries[f"{iha}, {bits}"]
        mixing_dtypes.update(ours["mixing_dtypes"])
        difference, error = pair["gap_difference_mean"], pair["gap_difference_standard_error"]
        lines.append(
            f"| {bits} | {100 * plain['top1_agreement']:.2f}% / {100 * ours['top1_agreement']:.2f}% | "
            f"{pair['only_source_agrees']} / {pair['only_iha_agrees']} | {plain['mean_logprob_gap']:.4f} / "
            f"{ours['mean_logprob_gap']:.4f} | {difference:+.4f} +- {error:.4f} | "
            f"{', '.join(ours['mixing_dtypes']) or '(none)'} |"
        )
        points = 100 * (ours["top1_agreement"] - plain["top1_agreement"])
        # The tokens where only one model keeps its top-1 (McNemar): a difference over two standard deviations of an
        # even split, or a gap difference over two standard errors, reads as IHA quantizing worse.
        discordant = pair["only_source_agrees"] + pair["only_iha_agrees"]
        flips = (pair["only_source_agrees"] - pair["only_iha_agrees"]) / max(discordant, 1) ** 0.5
        worse = [
            *(["top-1 agreement"] if flips > 2 else []),
            *(["log-prob gap"] if difference > 2 * error else []),
        ]
        verdicts.append(
            f"{bits}: IHA's top-1 agreement is {points:+.2f} points from the source's ({flips:+.1f} standard "
            f"deviations of an even split of the {discordant} tokens only one keeps), its mean log-prob gap "
            f"{difference:+.4f} ({difference / error:+.1f} standard errors): "
            + (
                f"worse than the source's ({' and '.join(worse)})."
                if worse
                else "no measurably worse than the source's."
            )
        )
    float_logprobs = [entries[f"{name}, 8-bit"]["float32_mean_logprob"] for name in (source, iha)]
    lines += [
        "",
        "Issue 45's criterion, the quantized IHA folder agreeing with its float version no worse than the "
        "source's quantization agrees with its own, on this run: " + " ".join(verdicts),
    ]
    if "noise" in regime["iha_folder"]:
        lines.append(
            "The IHA folder here is the identity conversion with random noise added to its mixing, a stand-in for "
            "trained mixing (with identity mixing the quantized layers are the source's, so the two sides are equal). "
            "The noise is not trained: it lowers the float32 model's log-probability of the texts (below), and this "
            "run cannot tell the mixing's share in the difference from the noise's. A trained folder: `--iha-folder`."
        )
    lines.append(
        f"The float32 models' mean log-probability of the texts' tokens: source {float_logprobs[0]:.3f}, IHA "
        f"{float_logprobs[1]:.3f}. "
        + (
            "The IHA folder's mixing stays float32 after `mlx_lm.convert -q` at both widths (read off the loaded "
            "quantized model); only its linear layers and embeddings are quantized."
            if mixing_dtypes == {"float32"}
            else f"The IHA folder's mixing after `mlx_lm.convert -q`: {sorted(mixing_dtypes) or 'not found'}."
        )
    )
    return lines
