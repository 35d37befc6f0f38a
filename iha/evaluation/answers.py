"""Final-answer extraction, equivalence checking (math-verify) and majority vote.

The rules, in one place:

* **Extraction** (`extract_answer`): the content of the *last* `\\boxed{...}` (or `\\fbox{...}`, braces balanced,
  `\\boxed 5` accepted); if there is none, the text after the last `#### ` (GSM8K's own format); if there is none,
  the last "answer is X" / "Answer: X" phrase. Otherwise there is no answer (`None`).
* **Checking** (`is_equivalent`): both sides are parsed by math-verify as LaTeX (then as a plain expression) and
  compared symbolically, so `1/2`, `0.5`, `\\frac{1}{2}` and `\\dfrac12` are equal, `1,000` equals `1000` and
  `\\$18.00` equals `18`. An answer that math-verify cannot parse is wrong.
* **Majority vote** (`majority_vote`): answers are grouped into classes of math-verify-equivalent answers (a new
  answer joins the first class whose first member it is equivalent to). Missing or unparseable answers do not vote.
  The winner is the largest class; **ties go to the class whose first member came earliest** in the sample list.
  If no sample has a parseable answer, there is no winner and the problem counts as wrong.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify


_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_MARKER = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
# math-verify's own timeout uses signal.alarm, which only works on the main thread.
_TIMEOUT_SECONDS = 5


def _timeout() -> int | None:
    return _TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces, or None."""
    start = max(text.rfind(command) for command in _BOXED_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    position = start + len(command)
    if position < len(text) and text[position] == " ":
        # `\boxed 5`: the argument is the next whitespace-delimited token.
        argument = text[position + 1 :].split(maxsplit=1)
        return argument[0].rstrip("$.") if argument else None
    if position >= len(text) or text[position] != "{":
        return None
    depth = 0
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1 : index]
    return None  # unbalanced: the generation was cut off inside the box


def _clean_phrase(answer: str) -> str:
    answer = answer.strip().splitlines()[0].strip() if answer.strip() else ""
    # Drop a trailing full stop (but not a decimal point) and surrounding `$`.
    answer = re.sub(r"\.\s*$", "", answer).strip()
    return answer.strip("$ ").strip()


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (see the module docstring for the order of rules), or None."""
    if not text:
        return None
    boxed = _last_boxed_content(text)
    if boxed is not None:
        boxed = boxed.strip()
        return boxed or None
    markers = _GSM8K_MARKER.findall(text)
    if markers:
        answer = _clean_phrase(markers[-1])
        return answer or None
    phrases = _ANSWER_IS.findall(text)
    if phrases:
        answer = _clean_phrase(phrases[-1])
        return answer or None
    return None


_EXTRACTION_CONFIG = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def parse_answer(answer: str | None) -> list | None:
    """math-verify's parse of an extracted answer string; None when there is nothing it can read."""
    if answer is None or not answer.strip():
        return None
    # Wrapping in \boxed makes math-verify read the whole string as one LaTeX answer.
    parsed = parse(f"\\boxed{{{answer}}}", extraction_config=_EXTRACTION_CONFIG, parsing_timeout=_timeout())
    return parsed or None


def parsed_equivalent(gold: list | None, prediction: list | None) -> bool:
    """math-verify equivalence of two parsed answers; a missing side is never equivalent."""
    if not gold or not prediction:
        return False
    return bool(verify(gold, prediction, timeout_seconds=_timeout()))


def is_equivalent(gold: str | None, prediction: str | None) -> bool:
    """Whether two answer strings (already extracted) are mathematically equal according to math-verify."""
    return parsed_equivalent(parse_answer(gold), parse_answer(prediction))


def gsm8k_gold_answer(solution: str) -> str:
    """GSM8K's reference answer: the number after `####`, thousands separators removed."""
    markers = _GSM8K_MARKER.findall(solution)
    if not markers:
        raise ValueError(f"GSM8K solution has no `#### <answer>` line: {solution[-80:]!r}")
    return markers[-1].strip().replace(",", "")


@dataclass
class Vote:
    """The outcome of a majority vote over one problem's samples."""

    answer: str | None  # the first-seen member of the winning class (None: no sample had an answer)
    votes: int  # size of the winning class
    sample_index: int | None  # index of the winning class's first member
    class_sizes: list[int]  # sizes of all classes, in order of first appearance


def majority_vote(answers: Sequence[str | None], parsed: Sequence[Any] | None = None) -> Vote:
    """Majority vote over extracted answers, grouping by math-verify equivalence (ties: earliest class wins).

    `parsed` may pass already-parsed answers (same order) to avoid parsing twice.
    """
    if parsed is None:
        parsed = [parse_answer(answer) for answer in answers]
    if len(parsed) != len(answers):
        raise ValueError(f"`parsed` has {len(parsed)} entries but `answers` has {len(answers)}.")
    representatives: list[int] = []  # sample index of each class's first member
    sizes: list[int] = []
    for index, parsed_answer in enumerate(parsed):
        if not parsed_answer:
            continue  # no answer: does not vote
        for class_index, representative in enumerate(representatives):
            if parsed_equivalent(parsed[representative], parsed_answer):
                sizes[class_index] += 1
                break
        else:
            representatives.append(index)
            sizes.append(1)
    if not sizes:
        return Vote(answer=None, votes=0, sample_index=None, class_sizes=[])
    # max() returns the first maximal element, i.e. the class that appeared earliest: the documented tie rule.
    winner = max(range(len(sizes)), key=lambda class_index: sizes[class_index])
    return Vote(
        answer=answers[representatives[winner]],
        votes=sizes[winner],
        sample_index=representatives[winner],
        class_sizes=sizes,
    )


__all__ = [
    "Vote",
    "extract_answer",
    "gsm8k_gold_answer",
    "is_equivalent",
    "majority_vote",
    "parse_answer",
    "parsed_equivalent",
]
