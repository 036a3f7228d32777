"""Built-in rewards beyond `numeric`, all with the registry signature
`fn(prompt, completion, completion_ids, item) -> float`.

They run on arbitrary sampled text, so anything unreadable scores 0.0 rather than raising.
None of them enforces a time limit itself: RewardPool kills a call that runs too long.

- math: symbolic equivalence with math-verify (`item["answer"]` is the gold: LaTeX or plain).
- gsm8k: the number after the last "####" of the reference, matched numerically.
- countdown: an arithmetic expression over `item["numbers"]` that evaluates to `item["target"]`.
- format: 1.0 when the completion states a final answer in a recognised form.
- length_penalty: -len(completion_ids) / 1000 (scale it with its weight in `task.rewards`).
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

from distflow.tasks.rewards.numeric import _braced, numeric_match


# ----------------------------------------------------------------------------- math
def _math_verify():
    """math-verify imports sympy (~1.5 s), so only processes that use the reward pay for it."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass timeouts of None (math-verify's signal.alarm cannot run off the main thread; the
    # pool enforces time instead), so silence its once-per-process warning about exactly that.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def math_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """1.0 if the completion's final answer is mathematically equal to the gold answer.

    The gold may be bare LaTeX ("\\frac{1}{2}", "x^2+1"), delimited ("$...$", "\\boxed{...}")
    or a worked solution ending in "#### 7". The completion is parsed by math-verify's default
    extraction (the last \\boxed{}, "the answer is ...", a trailing $...$ expression).
    """
    mv = _math_verify()
    gold = str(item["answer"])
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1].strip()
    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"  # bare LaTeX is only extracted inside delimiters
    gold_parsed = mv.parse(gold, parsing_timeout=None)
    pred_parsed = mv.parse(completion, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return 1.0 if mv.verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0


# Called by pool workers before they report ready, so the first scored call is not the one that
# pays for importing sympy (which could exceed a tight task.reward_timeout_s).
math_reward.prepare = lambda: _math_verify().parse("$1$", parsing_timeout=None)


# ----------------------------------------------------------------------------- gsm8k
def gsm8k_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """GSM8K: the reference is a worked solution ending in "#### 1,234" (or a bare number);
    the completion's final answer (see numeric.extract_answer) must equal it numerically."""
    ref = str(item["answer"])
    if "####" in ref:
        ref = ref.rsplit("####", 1)[1].strip().replace(",", "")
    return numeric_match(completion, ref)


# ----------------------------------------------------------------------------- countdown
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = {"×": "*", "\\times": "*", "\\cdot": "*", "÷": "/", "\\div": "/", "−": "-",
            "$": "", "\\left": "", "\\right": ""}
_EXPR_RUN = re.compile(r"[\d\s+\-*/()]+")  # a stretch of arithmetic; "=", words and "." end it
_MAX_EXPR_CHARS = 200


def countdown_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """Countdown: 1.0 if the answer is an expression with + - * / and parentheses that uses each
    of `item["numbers"]` exactly once (set `item["use_all"] = False` for "at most once") and
    evaluates exactly (rational arithmetic) to `item["target"]`.

    The answer is the last <answer>...</answer> if there is one, else the last non-empty line.
    Of its arithmetic stretches (split by "=", words, punctuation) the one with the most numbers
    is the expression: "(25 - 5) * 3 = 60" and "Answer: (25-5)*3." both give "(25-5)*3".
    Parsed with `ast` and evaluated node by node: names, calls, powers etc. score 0.0.
    """
    tagged = _ANSWER_TAG.findall(completion)
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    text = tagged[-1] if tagged else (lines[-1] if lines else "")
    for sym, rep in _SYMBOLS.items():
        text = text.replace(sym, rep)
    runs = _EXPR_RUN.findall(text) or [""]
    expr = max(runs, key=lambda r: len(re.findall(r"\d+", r))).strip()
    if not expr or len(expr) > _MAX_EXPR_CHARS:
        return 0.0
    try:
        used: list = []
        value = _evaluate(ast.parse(expr, mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0.0
    available = Counter(int(n) for n in item["numbers"])
    used_count = Counter(used)
    if item.get("use_all", True):
        ok_numbers = used_count == available
    else:
        ok_numbers = not (used_count - available)
    return 1.0 if ok_numbers and value == Fraction(item["target"]) else 0.0


def _evaluate(node: ast.AST, used: list) -> Fraction:
    """Exact value of an arithmetic AST; appends every literal to `used`. ValueError otherwise."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in a countdown answer: {type(node).__name__}")


# ----------------------------------------------------------------------------- format
_FORMAT_MARKERS = re.compile(
    r"<answer>\s*\S.*?</answer>|\bthe (?:final )?answer is\b|####\s*\S", re.DOTALL | re.IGNORECASE
)


def format_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """1.0 if the completion marks a final answer: a closed, non-empty \\boxed{...},
    <answer>...</answer>, "The answer is" / "The final answer is", or "#### x"; else 0.0.
    Says nothing about correctness: combine it with a small weight, e.g. {numeric: 1, format: 0.1}."""
    start = completion.rfind("\\boxed{")
    if start >= 0 and _braced(completion, start + len("\\boxed{")):
        return 1.0
    return 1.0 if _FORMAT_MARKERS.search(completion) else 0.0


def tool_use_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """1.0 if the episode got at least one tool result that is not an error (the tool environment's
    error messages start with "error:"), else 0.0; single-turn samples have no transcript and get
    0.0. Like `format`, it teaches the form, not the answer: weight it well below the task's reward,
    e.g. {"distflow.tasks.gym:gym_reward": 1, tool_use: 0.2}."""
    return 1.0 if any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("error:")
                      for m in item.get("transcript", ())) else 0.0


# ----------------------------------------------------------------------------- length
def length_penalty_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """-len(completion_ids) / 1000: -0.1 for 100 tokens. Its weight in `task.rewards` sets the
    strength, e.g. {math: 1.0, length_penalty: 0.5} costs 0.05 per 100 tokens."""
    return -len(completion_ids) / 1000.0
