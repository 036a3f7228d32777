"""What a tool is: the protocol the built-in tools (distflow.tasks.envs.calculator, distflow.tasks.envs.python_tool)
follow, their result, and the helpers they share.

A tool is called with the decoded "arguments" object of a tool call and never raises: bad arguments,
failures and timeouts come back as a ToolResult with error=True, whose output the model sees as the
observation. Outputs are cut to a character limit so one call cannot flood the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from distflow.config import ConfigError


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model sees (already truncated to the limit)
    error: bool = False  # the call failed (bad arguments, exception, non-zero exit)
    timed_out: bool = False


def cut_text(head: str, total: int, limit: int) -> str:
    """`head` (at most `limit` chars of a text `total` chars long) plus the truncation marker when needed."""
    return head[:limit] if total <= limit else f"{head[:limit]}\n...[truncated {total - limit} chars]"


def truncate(text: str, limit: int) -> str:
    """text if len(text) <= limit, else the first `limit` chars + "\\n...[truncated N chars]" (N chars cut)."""
    return cut_text(text, len(text), limit)


class Tool(Protocol):
    """Also, for a tool that runs under a time limit (the python tool): `max_call_s`, the most seconds one
    call takes, start-up included; ToolEnv caps such calls per turn and checks they fit in a step's limit."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object (for the system prompt)

    def __call__(self, arguments: dict) -> ToolResult: ...


def error_result(reason: str) -> ToolResult:
    return ToolResult(f"error: {reason}", error=True)


def string_argument(arguments: object, key: str) -> str | ToolResult:
    """arguments[key] when it is a string, else the error result to return."""
    if not isinstance(arguments, dict) or key not in arguments:
        return error_result(f'missing argument "{key}"')
    value = arguments[key]
    return value if isinstance(value, str) else error_result(f'"{key}" must be a string, got {type(value).__name__}')


def check_output_limit(max_output_chars: int) -> None:
    if max_output_chars < 1:
        raise ConfigError(f"tool max_output_chars must be >= 1, got {max_output_chars}")
