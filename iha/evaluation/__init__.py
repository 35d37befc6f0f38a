"""Evaluation: math benchmarks (GSM8K, MATH-500) with pass@1 and majority vote, and a multi-key needle task.

Its scoring needs `math-verify` (the `eval` extra: `pip install ".[eval]"` in the package's source folder).
"""

from ..utils.lazy_imports import lazy_attributes


# Public name -> the module that defines it, imported on first use: the command line's parser (`iha eval --help`)
# does not import math-verify.
_EXPORTS = {
    "Vote": "answers",
    "extract_answer": "answers",
    "is_equivalent": "answers",
    "majority_vote": "answers",
    "parse_answer": "answers",
    "BENCHMARKS": "settings",
    "PRESETS": "settings",
    "BenchmarkSpec": "settings",
    "SamplingConfig": "settings",
    "sampling_preset": "settings",
    "MathEvalResult": "math_eval",
    "Problem": "math_eval",
    "build_prompt": "math_eval",
    "evaluate_math": "math_eval",
    "generate_completions": "math_eval",
    "load_model_and_tokenizer": "math_eval",
    "load_problems": "math_eval",
    "score_completions": "math_eval",
    "NeedleConfig": "needle",
    "evaluate_needle": "needle",
    "evaluate_needle_examples": "needle",
    "make_needle_examples": "needle",
    "score_needle_answer": "needle",
    "comparison_table": "report",
    "math_report": "report",
    "needle_report": "report",
}


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
