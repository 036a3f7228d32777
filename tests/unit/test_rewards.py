"""The numeric-match reward: surface forms of a right answer, wrong answers, and garbage."""

from __future__ import annotations

import pytest

from distflow.tasks.rewards import extract_answer, numeric_match


@pytest.mark.parametrize("text,expected", [
    ("so the result is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{ 2 }", "2"),  # the last box wins
    ("\\boxed{\\frac{3}{4}} and 7", "\\frac{3}{4}"),  # nested braces
    ("5 + 7 = 12\n#### 12", "12"),
    ("#### 12 apples, 3 left", "12"),
    ("The answer is 42. Check: 6 * 7 = 42, and 41 < 42", "42"),
    ("Answer: -7\nbecause 3 - 10 = -7", "-7"),
    ("I think 3 then 5 then 8", "8"),  # no marker: the last number
    ("5-3", "3"),  # a minus between operands is not a sign
    ("costs $1,234.50 in total", "1,234.50"),
    ("no digits here", None),
    ("", None),
    ("\\boxed{42", None),  # the box was cut off: no answer, even though 42 is there
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("completion,answer", [
    ("\\boxed{42}", "42"),
    ("Adding up, we get #### 42", "42"),
    ("The answer is 42.", "42"),
    ("the final answer is $42$.", "42"),
    ("42.0", "42"),
    ("42", "42.0"),
    ("+42", "42"),
    ("So 1,234", "1234"),
    ("\\boxed{1234}", "1,234"),
    ("\\boxed{\\$1,234.}", "1234"),
    ("3/4", "0.75"),
    ("\\boxed{0.75}", "3/4"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("50%", "50"),
    ("x = \\boxed{-5}", "-5"),
    ("0.3333333", "1/3"),  # within 1e-6 relative
    ("after 24 in May she sold 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),  # worked reference
    ("\\boxed{7}", 7),  # a non-string reference
])
def test_right_answers(completion, answer):
    assert numeric_match(completion, answer) == 1.0


@pytest.mark.parametrize("completion,answer", [
    ("\\boxed{41}", "42"),
    ("The answer is 42.", "24"),
    ("#### 4.2", "42"),
    ("-42", "42"),
    ("0.333", "1/3"),  # outside the tolerance
    ("1,234", "1.234"),
    ("3/4", "4/3"),
    ("the answer is 41, not 42", "42"),  # the stated answer counts, not a later number
])
def test_wrong_answers(completion, answer):
    assert numeric_match(completion, answer) == 0.0


@pytest.mark.parametrize("completion", [
    "", "   ", "no number at all", "\\boxed{", "\\boxed{42", "}}}{{{", "\\boxed{}", "\\boxed{3 \\cdot 14}",
    "#### ", "The answer is", "1/0", "9" * 5000, "\x00\xff\u202e", "\\frac{1}{0}", None, 42,
])
def test_malformed_outputs_score_zero(completion):
    assert numeric_match(completion, "42") == 0.0


def test_bad_references_score_zero():
    assert numeric_match("42", "") == 0.0
    assert numeric_match("42", "forty-two") == 0.0
    assert numeric_match("42", None) == 0.0
