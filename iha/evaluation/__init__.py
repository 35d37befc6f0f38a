"""Evaluation: math benchmarks (GSM8K, MATH-500) with pass@1 and majority vote, and a multi-key needle task.

Importing this package needs `math-verify` (the `eval` extra: `pip install iha-transformers[eval]`).
"""

from .answers import Vote, extract_answer, gsm8k_gold_answer, is_equivalent, majority_vote, parse_answer
from .math_eval import (
    PRESETS,
    MathEvalResult,
    Problem,
    SamplingConfig,
    build_prompt,
    evaluate_math,
    generate_completions,
    load_model_and_tokenizer,
    load_problems,
    sampling_preset,
    score_completions,
)
from .needle import NeedleConfig, evaluate_needle, evaluate_needle_examples, make_needle_examples, score_needle_answer
from .report import comparison_table, math_report, needle_report


__all__ = [
    "PRESETS",
    "MathEvalResult",
    "NeedleConfig",
    "Problem",
    "SamplingConfig",
    "Vote",
    "build_prompt",
    "comparison_table",
    "evaluate_math",
    "evaluate_needle",
    "evaluate_needle_examples",
    "extract_answer",
    "generate_completions",
    "gsm8k_gold_answer",
    "is_equivalent",
    "load_model_and_tokenizer",
    "load_problems",
    "majority_vote",
    "make_needle_examples",
    "math_report",
    "needle_report",
    "parse_answer",
    "sampling_preset",
    "score_completions",
    "score_needle_answer",
]
