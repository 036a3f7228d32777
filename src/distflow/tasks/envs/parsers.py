"""Tool-call parsing: turn the model's turn text into the tool calls it asks for.

A parser is `fn(text: str) -> list[ToolCall]`; it raises ToolCallError for a call it cannot read, and
the message goes back to the model as that call's error observation (so it can fix the format).
A spec is a built-in name (see PARSERS) or a dotted path `package.module:function`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from distflow.config.specs import resolve

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """A malformed tool call; str(e) is a short message shown to the model as the tool's error observation."""


def _decode(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ToolCallError(f"{what} is nested too deeply") from None
    except ValueError as e:  # an integer past Python's int-string conversion limit (4300 digits)
        raise ToolCallError(f"{what} holds a number too long to read: {str(e).split(';')[0]}") from None


def _call(body: str) -> ToolCall:
    obj = _decode(body.strip(), "tool call")
    if not isinstance(obj, dict):
        raise ToolCallError(f'a tool call must be a JSON object with "name" and "arguments", got {type(obj).__name__}')
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError('"name" must be a non-empty string' if "name" in obj else 'the tool call has no "name"')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments object JSON-encoded as a string
        arguments = _decode(arguments, f'"arguments" of {name!r} (a string)')
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


def hermes_tool_calls(text: str) -> list[ToolCall]:
    """Qwen2/Hermes format: every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, in order.

    "arguments" may be missing ({}) or a JSON string holding an object. A malformed block raises
    ToolCallError rather than being skipped, so the model learns that its call was not run.
    """
    calls, pos = [], 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        start += len(OPEN_TAG)
        end = text.find(CLOSE_TAG, start)
        if end < 0:
            raise ToolCallError(f"{OPEN_TAG} without a closing {CLOSE_TAG}")
        calls.append(_call(text[start:end]))
        pos = end + len(CLOSE_TAG)
    return calls


ToolParser = Callable[[str], list[ToolCall]]

PARSERS: dict[str, ToolParser] = {"hermes": hermes_tool_calls}


def load_parser(spec: str) -> ToolParser:
    """A built-in name or "package.module:function"; anything else is a one-line ConfigError, raised at
    start-up rather than on the first turn."""
    return resolve(spec, PARSERS, "tool parser")
