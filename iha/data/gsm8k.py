"""GSM8K rows: reading them, their reference answer (the number after `####`, the package's one rule for it) and
their conversion to the OpenThoughts-114k format, so the whole SFT pipeline can be exercised offline on real data.

The evaluation reads GSM8K's gold answers with `gsm8k_final_answer` too (`iha.evaluation`), so training data and
scoring cannot disagree on what a GSM8K answer is.
"""

from __future__ import annotations

import os
import re

from .messages import (
    BEGIN_OF_SOLUTION,
    BEGIN_OF_THOUGHT,
    BOXED_INSTRUCTION,
    END_OF_SOLUTION,
    END_OF_THOUGHT,
    OPENTHOUGHTS_SYSTEM_PROMPT,
    DataFormatError,
    local_data_path,
    read_jsonl,
)


# GSM8K's worked answers carry calculator annotations such as `48/2 = <<48/2=24>>24`; they are not prose.
CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def gsm8k_final_answer(answer: str) -> str:
    """The number after `####` in a GSM8K answer, without thousands separators ("1,200" -> "1200")."""
    if answer.count("####") != 1:
        raise DataFormatError("a GSM8K answer must end in exactly one `#### N` line.")
    final = answer.split("####")[1].strip().replace(",", "")
    if not final:
        raise DataFormatError("the `#### N` line of a GSM8K answer has no number after `####`.")
    return final


def gsm8k_to_openthoughts(row: dict, index: int = 0) -> dict:
    """One GSM8K row (`question`, `answer` ending in `#### N`) in the OpenThoughts-114k format.

    The worked steps become the thought (one paragraph per step, as the system prompt asks), the last step plus
    `\\boxed{N}` the solution:

    `{"system": OPENTHOUGHTS_SYSTEM_PROMPT, "conversations": [{"from": "user", "value": "Return your final response
    within \\boxed{}. <question>"}, {"from": "assistant", "value": "<|begin_of_thought|>\\n\\n<steps>\\n\\n
    <|end_of_thought|>\\n\\n<|begin_of_solution|>\\n\\n<last step>\\n\\nThe final answer is $\\boxed{N}$.\\n\\n
    <|end_of_solution|>"}]}`
    """
    if not isinstance(row, dict):
        raise DataFormatError(f"GSM8K row {index} must be a dict, got {type(row).__name__}.")
    question, answer = row.get("question"), row.get("answer")
    for name, value in (("question", question), ("answer", answer)):
        if not isinstance(value, str) or not value.strip():
            raise DataFormatError(f"GSM8K row {index}: `{name}` is missing or not a non-empty string.")
    try:
        final = gsm8k_final_answer(answer)
    except DataFormatError as error:
        raise DataFormatError(f"GSM8K row {index}: {error}") from None
    working = CALCULATOR_ANNOTATION.sub("", answer.split("####")[0])
    steps = [line.strip() for line in working.splitlines() if line.strip()]
    if not steps:
        raise DataFormatError(f"GSM8K row {index}: the answer has no worked steps before `####`.")
    thought = "\n\n".join(steps)
    solution = f"{steps[-1]}\n\nThe final answer is $\\boxed{{{final}}}$."
    assistant = (
        f"{BEGIN_OF_THOUGHT}\n\n{thought}\n\n{END_OF_THOUGHT}\n\n{BEGIN_OF_SOLUTION}\n\n{solution}\n\n{END_OF_SOLUTION}"
    )
    return {
        "system": OPENTHOUGHTS_SYSTEM_PROMPT,
        "conversations": [
            {"from": "user", "value": BOXED_INSTRUCTION + question.strip()},
            {"from": "assistant", "value": assistant},
        ],
    }


def read_gsm8k_rows(source: str | os.PathLike, split: str = "train", limit: int | None = None) -> list[dict]:
    """GSM8K rows (question, answer) from a local .jsonl file, or from a Hub dataset such as `openai/gsm8k`."""
    path = local_data_path(source)
    if path is not None and path.is_file():
        return read_jsonl(path, limit)
    if path is not None:
        raise DataFormatError(f"{source} is a folder: give the GSM8K .jsonl file in it.")
    from datasets import load_dataset

    # openai/gsm8k has two configs with the same rows ("main" and "socratic"); "main" is the usual one.
    config_name = "main" if str(source) == "openai/gsm8k" else None
    try:
        dataset = load_dataset(str(source), config_name, split=split)
    except Exception as error:  # offline, unknown id, ...: say what to do instead
        raise DataFormatError(
            f"Could not load {source!r} from the Hugging Face Hub ({type(error).__name__}: {error}). Offline, pass "
            "a local GSM8K .jsonl file instead."
        ) from error
    rows = dataset if limit is None else dataset.select(range(min(limit, len(dataset))))
    return [dict(row) for row in rows]


def gsm8k_file_to_openthoughts(source: str | os.PathLike, limit: int | None = None, split: str = "train") -> list[dict]:
    """All (or the first `limit`) GSM8K rows of a .jsonl file or a Hub dataset in the OpenThoughts-114k format."""
    return [gsm8k_to_openthoughts(row, index) for index, row in enumerate(read_gsm8k_rows(source, split, limit))]


__all__ = ["gsm8k_file_to_openthoughts", "gsm8k_final_answer", "gsm8k_to_openthoughts", "read_gsm8k_rows"]
