"""Harnesses for the agent tests, written only against the `openai` client as a user's would be.
`dispatch` runs the one its task row names (fields["kind"]), so one batch of episodes covers them
all; each records what the endpoint answered in RECORD[base_url], for the tests to check the
trained tokens against."""

from __future__ import annotations

import asyncio
import json
import os

import anthropic
import httpx
import openai

RECORD: dict[str, dict] = {}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
ASK = {"max_tokens": 6, "logprobs": True, "extra_body": {"return_token_ids": True}}


def items(tok, kinds: list[str]) -> list:
    """One task row per harness kind (fields["kind"], which `dispatch` reads), each its own question."""
    from distflow.tasks.prompts import PromptEncoder, PromptItem

    out = []
    for k, kind in enumerate(kinds):
        messages = [{"role": "user", "content": f"What is {k} + 3?"}]
        ids, text = PromptEncoder(tok)(messages)
        out.append(PromptItem(ids, text, str(k + 3), {"kind": kind}, messages))
    return out


def _client(ctx, **kw):
    return openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, **kw)


def _note(ctx, response, kind="chat"):
    entry = RECORD.setdefault(ctx.base_url, {"kind": kind, "turns": []})
    for choice in response.choices:
        lps = [t.logprob for t in choice.logprobs.content] if kind == "chat" else choice.logprobs.token_logprobs
        entry["turns"].append({"prompt": response.model_extra["prompt_token_ids"],
                               "ids": choice.model_extra["token_ids"], "logprobs": lps})


def _react_step(messages: list[dict], message, observation: str) -> None:
    """Append the model's turn, then the add tool's result for each call it made, or `observation`."""
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        total = args.get("a", 0) + args.get("b", 0)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(total)})
    if not message.tool_calls:
        messages.append({"role": "user", "content": observation})


async def react(ctx):
    """A ReAct-style loop: the add tool offered by function calling; a call is answered with the
    tool's result, a plain answer with an observation, three requests at most."""
    client = _client(ctx)
    messages = list(ctx.messages)
    for _ in range(3):
        r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, **ASK)
        _note(ctx, r)
        _react_step(messages, r.choices[0].message, "Observation: think again.")
    return None


def blocking(ctx):
    """The same with the blocking client, in a plain function."""
    client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = list(ctx.messages)
    for _ in range(2):
        r = client.chat.completions.create(model=ctx.model, messages=messages, **ASK)
        _note(ctx, r)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    return 0.25


def blocking_once(ctx):
    """One request with the blocking client."""
    r = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0).chat.completions.create(
        model=ctx.model, messages=ctx.messages, max_tokens=2)
    return float(len(r.choices[0].message.content) >= 0)


async def branching(ctx):
    """n=4 choices of the first turn, then on from the third."""
    client = _client(ctx)
    r = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, n=4, **ASK)
    _note(ctx, r)
    third = r.choices[2].message.model_dump(exclude_none=True)
    r = await client.chat.completions.create(model=ctx.model, messages=[*ctx.messages, third,
                                                                         {"role": "user", "content": "Go on."}], **ASK)
    _note(ctx, r)


async def slow(ctx):
    """Two requests with 0.3 s of the harness's own work between them (a slow tool)."""
    client = _client(ctx)
    messages = list(ctx.messages)
    for turn in range(2):
        if turn:
            await asyncio.sleep(0.3)
        r = await client.chat.completions.create(model=ctx.model, messages=messages, **ASK)
        _note(ctx, r)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Tool: 7."}]


STOPS = list("aeiou ")  # a random model's turn soon holds one of these


async def stopping(ctx):
    """Two turns ended at stop sequences, the second continuing the first; each answer's text and
    finish reason go to RECORD as well."""
    client = _client(ctx)
    messages = list(ctx.messages)
    for _ in range(2):
        r = await client.chat.completions.create(model=ctx.model, messages=messages, stop=STOPS, **ASK)
        _note(ctx, r)
        entry = RECORD[ctx.base_url]
        entry.setdefault("answers", []).append((r.choices[0].message.content, r.choices[0].finish_reason))
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]


