"""Chat messages at the endpoint's boundary: what a request's messages (OpenAI's format, or
Anthropic's Messages) mean to the chat template, when two messages are the same turn, and the
assistant message a generated turn becomes in each format.

A harness sends OpenAI's format (content as a string or a list of text parts, a tool call's
arguments as a JSON string); chat templates read Hugging Face's (content a string, arguments an
object). `template_message` converts one; `turn_key` is what "the same message" means when a
request is matched against a recorded conversation (role, text, tool calls by name, canonical
arguments and id, a tool result's call id), so a harness that echoes the assistant message back
with the client's extra fields (refusal: null, annotations, ...) still extends its trajectory.
"""

from __future__ import annotations

import json
from typing import Any

from distflow.tasks.envs.parsers import ToolCallError, hermes_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(ValueError):
    """A request the endpoint refuses: str(e) is the message the client gets (HTTP 400)."""


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null (an assistant turn of tool calls only), or a
    list of {"type": "text", "text": ...} parts, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string, null or a list of text parts, got {type(content).__name__}")


def _arguments(call: dict, where: str) -> dict:
    raw = call.get("arguments", "{}")
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise BadRequest(f"{where}.function.arguments is not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object")
    return value


def template_message(message: Any, where: str) -> dict:
    """One request message in the chat template's format (refused with a BadRequest when malformed)."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with a role and content")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    out: dict = {"role": "system" if role == "developer" else role, "content": text_of(message.get("content"), where)}
    calls = message.get("tool_calls") or []
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls: only an assistant message carries a list of tool calls")
        out["tool_calls"] = []
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadRequest(f"{where}.tool_calls[{k}] must be "
                                 "{'type': 'function', 'function': {name, arguments}}")
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": fn["name"],
                                                   "arguments": _arguments(fn, f"{where}.tool_calls[{k}]")}})
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def turn_key(message: dict) -> tuple:
    """What makes two template messages the same turn."""
    calls = tuple((c.get("id"), c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls", []))
    return message["role"], message["content"], calls, message.get("tool_call_id"), message.get("name")


def assistant_turn(text: str, with_tools: bool, call_prefix: str) -> tuple[dict, dict]:
    """A generated turn as (the OpenAI message the client gets, its template message). With tools
    offered, `<tool_call>` blocks (the Hermes/Qwen format) become tool calls and the text before the
    first is the content; a block that does not parse leaves the whole text as content."""
    calls = []
    if with_tools:
        try:
            calls = hermes_tool_calls(text)
        except ToolCallError:
            calls = []
    if not calls:
        return {"role": "assistant", "content": text}, {"role": "assistant", "content": text}
    content = text[:text.find("<tool_call>")].strip()
    ids = [f"{call_prefix}-{k}" for k in range(len(calls))]
    api = {"role": "assistant", "content": content or None,
           "tool_calls": [{"id": i, "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                          for i, c in zip(ids, calls)]}
    template = {"role": "assistant", "content": content,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for i, c in zip(ids, calls)]}
    return api, template


# ---------------------------------------------------------------------------- Anthropic's Messages
def _anthropic_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    parts = []
    for k, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise BadRequest(f"{where}[{k}]: only text blocks are supported here, got "
                             f"{block.get('type') if isinstance(block, dict) else type(block).__name__!r}")
        parts.append(block["text"])
    return "".join(parts)


def anthropic_request(body: dict) -> tuple[list[dict], list[dict] | None]:
    """An Anthropic Messages request as template messages and OpenAI-format tools: `system` first, a
    user turn's tool_result blocks as tool messages (then its text, if any), an assistant turn's
    tool_use blocks as tool calls."""
    out = []
    if body.get("system"):
        out.append({"role": "system", "content": _anthropic_text(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be user or assistant")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks")
        text, calls = [], []
        for k, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and message["role"] == "assistant" and isinstance(block.get("name"), str):
                if not isinstance(block.get("input", {}), dict):
                    raise BadRequest(f"{where}.content[{k}].input must be an object")
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and message["role"] == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _anthropic_text(block.get("content", ""), f"{where}.content[{k}].content")})
            else:
                raise BadRequest(f"{where}.content[{k}]: a {kind!r} block is not supported in a {message['role']} turn")
        if message["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})})
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    tools = body.get("tools") or None
    if tools is not None:
        if not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools)):
            raise BadRequest("tools must be a list of {name, description, input_schema} objects")
        tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema", {})}} for t in tools]
    return out, tools


def anthropic_content(api: dict) -> list[dict]:
    """An assistant message (as assistant_turn returns it for OpenAI) as Anthropic content blocks."""
    blocks = [{"type": "text", "text": api["content"]}] if api.get("content") else []
    for call in api.get("tool_calls", []):
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks or [{"type": "text", "text": ""}]
