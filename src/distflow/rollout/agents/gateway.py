"""The endpoint's side of harness episodes: what a request means. Its validation and limits, its
tokens (the episode's TrajectoryBook), its hand-over to the rank's main thread (a `Submission` on
a queue; distflow.rollout.agents.episodes steps the engine), and its answer in OpenAI's or
Anthropic's format. The routes (distflow.rollout.agents.endpoint) call it from uvicorn's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from distflow.config import ConfigError, DistflowConfig
from distflow.rollout.agents.endpoint import ApiError
from distflow.rollout.agents.messages import (
    BadRequest,
    anthropic_content,
    anthropic_request,
    assistant_turn,
    template_message,
)
from distflow.rollout.agents.stops import Answer, cut_at_stop, parse_stops
from distflow.rollout.agents.trajectories import TrajectoryBook
from distflow.rollout.base import Request
from distflow.rollout.episodes import ObservationEncoder
from distflow.sample import Sample
from distflow.seeds import derive_seed
from distflow.tasks.prompts import PromptEncoder

log = logging.getLogger("distflow")
MAX_N = 16  # choices per request


@dataclasses.dataclass
class Episode:
    key: str
    order: int  # its place in the round
    seed: int
    book: TrajectoryBook
    busy_s: float = 0.0  # the harness's own time: running with no request out
    requests: int = 0
    excluded: int = 0  # requests task.agent_exclude kept out of the trajectories
    closed: bool = False
    cut: bool = False
    failed: bool = False
    reward: float = 0.0
    harness: concurrent.futures.Future | None = None


@dataclasses.dataclass
class Submission:
    episode: Episode
    number: int  # the episode's request count
    request: Request
    future: concurrent.futures.Future


class Gateway:
    """What the endpoint's routes call: a request's validation, tokens and limits, its submission to
    the main thread, and its answer in OpenAI's format."""

    def __init__(self, tokenizer, cfg: DistflowConfig, exclude: Callable | None = None):
        self.tokenizer, self.rollout, self.agent, self.exclude = tokenizer, cfg.rollout, cfg.agent, exclude
        self.model_name = cfg.agent.served_model_name
        self.encode_prompt, self.encode_observation = PromptEncoder(tokenizer), ObservationEncoder(tokenizer)
        self.episodes: dict[str, Episode] = {}
        self.lock = threading.Lock()  # episodes and their books: the routes' thread and the main thread
        self.submissions: queue.Queue[Submission] = queue.Queue()
        self.greedy = False
        self.version = 0  # the engine's, for the records of observation tokens
        self._warned: set[str] = set()

    def book(self) -> TrajectoryBook:
        return TrajectoryBook(self.encode_prompt, self.encode_observation, self.rollout.max_prompt_tokens,
                              self.rollout.response_budget(), self.encode_text)

    def encode_text(self, text: str, first: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    # ------------------------------------------------------------------ the routes
    async def chat(self, key: str, body: dict) -> dict:
        """OpenAI's Chat Completions."""
        episode = self._episode(key)
        self._check_request(body)
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise ApiError(400, "messages must be a non-empty list", "invalid_messages")
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "tools must be a list of {type: function, function: {...}} objects", "invalid_tools")
        try:
            messages = [template_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
        except BadRequest as e:
            raise ApiError(400, str(e), "invalid_messages") from None
        stops = self._stops(body, "stop")
        answers, prepared, number, apis = await self._converse(episode, body, messages, tools, stops)
        choices = []
        for i, (a, api) in enumerate(zip(answers, apis)):
            finish = "length" if a.sample.truncated else ("tool_calls" if "tool_calls" in api else "stop")
            choices.append({"index": i, "message": api, "finish_reason": finish, **self._extras(body, a.sample)})
        return self._answer("chat.completion", key, number, prepared.context, answers, choices, body)

    async def messages(self, key: str, body: dict) -> dict:
        """Anthropic's Messages (one answer per request; its tool_use and tool_result blocks)."""
        episode = self._episode(key)
        self._check_request(body)
        stops = self._stops(body, "stop_sequences")
        try:
            messages, tools = anthropic_request(body)
        except BadRequest as e:
            raise ApiError(400, str(e), "invalid_messages") from None
        answers, prepared, number, apis = await self._converse(episode, {**body, "n": 1}, messages, tools, stops)
        a, api = answers[0], apis[0]
        stop = "max_tokens" if a.sample.truncated else "stop_sequence" if a.stop is not None else \
            "tool_use" if "tool_calls" in api else "end_turn"
        return {"id": f"msg_{key}_{number}", "type": "message", "role": "assistant", "model": self.model_name,
                "content": anthropic_content(api), "stop_reason": stop, "stop_sequence": a.stop,
                "usage": {"input_tokens": len(prepared.context), "output_tokens": len(a.sample.response_ids)}}

    async def _converse(self, episode: Episode, body: dict, messages: list[dict], tools: list[dict] | None,
                        stops: list[str]):
        """A chat request's engine answer, recorded in the episode's trajectories (unless the user's
        filter keeps it apart): (answers, prepared, the request's number, each answer as OpenAI's message)."""
        apart = self._excluded(body)
        book = episode.book
        answers, prepared, number = await self._generate(
            episode, body, (lambda: book.apart(messages, tools)) if apart else (lambda: book.prepare(messages, tools)),
            stops)
        apis, turns = [], []
        for i, a in enumerate(answers):
            api, turn = assistant_turn(a.text, tools is not None, f"call-{episode.key}-{number}-{i}")
            apis.append(api)
            turns.append((a.sample, turn))
        with self.lock:
            if episode.closed:
                pass
            elif apart:
                episode.excluded += 1
            else:
                book.record(prepared, turns, self.version, [a.stop is not None for a in answers])
        return answers, prepared, number, apis

    async def complete(self, key: str, body: dict) -> dict:
        episode = self._episode(key)
        self._check_request(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list, as clients send it
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                           "invalid_prompt")
        stops = self._stops(body, "stop")
        answers, prepared, number = await self._generate(episode, body, lambda: episode.book.prepare_text(prompt),
                                                         stops)
        choices, turns = [], []
        for i, a in enumerate(answers):
            turns.append((a.sample, {"role": "assistant", "content": a.text}))
            choices.append({"index": i, "text": a.text, "finish_reason": "length" if a.sample.truncated else "stop",
                            **self._extras(body, a.sample, completion=True)})
        with self.lock:
            if not episode.closed:
                episode.book.record(prepared, turns, self.version, [a.stop is not None for a in answers])
        return self._answer("text_completion", key, number, prepared.context, answers, choices, body)

    # ------------------------------------------------------------------ one request
    def _excluded(self, body: dict) -> bool:
        """task.agent_exclude's verdict on a chat request (a failure of the filter is the request's 400)."""
        if self.exclude is None:
            return False
        try:
            return bool(self.exclude(body))
        except Exception as e:  # noqa: BLE001 - the user's filter: its failure is this request's error
            raise ApiError(400, f"task.agent_exclude raised on this request: {type(e).__name__}: {e}",
                           "exclude_failed") from None

    def _episode(self, key: str) -> Episode:
        with self.lock:
            episode = self.episodes.get(key)
        if episode is None:
            raise ApiError(404, f"no episode {key!r} is running on this endpoint", "episode_not_found")
        if episode.closed:
            raise ApiError(410, f"episode {key!r} is over ({'cut' if episode.cut else 'ended'})", "episode_over")
        return episode

    def _check_request(self, body: dict) -> None:
        if body.get("model") != self.model_name:
            raise ApiError(404, f"the model {body.get('model')!r} does not exist; this endpoint serves "
                                f"{self.model_name!r}", "model_not_found")
        if body.get("stream"):
            raise ApiError(400, "stream=true is not supported; ask without streaming", "unsupported")
        for name in ("temperature", "top_p"):
            asked, runs = body.get(name), getattr(self.rollout, name, None)
            if asked is not None and runs is not None and asked != runs and name not in self._warned:
                self._warned.add(name)
                log.warning(f"an agent request asked {name}={asked}; the policy samples at rollout.{name}={runs}, "
                            "as training needs (logged once)")

    def _stops(self, body: dict, key: str) -> list[str]:
        try:
            return parse_stops(body.get(key), key)
        except BadRequest as e:
            raise ApiError(400, str(e), "invalid_stop") from None

    async def _generate(self, episode: Episode, body: dict, prepare, stops: list[str]) -> tuple[list[Answer], Any, int]:
        n, limit = body.get("n") or 1, body.get("max_completion_tokens") or body.get("max_tokens")
        if not (isinstance(n, int) and 1 <= n <= MAX_N):
            raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n!r}", "invalid_n")
        if limit is not None and not (isinstance(limit, int) and limit >= 1):
            raise ApiError(400, f"max_tokens must be a positive integer, got {limit!r}", "invalid_max_tokens")
        with self.lock:
            if episode.requests >= self.rollout.max_turns:
                raise ApiError(429, f"the episode made its rollout.max_turns={self.rollout.max_turns} requests",
                               "request_limit", "rate_limit_error")
            try:
                prepared = prepare()
            except BadRequest as e:
                code = "context_length_exceeded" if str(e).startswith("context_length_exceeded") else "invalid_request"
                raise ApiError(400, str(e), code) from None
            except ConfigError as e:  # the chat template refused the messages
                raise ApiError(400, str(e), "invalid_messages") from None
            episode.requests += 1
            number = episode.requests
        tokens = min(limit or self.rollout.max_new_tokens, self.rollout.max_new_tokens, episode.book.room(prepared))
        request = Request(f"{episode.key}-{number}", list(prepared.context), n, derive_seed(episode.seed, number),
                          max_tokens=tokens, greedy=self.greedy)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.submissions.put(Submission(episode, number, request, future))
        samples = await asyncio.wrap_future(future)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return [cut_at_stop(s, stops, decode) for s in samples], prepared, number

    def _extras(self, body: dict, s: Sample, completion: bool = False) -> dict:
        out: dict = {"token_ids": list(s.response_ids)} if body.get("return_token_ids") else {}
        if body.get("logprobs"):
            tokens = self.tokenizer.convert_ids_to_tokens(s.response_ids)
            if completion:
                out["logprobs"] = {"tokens": tokens, "token_logprobs": list(s.logprobs), "top_logprobs": None,
                                   "text_offset": None}
            else:
                out["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                                "top_logprobs": []} for t, lp in zip(tokens, s.logprobs)],
                                   "refusal": None}
        else:
            out["logprobs"] = None
        return out

    def _answer(self, kind: str, key: str, number: int, context: list[int], answers: list[Answer], choices: list,
                body: dict) -> dict:
        generated = sum(len(a.sample.response_ids) for a in answers)
        out = {"id": f"{key}-{number}", "object": kind, "created": int(time.time()), "model": self.model_name,
               "choices": choices,
               "usage": {"prompt_tokens": len(context), "completion_tokens": generated,
                         "total_tokens": len(context) + generated}}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = list(context)
        return out