async def editing(ctx):
    """The second request rewrites the model's first turn: a new trajectory."""
    client = _client(ctx)
    r = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ASK)
    _note(ctx, r)
    edited = {"role": "assistant", "content": "(summary of an earlier answer)"}
    r = await client.chat.completions.create(model=ctx.model, messages=[*ctx.messages, edited,
                                                                         {"role": "user", "content": "And?"}], **ASK)
    _note(ctx, r)


async def completion(ctx):
    """Two text completions, the second continuing the first's prompt and answer."""
    client = _client(ctx)
    prompt = "Q: " + ctx.messages[-1]["content"] + "\nA:"
    r = await client.completions.create(model=ctx.model, prompt=prompt, **ASK)
    _note(ctx, r, "completion")
    r = await client.completions.create(model=ctx.model, prompt=prompt + r.choices[0].text + "\nQ: sure?\nA:", **ASK)
    _note(ctx, r, "completion")


async def titled(ctx):
    """An answer, a title for the conversation on the side (kept out by is_title), then on with the answer."""
    client = _client(ctx)
    r = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, **ASK)
    _note(ctx, r)
    answer = r.choices[0].message.model_dump(exclude_none=True)
    title = await client.chat.completions.create(model=ctx.model, messages=[
        {"role": "system", "content": "Title: name this conversation."}, *ctx.messages, answer], **ASK)
    RECORD[ctx.base_url]["title"] = title.choices[0].model_extra["token_ids"]
    r = await client.chat.completions.create(model=ctx.model, messages=[*ctx.messages, answer,
                                                                         {"role": "user", "content": "Go on."}], **ASK)
    _note(ctx, r)


def is_title(request: dict) -> bool:
    """task.agent_exclude for `titled`: a request whose first message asks for a title."""
    return str(request["messages"][0].get("content", "")).startswith("Title:")


async def claude(ctx):
    """Anthropic's client: a system prompt, the add tool, two turns, each answer echoed back as it came."""
    client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
    tools = [{"name": "add", "description": "a + b", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": ctx.messages[-1]["content"]}]
    entry = RECORD.setdefault(ctx.base_url, {"kind": "claude", "turns": []})
    for _ in range(2):
        reply = await client.messages.create(model=ctx.model, max_tokens=6, system="Be brief.", messages=messages,
                                             tools=tools)
        entry["turns"].append(reply.model_dump())
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    try:
        await client.messages.create(model="claude-x", max_tokens=6, messages=messages)
    except anthropic.NotFoundError as e:
        entry["error"] = (e.status_code, e.body["error"]["type"])


async def raises(ctx):
    r = await _client(ctx).chat.completions.create(model=ctx.model, messages=ctx.messages, **ASK)
    _note(ctx, r)
    raise RuntimeError("the harness broke")


async def hangs(ctx):
    r = await _client(ctx).chat.completions.create(model=ctx.model, messages=ctx.messages, **ASK)
    _note(ctx, r)
    await asyncio.sleep(3600)


async def two_turns(ctx):
    """The trainer's harness: two choices of an answer (a branch), an observation after the first,
    another answer; the task's reward scores it."""
    client = _client(ctx)
    messages = list(ctx.messages)
    for n in (2, 1):
        r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8, n=n)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]


async def react_two_choices(ctx):
    """The end-to-end harness: a ReAct loop offering the add tool by function calling (a call is answered
    with the tool's result, a plain answer with an observation), its first request asking for two choices
    (a branch) and going on from the first. With AGENT_RECORD_DIR set, every answer's prompt and token
    ids go to that folder, for the test to hold the trained rows (TrainedRows) against."""
    client = _client(ctx)
    messages = list(ctx.messages)
    for n in (2, 1):
        r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, n=n, max_tokens=8,
                                                 extra_body={"return_token_ids": True})
        _save("answers", [{"prompt": r.model_extra["prompt_token_ids"], "ids": c.model_extra["token_ids"]}
                          for c in r.choices])
        _react_step(messages, r.choices[0].message, "Check it.")


