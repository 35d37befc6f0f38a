"""Markdown reports: several models side by side (the first one is the reference for the differences)."""

from __future__ import annotations

from collections.abc import Sequence


BENCHMARK_TITLES = {"gsm8k": "GSM8K", "math500": "MATH-500"}


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _delta(value: float | None, reference: float | None) -> str:
    if value is None or reference is None:
        return "–"
    return f"{100 * (value - reference):+.1f}"


def _models_in_order(results: Sequence[dict]) -> list[str]:
    models: list[str] = []
    for result in results:
        if result["model"] not in models:
            models.append(result["model"])
    return models


def _metric_order(metric_names: set[str]) -> list[str]:
    def key(name: str):
        if name == "pass@1":
            return (0, 0)
        if name.startswith("maj@"):
            return (1, int(name[4:]))
        return (2, name)

    return sorted(metric_names, key=key)


def comparison_table(results: Sequence[dict], metrics: Sequence[str] | None = None) -> str:
    """One row per (benchmark, metric), one column per model, then `model - first model` columns (points)."""
    if not results:
        raise ValueError("No results to report.")
    models = _models_in_order(results)
    benchmarks: list[str] = []
    for result in results:
        if result["benchmark"] not in benchmarks:
            benchmarks.append(result["benchmark"])
    by_key = {}
    for result in results:
        key = (result["model"], result["benchmark"])
        if key in by_key:
            raise ValueError(f"Two results for model {key[0]!r} on {key[1]!r}: give each run a distinct model name.")
        by_key[key] = result
    header = ["Benchmark", "Metric", *models, *[f"{model} − {models[0]}" for model in models[1:]]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for benchmark in benchmarks:
        names = set(metrics) if metrics else set()
        if not metrics:
            for model in models:
                names |= set(by_key.get((model, benchmark), {}).get("metrics", {}))
        for metric in _metric_order(names):
            values = [by_key.get((model, benchmark), {}).get("metrics", {}).get(metric) for model in models]
            row = [BENCHMARK_TITLES.get(benchmark, benchmark), metric, *map(_percent, values)]
            row += [_delta(value, values[0]) for value in values[1:]]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def math_report(results: Sequence[dict], title: str = "Math evaluation") -> str:
    """A markdown report: settings, then the side-by-side table (accuracies in %, differences in points)."""
    models = _models_in_order(results)
    lines = [f"# {title}", ""]
    lines.append("Accuracies in %; differences in points against the first model.")
    lines.append("pass@1: mean fraction of correct samples per problem; maj@k: accuracy of the majority-vote answer")
    lines.append("over k samples (answers grouped by math-verify equivalence; ties go to the earliest answer).")
    lines.append("")
    lines.append("| Model | Benchmark | Problems | Samples | Temperature | top-p | Max new tokens | Seed | Source |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for model in models:
        for result in results:
            if result["model"] != model:
                continue
            sampling = result.get("sampling", {})
            lines.append(
                f"| {model} | {BENCHMARK_TITLES.get(result['benchmark'], result['benchmark'])} | "
                f"{result.get('num_problems', '–')} | {result.get('num_samples', '–')} | "
                f"{sampling.get('temperature', '–')} | {sampling.get('top_p', '–')} | "
                f"{sampling.get('max_new_tokens', '–')} | {sampling.get('seed', '–')} | {result.get('source', '')} |"
            )
    lines += ["", comparison_table(results), ""]
    return "\n".join(lines)


def needle_report(results: Sequence[dict], title: str = "Multi-key needle in a haystack") -> str:
    """Exact-match scores per context length, models side by side."""
    models = _models_in_order(results)
    lengths = sorted({row["context_length"] for result in results for row in result["by_length"]})
    table = {(result["model"], row["context_length"]): row for result in results for row in result["by_length"]}
    config = results[0].get("config", {})
    lines = [f"# {title}", ""]
    lines.append(
        f"{config.get('num_examples', '?')} examples per length, {config.get('num_keys', '?')} queried key(s), "
        f"{config.get('num_distractors', '?')} distractor needle(s), seed {config.get('seed', '?')}. "
        "Score: % of queried values reproduced exactly; all-found: % of examples with every value."
    )
    lines.append("")
    header = ["Context (tokens)", *[f"{model} score" for model in models], *[f"{model} all-found" for model in models]]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|---|" + "---:|" * (len(header) - 1))
    for length in lengths:
        scores = [_percent(table.get((model, length), {}).get("score")) for model in models]
        exact = [_percent(table.get((model, length), {}).get("all_found")) for model in models]
        lines.append("| " + " | ".join([str(length), *scores, *exact]) + " |")
    lines.append("")
    return "\n".join(lines)


__all__ = ["comparison_table", "math_report", "needle_report"]
