"""Exact tokens for harness conversations (distflow.rollout.agents.trajectories, .messages): a request
that extends a recorded trajectory gets its ids as generated, never re-rendered; an edited history,
other tools or a prompt past the limits start anew or are refused; n > 1 and retries branch at the
shared prefix; completions continue by text or by ids; OpenAI messages and tool calls convert both ways."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from distflow.rollout.agents.messages import (
    BadRequest,
    anthropic_content,
    anthropic_request,
    assistant_turn,
    template_message,
    turn_key,
)
from distflow.rollout.agents.stops import Answer, cut_at_stop, parse_stops
from distflow.rollout.agents.trajectories import TrajectoryBook
from distflow.rollout.episodes import ObservationEncoder
from distflow.sample import Sample
from distflow.tasks.prompts import PromptEncoder


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _book(tok, max_prompt=256, budget=200) -> TrajectoryBook:
    return TrajectoryBook(PromptEncoder(tok), ObservationEncoder(tok), max_prompt, budget,
                          lambda text, first: tok(text, add_special_tokens=first)["input_ids"])


def _spelled(tok, word: str, end: bool = True) -> list[int]:
    """`word` one character per token (and the end-of-turn token): ids that re-encoding the decoded
    text does not give back."""
    ids = [tok.convert_tokens_to_ids(c) for c in word]
    return ids + ([tok.convert_tokens_to_ids("<|im_end|>")] if end else [])


def _turn(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _sample(ids, version=3, truncated=False) -> Sample:
    return Sample([], list(ids), [-0.5 - k / 100 for k in range(len(ids))], truncated, versions=[version] * len(ids))


USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
OBS = {"role": "user", "content": "Observation: 5"}


def test_a_request_that_extends_a_trajectory_continues_its_exact_ids(tok):
    book = _book(tok)
    first = book.prepare(USER, None)
    assert first.base is None and first.context == PromptEncoder(tok)(USER)[0]
    said = _spelled(tok, "hello")
    assert tok.encode("hello", add_special_tokens=False) != said[:-1]  # the text does not round-trip
    book.record(first, [(_sample(said), _turn("hello"))], version=3)
    # the harness echoes the turn as the client returned it (extra fields, null ones) and adds a message
    echoed = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None}
    messages = [template_message(m, f"m{i}") for i, m in enumerate([*USER, echoed, OBS])]
    second = book.prepare(messages, None)
    observation = ObservationEncoder(tok)([OBS], said[-1])
    assert second.base is book.main and second.context == first.context + said + observation
    assert second.context != PromptEncoder(tok)(messages)[0]  # what re-rendering would have trained
    book.record(second, [(_sample(_spelled(tok, "ok"), version=4), _turn("ok"))], version=4)
    s = book.main.sample(cut=False)
    assert s.prompt_ids == first.context and s.response_ids == said + observation + _spelled(tok, "ok")
    assert s.mask == [1] * len(said) + [0] * len(observation) + [1] * 3
    assert s.logprobs[len(said):len(said) + len(observation)] == [0.0] * len(observation)
    assert s.versions == [3] * len(said) + [3] * len(observation) + [4] * 3  # an observation: its turn's
    assert [m["role"] for m in s.episode.transcript] == ["assistant", "user", "assistant"]
    assert s.episode.final_text == "ok" and s.episode.turns == 2 and not s.truncated
    assert len(book.trajectories) == 1 and book.restarts == 0


def test_a_turn_cut_at_its_limit_is_closed_by_the_template(tok):
    book = _book(tok)
    first = book.prepare(USER, None)
    cut = _spelled(tok, "hel", end=False)
    book.record(first, [(_sample(cut, truncated=True), _turn("hel"))], version=0)
    second = book.prepare([*USER, _turn("hel"), OBS], None)
    assert second.observation == ObservationEncoder(tok)([OBS], None)  # the end-of-turn is the template's
    assert second.observation[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert book.main.sample(cut=False).truncated


def test_a_stop_sequence_cuts_after_the_token_that_completes_it(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    said = _spelled(tok, "hello")
    sample = _sample(said)
    assert cut_at_stop(sample, ["xyz"], decode) == Answer(sample, "hello")
    # the earliest of the sequences, across two tokens: the text before it, the ids through its last token
    answer = cut_at_stop(sample, ["lo", "el"], decode)
    assert (answer.text, answer.stop, answer.sample.response_ids) == ("h", "el", said[:3])
    assert answer.sample.logprobs == sample.logprobs[:3] and answer.sample.versions == [3] * 3
    assert not answer.sample.truncated
    with pytest.raises(BadRequest, match="stop must be"):
        parse_stops(["a", ""], "stop")
    assert parse_stops("\n", "stop") == ["\n"] and parse_stops(None, "stop") == []
    # the cut turn is open: the next request's messages close it through the template, and the row
    # is not truncated (it did not reach its token limit)
    book = _book(tok)
    first = book.prepare(USER, None)
    book.record(first, [(answer.sample, _turn("h"))], version=0, stopped=[True])
    second = book.prepare([*USER, _turn("h"), OBS], None)
    assert second.observation == ObservationEncoder(tok)([OBS], None)
    assert second.observation[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert not book.main.sample(cut=False).truncated


def test_edited_history_and_other_tools_start_new_trajectories(tok):
    book = _book(tok)
    first = book.prepare(USER, None)
    book.record(first, [(_sample(_spelled(tok, "hi")), _turn("hi"))], version=0)
    edited = [*USER, _turn("hi there"), OBS]  # the harness rewrote the model's turn
    second = book.prepare(edited, None)
    assert second.base is None and second.context == PromptEncoder(tok)(edited)[0] and book.restarts == 1
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    third = book.prepare([*USER, _turn("hi"), OBS], tools)
    assert third.base is None and book.restarts == 2
    # a trajectory that started with tools continues with the same tools only
    book.record(third, [(_sample(_spelled(tok, "x")), _turn("x"))], version=0)
    assert book.prepare([*USER, _turn("hi"), OBS, _turn("x"), OBS], tools).base is book.main


def test_n_choices_and_a_retried_turn_branch_at_the_shared_prefix(tok):
    book = _book(tok)
    first = book.prepare(USER, None)
    a, b = _spelled(tok, "ab"), _spelled(tok, "cd")
    made = book.record(first, [(_sample(a), _turn("ab")), (_sample(b), _turn("cd"))], version=0)
    assert len(made) == 2 and book.main is made[0] and len(book.trajectories) == 2
    # the harness goes on from the second choice: it extends that branch, exactly
    on_b = book.prepare([*USER, _turn("cd"), OBS], None)
    assert on_b.base is made[1] and on_b.context[:len(first.context) + len(b)] == first.context + b
    # two requests extend the same trajectory before either is answered: the second one forks
    on_a1, on_a2 = (book.prepare([*USER, _turn("ab"), {"role": "user", "content": w}], None) for w in ("x", "y"))
    book.record(on_a1, [(_sample(_spelled(tok, "1")), _turn("1"))], version=0)
    book.record(on_a2, [(_sample(_spelled(tok, "2")), _turn("2"))], version=0)
    assert book.main is not made[0] and len(book.trajectories) == 3 and book.restarts == 0
    assert book.main.context[:len(on_a2.context)] == on_a2.context
    assert made[0].context[:len(on_a1.context)] == on_a1.context
    # each trajectory trains the tokens it generated itself; what it shares with its parent is its row's
    # prompt: the choices share the first request's, the retry its own request's (observation included)
    rows = [t.row(cut=False) for t in book.trajectories]
    assert [r.prompt_ids for r in rows] == [first.context, first.context, on_a2.context]
    one, two = _spelled(tok, "1"), _spelled(tok, "2")
    assert [[t for t, m in zip(r.response_ids, r.mask) if m] for r in rows] == [a + one, b, two]
    assert rows[2].response_ids == two and rows[2].versions == [3] * len(two)
    for t, r in zip(book.trajectories, rows):  # a row's prompt and response are its trajectory's tokens
        assert r.prompt_ids + r.response_ids == t.context and r.mask == t.mask[t.own_from:]


def test_contexts_past_the_limits_are_refused(tok):
    book = _book(tok, max_prompt=8, budget=12)
    with pytest.raises(BadRequest, match=r"^context_length_exceeded: .* rollout.max_prompt_tokens=8"):
        book.prepare(USER, None)
    book = _book(tok, budget=12)
    first = book.prepare(USER, None)
    book.record(first, [(_sample(_spelled(tok, "hello")), _turn("hello"))], version=0)
    with pytest.raises(BadRequest, match=r"^context_length_exceeded: .* rollout.max_total_tokens=12"):
        book.prepare([*USER, _turn("hello"), OBS], None)


def test_completions_continue_by_text_or_by_ids(tok):
    book = _book(tok)
    first = book.prepare_text("Q: 2 + 3 =")
    assert first.context == tok("Q: 2 + 3 =")["input_ids"]
    said = _spelled(tok, " 5", end=False)
    book.record(first, [(_sample(said), _turn(" 5"))], version=0)
    second = book.prepare_text("Q: 2 + 3 = 5\nQ: 1 + 1 =")
    assert second.base is book.main and second.context == first.context + said + tok("\nQ: 1 + 1 =",
                                                                                     add_special_tokens=False)["input_ids"]
    by_ids = book.prepare_text(first.context + said + [5, 6])
    assert by_ids.base is book.main and by_ids.context == first.context + said + [5, 6]
    assert book.prepare(USER, None).base is None  # a chat request never extends a completion


def test_openai_messages_and_tool_calls_convert_both_ways():
    api, template = assistant_turn('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                                   True, "call-7")
    assert api["content"] == "Let me add." and api["tool_calls"][0]["id"] == "call-7-0"
    assert json.loads(api["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    # what the client sends back (arguments as a JSON string) is the same turn as what was recorded
    assert turn_key(template_message(api, "m")) == turn_key(template)
    assert template["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}  # what templates read
    # without tools offered, or with a block that does not parse, the text stays the content
    assert assistant_turn("<tool_call>{bad</tool_call>", True, "c")[0] == {"role": "assistant",
                                                                           "content": "<tool_call>{bad</tool_call>"}
    assert "tool_calls" not in assistant_turn('<tool_call>{"name": "add"}</tool_call>', False, "c")[0]
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts, "m")["content"] == "ab"
    assert template_message({"role": "developer", "content": "x"}, "m")["role"] == "system"
    for bad, words in [({"role": "user", "content": [{"type": "image_url"}]}, "only text content parts"),
                       ({"role": "robot", "content": "x"}, "role must be one of"),
                       ({"role": "user", "content": "x", "tool_calls": [{}]}, "only an assistant message"),
                       ({"role": "assistant", "content": None,
                         "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "not valid JSON")]:
        with pytest.raises(BadRequest, match=words):
            template_message(bad, "messages[1]")


def test_anthropic_messages_convert_both_ways():
    api, template = assistant_turn('Adding. <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', True, "c")
    blocks = anthropic_content(api)
    assert blocks == [{"type": "text", "text": "Adding."}, {"type": "tool_use", "id": "c-0", "name": "add",
                                                            "input": {"a": 2}}]
    body = {"system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": blocks},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c-0", "content": "5"},
                                                      {"type": "text", "text": "So?"}]}],
            "tools": [{"name": "add", "description": "a + b", "input_schema": {"type": "object"}}]}
    messages, tools = anthropic_request(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert turn_key(messages[2]) == turn_key(template)  # the echoed turn is the recorded one
    assert messages[3] == {"role": "tool", "tool_call_id": "c-0", "content": "5"}
    assert tools == [{"type": "function", "function": {"name": "add", "description": "a + b",
                                                       "parameters": {"type": "object"}}}]
    assert anthropic_content(assistant_turn("", False, "c")[0]) == [{"type": "text", "text": ""}]
    for bad, words in [({"messages": []}, "non-empty list"),
                       ({"messages": [{"role": "system", "content": "x"}]}, "user or assistant"),
                       ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image' block"),
                       ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]},
                        "'tool_use' block is not supported in a user turn")]:
        with pytest.raises(BadRequest, match=words):
            anthropic_request(bad)
