"""Evaluation: math benchmarks (GSM8K, MATH-500) with pass@1 and majority vote, and a multi-key needle task.

The math scoring needs `math-verify` (the `eval` extra: `pip install ".[eval]"` in the package's source folder), so
it is imported from its own module, `iha.evaluation.math_eval` (`evaluate_math`, `load_problems`,
`load_model_and_tokenizer`), and the answer reading from `iha.evaluation.answers`: importing the package (the
command line's parser, `iha eval --help`) does not need it.
"""

from .needle import evaluate_needle
from .report import math_report, needle_report
from .settings import BENCHMARKS, PRESETS, SamplingConfig, sampling_preset


__all__ = [
    "BENCHMARKS",
    "PRESETS",
    "SamplingConfig",
    "evaluate_needle",
    "math_report",
    "needle_report",
    "sampling_preset",
]
