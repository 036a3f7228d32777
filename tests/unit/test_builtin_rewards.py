"""Built-in rewards against hand-written fixtures: right answers in several surface forms,
wrong answers, and malformed output. Each is called exactly as the pool calls it."""

from __future__ import annotations

import pytest

from distflow.tasks.rewards.registry import BUILTIN, load_reward


def call(name: str, completion: str, item: dict, ids: list | None = None) -> float:
    return load_reward(name)("a prompt", completion, ids if ids is not None else [1, 2, 3], item)


def test_all_builtins_registered():
    assert set(BUILTIN) == {"numeric", "math", "gsm8k", "countdown", "format", "length_penalty", "tool_use"}


# ----------------------------------------------------------------------------- math
@pytest.mark.parametrize("completion,gold", [
    ("So the answer is \\boxed{\\frac12}.", "\\frac{1}{2}"),
    ("The answer is $0.5$.", "\\frac{1}{2}"),
    ("Thus \\boxed{\\dfrac{1}{2}}", "$\\frac{1}{2}$"),
    ("We get \\boxed{0.5}", "1/2"),
    ("\\boxed{2\\sqrt 3}", "2\\sqrt{3}"),
    ("Simplifying, $\\sqrt{12}$", "2\\sqrt{3}"),  # equal values, different forms
    ("The final answer is $x^2 + 1$", "x^2+1"),
    ("\\boxed{1+x^2}", "x^2+1"),  # commuted
    ("#### 7 so \\boxed{7}", "Adding 3 and 4 gives 7.\n#### 7"),  # GSM8K-style gold
    ("\\boxed{1,234}", "1234"),
])
def test_math_right(completion, gold):
    assert call("math", completion, {"answer": gold}) == 1.0


@pytest.mark.parametrize("completion,gold", [
    ("So the answer is \\boxed{\\frac13}.", "\\frac{1}{2}"),
    ("\\boxed{x^2 - 1}", "x^2+1"),
    ("The answer is $2\\sqrt{2}$", "2\\sqrt{3}"),
    ("no math here at all", "\\frac{1}{2}"),
    ("", "5"),
    ("\\boxed{", "5"),  # cut off
    ("}}}{{\\frac{\\frac{", "5"),  # garbage
])
def test_math_wrong_or_malformed(completion, gold):
    assert call("math", completion, {"answer": gold}) == 0.0


PREPARE_CHECK = r"""
import sys
from distflow.tasks.rewards.registry import load_reward
HEAVY = ("math_verify", "sympy", "latex2sympy2_extended")
fn = load_reward("math")
assert callable(fn.prepare)
early = [m for m in HEAVY if m in sys.modules]
assert not early, f"resolving the reward already imported {early}"
fn.prepare()
missing = [m for m in HEAVY if m not in sys.modules]
assert not missing, f"prepare() did not import {missing}"
print(fn("a prompt", "so \\boxed{\\frac{1}{2}}", [1, 2, 3], {"answer": "0.5"}))
"""


