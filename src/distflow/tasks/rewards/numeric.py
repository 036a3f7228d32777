"""A binary reward for math word problems whose reference answer is one number (GSM8K style).

Models state their final answer in many surface forms ("\\boxed{1,234}", "#### 1234",
"The answer is $1234."), so both sides are reduced to a number before comparing; string
equality would punish formatting rather than wrong arithmetic. The reward function is called
on arbitrary sampled text, so it returns 0.0 instead of raising on anything it cannot read.
"""

from __future__ import annotations

import math
import re

# One number: optional sign (not a minus between operands, as in "5-3"), digits with optional
# thousands separators, optional decimals, optionally "/ denominator" for a simple fraction.
_NUMBER = re.compile(
    r"(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
)
_ANSWER_MARKER = re.compile(r"answer\s*(?:is\b|:)", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_NOISE = re.compile(r"\\[!,;: ]|\\?[$%{}]")  # LaTeX spacing, $, %, braces


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when there is none.

    Tried in order, each the more explicit statement of intent: the content of the last
    \\boxed{...} (None if that box is never closed, since the answer was cut off); the first
    number after the last "####"; the first number after the last "answer is" / "Answer:";
    else the last number anywhere in the text.
    """
    if not isinstance(text, str):
        return None
    start = text.rfind("\\boxed{")
    if start >= 0:
        return _braced(text, start + len("\\boxed{"))
    for pos in (text.rfind("####"), max((m.end() for m in _ANSWER_MARKER.finditer(text)), default=-1)):
        if pos >= 0 and (m := _NUMBER.search(text, pos)):
            return m.group().strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def numeric_match(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference number (relative tolerance 1e-6,
    so "0.75" matches "3/4" and "42.0" matches "42"), else 0.0.

    The reference may itself be a worked solution ending in "#### 42": if it is not a single
    number, its answer is extracted the same way as the completion's.
    """
    ref = _to_number(str(answer))
    if ref is None:
        ref = _to_number(extract_answer(str(answer)))
    got = _to_number(extract_answer(completion))
    if ref is None or got is None:
        return 0.0
    return 1.0 if math.isclose(got, ref, rel_tol=1e-6) else 0.0


def _to_number(s: str | None) -> float | None:
    """The value of a string holding exactly one number ("$1,234.", "+5", "\\frac{3}{4}", "x = 5");
    None for no number, several ("3 \\cdot 4" is not evaluated), a zero denominator or overflow."""
    if not s:
        return None
    numbers = _NUMBER.findall(_NOISE.sub("", _FRAC.sub(r"\1/\2", s)))
    if len(numbers) != 1:
        return None
    num, _, den = numbers[0].replace(",", "").replace(" ", "").partition("/")
    if den and float(den) == 0:
        return None
    value = float(num) / float(den) if den else float(num)
    return value if math.isfinite(value) else None


def _braced(text: str, i: int) -> str | None:
    """The text from i up to the brace that closes the one just before i; None if unbalanced."""
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None