def _save(kind: str, entries: list[dict]) -> None:
    """Append `entries` to AGENT_RECORD_DIR/<kind>.<pid>.jsonl (one write per call: whole lines)."""
    folder = os.environ.get("AGENT_RECORD_DIR")
    if folder:
        with open(os.path.join(folder, f"{kind}.{os.getpid()}.jsonl"), "a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in entries))


class TrainedRows:
    """A run observer (distflow.metrics.timer.PROCESS_OBSERVERS) that saves every row the update trains:
    its prompt and response ids and its response mask."""

    def on_batch(self, step, batch):
        t = batch.tokens
        rows = []
        for i in range(len(t)):
            ids, r = t.input_ids[i][t.attention_mask[i].bool()].tolist(), int(t.resp_len[i])
            rows.append({"step": step, "prompt": ids[:len(ids) - r], "response": ids[len(ids) - r:],
                         "mask": [int(x) for x in t.resp_mask[i, :r].tolist()]})
        _save("rows", rows)
        return batch


if os.environ.get("AGENT_RECORD_DIR"):  # imported by the run (task.agent): watch its batches
    from distflow.metrics.timer import PROCESS_OBSERVERS

    PROCESS_OBSERVERS.append(TrainedRows())


async def silent(ctx):
    return 1.0


async def errors(ctx):
    """Bad requests of every kind; each answer's (status, code) goes to RECORD."""
    seen = RECORD.setdefault(ctx.base_url, {"kind": "errors", "turns": [], "errors": {}})["errors"]
    client = _client(ctx)

    async def attempt(name, call):
        try:
            await call
            seen[name] = (200, None)
        except openai.APIStatusError as e:
            seen[name] = (e.status_code, (e.body or {}).get("code") if isinstance(e.body, dict) else None)

    user = ctx.messages
    await attempt("model", client.chat.completions.create(model="gpt-4o", messages=user))
    await attempt("key", _client(ctx).with_options(api_key="wrong").chat.completions.create(model=ctx.model,
                                                                                            messages=user))
    await attempt("long", client.chat.completions.create(model=ctx.model, messages=[
        {"role": "user", "content": "word " * 400}]))
    await attempt("stream", client.chat.completions.create(model=ctx.model, messages=user, stream=True))
    await attempt("stop", client.chat.completions.create(model=ctx.model, messages=user, stop=["a", ""]))
    await attempt("n", client.chat.completions.create(model=ctx.model, messages=user, n=99))
    await attempt("messages", client.chat.completions.create(model=ctx.model, messages=[{"role": "robot"}]))
    async with httpx.AsyncClient() as raw:
        r = await raw.post(f"{ctx.base_url}/chat/completions", content=b"{not json",
                           headers={"Authorization": f"Bearer {ctx.api_key}"})
        seen["json"] = (r.status_code, r.json()["error"]["code"])
        r = await raw.post(f"{ctx.base_url.rsplit('/e/', 1)[0]}/e/nobody/v1/chat/completions", json={},
                           headers={"Authorization": f"Bearer {ctx.api_key}"})
        seen["episode"] = (r.status_code, r.json()["error"]["code"])
    models = await client.models.list()
    seen["models"] = [m.id for m in models.data]
    for k in range(4):  # rollout.max_turns=3 requests, then 429
        await attempt(f"turn{k}", client.chat.completions.create(model=ctx.model, messages=user, max_tokens=1))


KINDS = {f.__name__: f for f in (react, blocking, blocking_once, branching, editing, completion, titled, claude,
                                  raises, hangs, silent, errors, stopping, slow)}


def dispatch(ctx):
    """The harness the task row names; a coroutine for the async ones (awaited by the runner)."""
    return KINDS[ctx.fields["kind"]](ctx)
