"""Final-answer extraction, math-verify equivalence and the majority vote (with its tie rule)."""

import pytest

from iha.data.gsm8k import gsm8k_final_answer
from iha.evaluation.answers import (
    extract_answer,
    is_equivalent,
    majority_vote,
    parse_answer,
    parsed_equivalent,
    read_answer,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the total is \\boxed{18}.", "18"),
        # the last box wins (boxes this far apart are not read as one answer set: see test_adjacent_boxes...)
        ("First \\boxed{3}.\nLet me check that again: 3 apples plus the one she was given.\nSo it is \\boxed{4}.", "4"),
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        # nested braces; the answer is reported as math-verify normalised it (\left( ... \right) becomes ( ... ))
        ("\\boxed{\\frac{\\sqrt{3}}{\\left(2\\right)}}", "\\frac{\\sqrt{3}}{(2)}"),
        ("\\fbox{7}", "7"),
        ("so we get \\boxed 5", "5"),
        ("so we get \\boxed {18}.", "18"),
        ("She makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000", "1,000"),
        ("Adding up, the final answer is 42.", "42"),
        ("Answer: 3.5", "3.5"),
        ("I think it is about seven apples", None),
        ("", None),
        ("\\boxed{}", None),
        ("cut off inside the box: \\boxed{\\frac{1}{", None),
        ("Step 1: 3 + 4 = 7 apples, then 2 more", None),  # no box, no answer phrase: not "the last number"
        ("\\boxed{12}\n\nI hope this helps! Ask me 2 or 3 more questions.", "12"),
        # math-verify reads "Answer: -2,1" as the decimal -2.1 and finds nothing in "Answer: (5,\infty)" or
        # "answer is \$100": the rest of the line is read as one LaTeX answer instead.
        ("Enter all the integer roots.\nAnswer: -2,1", "-2,1"),
        ("Answer: (5,\\infty)", "(5,\\infty)"),
        ("The answer is \\$100.", "\\$100"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_takes_precedence_over_gsm8k_marker():
    assert extract_answer("#### 5\nActually \\boxed{6}") == "6"


def test_an_unreadable_box_falls_back_to_the_answer_line():
    assert extract_answer("#### 5\nand then \\boxed{\\frac{1}{") == "5"


def test_adjacent_boxes_are_one_answer_set():
    # math-verify's rule: boxes next to each other (joined by a comma, "and", "or") are read together, so a
    # multi-answer problem boxed part by part is right ...
    answer, parsed = read_answer("The integer roots are \\boxed{-2} and \\boxed{1}.")
    assert parsed_equivalent(parse_answer("-2,1"), parsed)
    assert not parsed_equivalent(parse_answer("1"), parsed)
    # ... and a correction written in the same sentence is read as a set too (wrong for the gold 4); boxes further
    # apart are not joined (see test_extract_answer: the last box wins).
    _, parsed = read_answer("So \\boxed{3}, no wait, it is \\boxed{4}.")
    assert not parsed_equivalent(parse_answer("4"), parsed)


def test_read_answer_returns_the_parse_used_for_checking():
    answer, parsed = read_answer("so $\\boxed{\\dfrac{28}{6}}$")
    assert answer == "\\frac{28}{6}"
    assert parsed_equivalent(parse_answer("\\frac{14}{3}"), parsed)
    assert read_answer("no answer here") == (None, None)


@pytest.mark.parametrize(
    "gold, prediction",
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{1}{2}", "1/2"),
        ("0.5", "\\dfrac12"),
        ("1000", "1,000"),
        ("18", "\\$18.00"),
        ("18", "18.0"),
        ("\\frac{14}{3}", "\\frac{28}{6}"),
        ("(3, \\frac{\\pi}{2})", "\\left(3, \\frac{\\pi}{2}\\right)"),
        ("x^2+2x", "2x + x^2"),
    ],
)
def test_equivalent_forms(gold, prediction):
    assert is_equivalent(gold, prediction)


@pytest.mark.parametrize(
    "gold, prediction",
    [
        ("\\frac{1}{2}", "0.25"),
        ("18", "19"),
        ("18", None),  # no answer is wrong
        ("18", ""),
        ("(3, \\frac{\\pi}{2})", "(3, \\pi)"),
    ],
)
def test_different_answers(gold, prediction):
    assert not is_equivalent(gold, prediction)


def test_gsm8k_gold_answer():
    # The evaluation's gold answers come from the data's one GSM8K rule.
    assert gsm8k_final_answer("blah <<2*3=6>>6\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no marker here")


def test_majority_groups_equivalent_forms():
    # 0.5, 1/2 and \frac{1}{2} are one class of 3 votes; 2 appears twice.
    vote = majority_vote(["2", "0.5", "1/2", "2", "\\frac{1}{2}"])
    assert vote.votes == 3
    assert vote.answer == "0.5"  # the class is reported by its first member
    assert vote.sample_index == 1
    assert vote.class_sizes == [2, 3]


def test_majority_tie_goes_to_the_earliest_class():
    vote = majority_vote(["7", "3", "3", "7"])
    assert (vote.answer, vote.votes, vote.sample_index) == ("7", 2, 0)
    vote = majority_vote(["3", "7", "7", "3"])
    assert (vote.answer, vote.votes, vote.sample_index) == ("3", 2, 0)


def test_missing_answers_do_not_vote():
    # Three samples without an answer do not outvote a single real answer.
    vote = majority_vote([None, None, "5", None])
    assert (vote.answer, vote.votes, vote.sample_index) == ("5", 1, 2)
    assert vote.class_sizes == [1]


def test_no_answer_at_all_has_no_winner():
    vote = majority_vote([None, None])
    assert vote.answer is None and vote.sample_index is None and vote.votes == 0


def test_parsed_list_must_match():
    with pytest.raises(ValueError, match="parsed"):
        majority_vote(["1", "2"], parsed=[None])
