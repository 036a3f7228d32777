"""The calculator tool: exact arithmetic by walking the expression's AST (no eval), with the sizes of
exponents and results bounded so that no expression can run long or flood memory."""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable

from distflow.tasks.envs.tools import ToolResult, check_output_limit, error_result, string_argument, truncate


class _CalcError(Exception):
    """A reason shown to the model as "error: <reason>"."""


MAX_DIGITS = 1000  # |int results| < 10**MAX_DIGITS: keeps every operation (and str()) cheap
MAX_EXPONENT = 1000
MAX_EXPRESSION_CHARS = 2000
_INT_BOUND = 10**MAX_DIGITS
_BITS_BOUND = _INT_BOUND.bit_length()

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: object) -> int | float:
    if isinstance(value, complex):
        raise _CalcError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _CalcError("the result is too large (not a finite number)")
    if isinstance(value, int) and abs(value) >= _INT_BOUND:
        raise _CalcError(f"the result has more than {MAX_DIGITS} digits")
    return value  # type: ignore[return-value]


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise _CalcError(f"exponent {exp} is too large (|exponent| <= {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and (abs(base).bit_length() - 1) * exp > _BITS_BOUND:
        raise _CalcError(f"the result has more than {MAX_DIGITS} digits")  # known before computing it
    return base**exp


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: excluded on purpose
            raise _CalcError(f"only numbers are allowed, got {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Name):
        raise _CalcError(f"unknown name {node.id!r}: only numbers and + - * / // % ** ( ) are allowed")
    what = type(getattr(node, "op", node)).__name__
    raise _CalcError(f"{what} is not allowed: only numbers and + - * / // % ** ( ) are allowed")


def _format_number(value: int | float) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


class Calculator:
    """Exact arithmetic by walking the expression's AST (never eval): a tool to check sums, not run code.

    Integers stay Python ints (exact); the exponent and the size of every intermediate result are bounded,
    so an expression like 9**9**9 is refused at once instead of hanging the worker.
    """

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly. Supports integers (exact, any size up to 1000 digits), "
        "decimals, + - * / // % ** and parentheses. No variables or functions."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression, e.g. (3 + 4) * 2**10"}},
        "required": ["expression"],
    }

    def __init__(self, max_output_chars: int = 2000) -> None:
        check_output_limit(max_output_chars)
        self.max_output_chars = max_output_chars

    def __call__(self, arguments: dict) -> ToolResult:
        expression = string_argument(arguments, "expression")
        if isinstance(expression, ToolResult):
            return expression
        if len(expression) > MAX_EXPRESSION_CHARS:
            return error_result(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            value = _evaluate(ast.parse(expression.strip(), mode="eval"))
        except SyntaxError as e:
            return error_result(e.msg if e.msg.startswith("invalid syntax") else f"invalid syntax: {e.msg}")
        except _CalcError as e:
            return error_result(str(e))
        except ZeroDivisionError:
            return error_result("division by zero")
        except OverflowError:
            return error_result("the result is too large")
        except (RecursionError, MemoryError):
            return error_result("the expression is nested too deeply")
        except ValueError as e:  # e.g. an integer literal beyond the str-conversion limit
            return error_result(str(e).split(";")[0])
        return ToolResult(truncate(_format_number(value), self.max_output_chars))
