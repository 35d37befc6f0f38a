"""The settings of a math evaluation: the benchmarks (Hub id, columns, gold answer) and the sampling presets.

Without math-verify, so that `iha-eval --help` lists them without loading the scoring; `iha.evaluation.math_eval`
runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..data.gsm8k import gsm8k_final_answer


@dataclass
class SamplingConfig:
    """How completions are drawn. `temperature=0` means greedy decoding (then `num_samples` must be 1)."""

    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0: greedy)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    num_samples: int = field(default=1, metadata={"help": "samples per problem"})
    max_new_tokens: int = field(default=1024, metadata={"help": "tokens per completion"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}.")
        if self.num_samples < 1:
            raise ValueError(f"`num_samples` must be >= 1, got {self.num_samples}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}.")
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError(
                f"Greedy decoding (temperature 0) gives {self.num_samples} identical samples: set a temperature > 0 "
                "(the paper uses 0.6) or `num_samples=1`."
            )

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


# The paper evaluates "with temperature 0.6 and 16 samples". It does not state top-p or the generation length:
# top_p 0.95 and 4096 new tokens are our choices (common for reasoning-tuned models of this size).
PRESETS = {
    "paper": SamplingConfig(temperature=0.6, top_p=0.95, num_samples=16, max_new_tokens=4096),
    "greedy": SamplingConfig(temperature=0.0, top_p=1.0, num_samples=1, max_new_tokens=1024),
}


def sampling_preset(name: str, **overrides) -> SamplingConfig:
    """A preset (`paper`, `greedy`) with some fields overridden (None values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown sampling preset {name!r}: choose one of {sorted(PRESETS)}.")
    return replace(PRESETS[name], **{key: value for key, value in overrides.items() if value is not None})


def _gsm8k_gold(row: dict) -> str:
    return gsm8k_final_answer(row["answer"])


@dataclass
class BenchmarkSpec:
    name: str
    hub_id: str
    hub_config: str | None
    split: str
    question_column: str
    gold: Callable[[dict], str]


BENCHMARKS = {
    "gsm8k": BenchmarkSpec(
        name="gsm8k",
        hub_id="openai/gsm8k",
        hub_config="main",
        split="test",
        question_column="question",
        gold=_gsm8k_gold,
    ),
    "math500": BenchmarkSpec(
        name="math500",
        hub_id="HuggingFaceH4/MATH-500",
        hub_config=None,
        split="test",
        question_column="problem",
        gold=lambda row: str(row["answer"]),
    ),
}


__all__ = ["BENCHMARKS", "PRESETS", "BenchmarkSpec", "SamplingConfig", "sampling_preset"]
