"""Final-answer extraction, math-verify equivalence and the majority vote (with its tie rule)."""

import pytest

from iha.evaluation.answers import extract_answer, gsm8k_gold_answer, is_equivalent, majority_vote


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the total is \\boxed{18}.", "18"),
        ("First \\boxed{3}, but wait, it is \\boxed{4}.", "4"),  # the last box wins
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{\\left(2\\right)}}", "\\frac{\\sqrt{3}}{\\left(2\\right)}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("so we get \\boxed 5", "5"),
        ("She makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000", "1,000"),
        ("Adding up, the final answer is 42.", "42"),
        ("Answer: 3.5", "3.5"),
        ("I think it is about seven apples", None),
        ("", None),
        ("\\boxed{}", None),
        ("cut off inside the box: \\boxed{\\frac{1}{", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_takes_precedence_over_gsm8k_marker():
    assert extract_answer("#### 5\nActually \\boxed{6}") == "6"


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
    assert gsm8k_gold_answer("blah <<2*3=6>>6\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold_answer("no marker here")


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
