"""Final-answer extraction, equivalence checking (math-verify) and majority vote.

The rules, in one place:

* **Extraction** (`read_answer`): the *last* `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), found and read by
  math-verify's `parse` (braces balanced; math-verify reads boxes close together as one answer set: fewer than 10
  characters apart, or fewer than 70 with a comma, "and", "or" or ";" between them, as in `\\boxed{3}, \\boxed{5}`). If there is no box, or math-verify cannot read it (a box cut
  off by the token limit), the text after the last `#### ` (GSM8K's own format); if there is none, the rest of the
  line after the last "answer is" / "Answer:". Otherwise there is no answer (`None`): never "the last number in the
  text", so a completion cut off mid-reasoning has no answer. A boxed answer is reported as math-verify read it (its
  normalised LaTeX: `\\left(` is written `(`, `0.5` is written `\\frac{1}{2}`).
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


# math-verify's own timeout uses signal.alarm, which only works on the main thread.
_TIMEOUT_SECONDS = 5

# Boxes only: math-verify's box rule first, then its LaTeX answer phrases, never any `$...$` or number in the text.
_BOX_CONFIG = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]

# What math-verify's `parse` does not do for a completion, kept here on purpose:
# - its box pattern looks for `\boxed{` only: `\fbox{5}`, `\boxed {5}` and the brace-less TeX form `\boxed 5` are
#   rewritten first;
# - GSM8K's answer line `#### 42` has no rule there (it would only be found as "some number in the text");
# - its answer phrases read plain text after "Answer:" as a number, so `Answer: -2,1` gives -2.1 and
#   `Answer: (5,\infty)` or `The answer is \$100.` give nothing; here the rest of the line is read as one LaTeX
#   answer (which is what these phrases mean in the completions of a model asked for a final answer).
_BOXED_WITHOUT_BRACES = re.compile(r"\\boxed\s+([^\s{}$]+?)\.?(?=\s|\$|$)")
_BOXED_SPACE_BRACE = re.compile(r"\\boxed\s+\{")
_GSM8K_MARKER = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)


def _timeout() -> int | None:
    return _TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _clean_phrase(answer: str) -> str:
    answer = answer.strip().splitlines()[0].strip() if answer.strip() else ""
    # Drop a trailing full stop (but not a decimal point) and surrounding `$`.
    answer = re.sub(r"\.\s*$", "", answer).strip()
    return answer.strip("$ ").strip()


def _last_line_answer(text: str) -> str | None:
    """The answer after the last `#### ` or, without one, after the last "answer is" / "Answer:"; or None."""
    for pattern in (_GSM8K_MARKER, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return _clean_phrase(found[-1]) or None
    return None


def read_answer(text: str) -> tuple[str | None, list | None]:
    """The final answer of a completion: (the answer string, math-verify's parse of it), or (None, None).

    See the module docstring for the rules.
    """
    if not text:
        return None, None
    text = _BOXED_SPACE_BRACE.sub(r"\\boxed{", text.replace("\\fbox", "\\boxed"))
    text = _BOXED_WITHOUT_BRACES.sub(r"\\boxed{\1}", text)
    if "\\boxed" in text:
        parsed = parse(text, extraction_config=_BOX_CONFIG, parsing_timeout=_timeout())
        # [value, string] when math-verify found and read an answer; [string] alone when it cannot read what it found.
        if len(parsed) == 2:
            return parsed[1], parsed
    answer = _last_line_answer(text)
    parsed = parse_answer(answer)
    return (answer, parsed) if parsed else (None, None)


def extract_answer(text: str) -> str | None:
    """The final answer string of a completion (see `read_answer`), or None."""
    return read_answer(text)[0]


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
    "is_equivalent",
    "majority_vote",
    "parse_answer",
    "parsed_equivalent",
    "read_answer",
]