def test_math_prepare_hook():
    """prepare() is where math-verify (and sympy under it) get imported: in a fresh process,
    resolving the reward imports none of them, prepare() all of them, and the reward then scores."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", PREPARE_CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1.0"], proc.stdout


# ----------------------------------------------------------------------------- gsm8k
GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("completion", [
    "She sold 72 clips.",
    "48 + 24 = 72\n#### 72",
    "The answer is 72.",
    "\\boxed{72}",
    "The answer is $72.00$",
])
def test_gsm8k_right(completion):
    assert call("gsm8k", completion, {"answer": GSM8K_SOLUTION}) == 1.0


def test_gsm8k_thousands_in_reference():
    assert call("gsm8k", "So \\boxed{1234}", {"answer": "work...\n#### 1,234"}) == 1.0
    assert call("gsm8k", "The answer is 1,234.", {"answer": "1234"}) == 1.0  # bare reference


@pytest.mark.parametrize("completion", [
    "She sold 24 clips in May.",  # an intermediate number, not the answer
    "The answer is 71.",
    "\\boxed{72",  # cut off
    "I don't know.",
    "",
])
def test_gsm8k_wrong(completion):
    assert call("gsm8k", completion, {"answer": GSM8K_SOLUTION}) == 0.0


# ----------------------------------------------------------------------------- countdown
CD = {"numbers": [25, 5, 3], "target": 60}


@pytest.mark.parametrize("completion", [
    "<think>25-5=20, 20*3=60</think>\n<answer>(25 - 5) * 3</answer>",
    "<answer>(25 - 5) * 3 = 60</answer>",
    "<answer>60 = 3 * (25 - 5)</answer>",
    "<answer>(25 − 5) × 3</answer>",  # unicode operators
    "Let me try.\nAnswer: (25-5)*3.",  # no tags: the last line
    "<answer>wrong</answer> then <answer>3*(25-5)</answer>",  # the last tag wins
])
def test_countdown_right(completion):
    assert call("countdown", completion, CD) == 1.0


def test_countdown_exact_division_and_at_most_once():
    assert call("countdown", "<answer>(8 / 3) * 6 / 4</answer>", {"numbers": [8, 3, 6, 4], "target": 4}) == 1.0
    # use_all=False: a subset of the numbers is fine, reuse still is not
    item = {"numbers": [25, 5, 3, 7], "target": 60, "use_all": False}
    assert call("countdown", "<answer>(25-5)*3</answer>", item) == 1.0
    assert call("countdown", "<answer>(25-5)*3*7</answer>", item) == 0.0
    assert call("countdown", "<answer>(25+5)*(3-1)</answer>", item) == 0.0  # 1 is not given


@pytest.mark.parametrize("completion", [
    "<answer>(25 + 5) * 3</answer>",  # evaluates to 90
    "<answer>(25 - 5) * 3 * 3</answer>",  # 3 used twice
    "<answer>25 * 3 - 15</answer>",  # 15 is not one of the numbers
    "<answer>(25 - 5) * 3 + 0</answer>",  # 0 is not given either
    "<answer>20 * 3</answer>",  # 20 is not given, 25 and 5 unused
    "<answer>12 * 5</answer>",  # right value, wrong numbers (3 and 25 unused)
    "<answer>__import__('os').system('true')</answer>",  # code, not arithmetic
    "<answer>(25 - 5) ** 3</answer>",  # power is not allowed
    "<answer>25 / (5 - 5) * 3</answer>",  # division by zero
    "<answer>((25 - 5) * 3</answer>",  # unbalanced
    "<answer></answer>",
    "I cannot find it",
    "",
])
def test_countdown_wrong_or_malformed(completion):
    assert call("countdown", completion, CD) == 0.0


def test_countdown_fraction_not_rounded():
    # 7/2*2 is exactly 7 with rational arithmetic; 7/3*3 too (no float error); 7/3 is not 2
    assert call("countdown", "<answer>7 / 3 * 3</answer>", {"numbers": [7, 3, 3], "target": 7}) == 1.0
    assert call("countdown", "<answer>7 / 3</answer>", {"numbers": [7, 3], "target": 2}) == 0.0


# ----------------------------------------------------------------------------- format
@pytest.mark.parametrize("completion", [
    "so \\boxed{42}",
    "so \\boxed{\\frac{1}{2}}",
    "<answer>(25-5)*3</answer>",
    "<answer>\n12\n</answer>",
    "The answer is 42",
    "the final answer is: x",
    "step\n#### 42",
])
def test_format_present(completion):
    assert call("format", completion, {}) == 1.0


@pytest.mark.parametrize("completion", [
    "42",
    "so \\boxed{42",  # never closed
    "\\boxed{}",  # empty
    "<answer></answer>",
    "<answer>12",  # never closed
    "I wonder what the answer could be",
    "",
])
def test_format_absent(completion):
    assert call("format", completion, {}) == 0.0


# ----------------------------------------------------------------------------- length_penalty
def test_length_penalty():
    assert call("length_penalty", "x", {}, ids=[]) == 0.0
    assert call("length_penalty", "x", {}, ids=list(range(250))) == pytest.approx(-0.25)
    assert call("length_penalty", "x", {}, ids=list(range(1000))) == pytest.approx(-1.0)
