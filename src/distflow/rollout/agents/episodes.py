"""Harness episodes on one rank: the user's agent code runs against the rank's endpoint, and its
requests are batched into the rank's step-wise engine.

    runner = AgentRunner(engine, tokenizer, cfg, task.harness, local_rank)   # task.agent set
    groups = runner.run(items, n, seeds)                       # [len(items)][n] Samples

Three threads meet here. The harness's coroutines run on their own event loop (a harness written
with blocking calls runs in that loop's thread pool); the endpoint's routes run on uvicorn's
(distflow.rollout.agents.endpoint); the rank's main thread owns the engine. A request becomes a
`Submission` on a queue; the main thread submits it to the engine, steps the engine while
anything runs, and resolves each request's future when its samples finish, so the requests of
all the rank's episodes batch together, as many as the harnesses keep open.

An episode ends when its harness returns (a number is its reward, added to what the task's
reward functions give the final answer, as an environment's step rewards are; None leaves the
reward to them), raises (counted as failed), or spends more than agent.episode_timeout_s of its
own time, time with no request out (cut: the harness is cancelled and its later requests refused;
the time its requests wait for the engine is not its own). Every episode yields one training
row: the trajectory of its last request (distflow.rollout.agents.trajectories), or an empty
response when the harness never asked anything. Nothing an episode does stops the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import queue
import secrets
import threading
import time
from typing import Any, Callable

from distflow.rollout.agents.endpoint import ApiError, Endpoint, build_app
from distflow.rollout.agents.messages import (
    BadRequest,
    anthropic_content,
    anthropic_request,
    assistant_turn,
    template_message,
)
from distflow.rollout.agents.trajectories import TrajectoryBook
from distflow.config import ConfigError, DistflowConfig
from distflow.rollout.base import Request
from distflow.rollout.episodes import ObservationEncoder
from distflow.sample import EpisodeInfo, Sample
from distflow.seeds import derive_seed
from distflow.tasks.prompts import PromptEncoder, PromptItem

log = logging.getLogger("distflow")
MAX_N = 16  # choices per request


@dataclasses.dataclass(frozen=True)
class AgentContext:
    """What a harness gets for one episode: where to send its requests (`openai.AsyncOpenAI(
    base_url=ctx.base_url, api_key=ctx.api_key)`, model=ctx.model), the task row, and a seed for
    its own randomness."""

    base_url: str
    api_key: str
    model: str
    messages: list[dict]  # the row's prompt as chat messages (the task's system prompt included)
    answer: Any  # the row's reference answer
    fields: dict  # the row's other fields
    seed: int
    index: int  # the episode's place in its group

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for Anthropic's client (`anthropic.AsyncAnthropic(base_url=..., api_key=...)`),
        which adds /v1/messages itself."""
        return self.base_url.removesuffix("/v1")


@dataclasses.dataclass
class _Episode:
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
class _Submission:
    episode: _Episode
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
        self.episodes: dict[str, _Episode] = {}
        self.lock = threading.Lock()  # episodes and their books: the routes' thread and the main thread
        self.submissions: queue.Queue[_Submission] = queue.Queue()
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
        samples, prepared, number, answers = await self._converse(episode, body, messages, tools)
        choices = []
        for i, (s, api) in enumerate(zip(samples, answers)):
            finish = "length" if s.truncated else ("tool_calls" if "tool_calls" in api else "stop")
            choices.append({"index": i, "message": api, "finish_reason": finish, **self._extras(body, s)})
        return self._answer("chat.completion", key, number, prepared.context, samples, choices, body)

    async def messages(self, key: str, body: dict) -> dict:
        """Anthropic's Messages (one answer per request; its tool_use and tool_result blocks)."""
        episode = self._episode(key)
        self._check_request(body)
        if body.get("stop_sequences"):
            raise ApiError(400, "stop_sequences are not supported: a turn ends at the model's end-of-turn token or "
                                "max_tokens", "unsupported")
        try:
            messages, tools = anthropic_request(body)
        except BadRequest as e:
            raise ApiError(400, str(e), "invalid_messages") from None
        samples, prepared, number, answers = await self._converse(episode, {**body, "n": 1}, messages, tools)
        s, api = samples[0], answers[0]
        stop = "max_tokens" if s.truncated else ("tool_use" if "tool_calls" in api else "end_turn")
        return {"id": f"msg_{key}_{number}", "type": "message", "role": "assistant", "model": self.model_name,
                "content": anthropic_content(api), "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": len(prepared.context), "output_tokens": len(s.response_ids)}}

    async def _converse(self, episode: _Episode, body: dict, messages: list[dict], tools: list[dict] | None):
        """A chat request's engine answer, recorded in the episode's trajectories (unless the user's
        filter keeps it apart): (samples, prepared, the request's number, each answer as OpenAI's message)."""
        apart = self._excluded(body)
        book = episode.book
        samples, prepared, number = await self._generate(
            episode, body, (lambda: book.apart(messages, tools)) if apart else (lambda: book.prepare(messages, tools)))
        answers, turns = [], []
        for i, s in enumerate(samples):
            api, turn = assistant_turn(self.tokenizer.decode(s.response_ids, skip_special_tokens=True),
                                       tools is not None, f"call-{episode.key}-{number}-{i}")
            answers.append(api)
            turns.append((s, turn))
        with self.lock:
            if episode.closed:
                pass
            elif apart:
                episode.excluded += 1
            else:
                book.record(prepared, turns, self.version)
        return samples, prepared, number, answers

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
        samples, prepared, number = await self._generate(episode, body, lambda: episode.book.prepare_text(prompt))
        choices, turns = [], []
        for i, s in enumerate(samples):
            text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            turns.append((s, {"role": "assistant", "content": text}))
            choices.append({"index": i, "text": text, "finish_reason": "length" if s.truncated else "stop",
                            **self._extras(body, s, completion=True)})
        with self.lock:
            if not episode.closed:
                episode.book.record(prepared, turns, self.version)
        return self._answer("text_completion", key, number, prepared.context, samples, choices, body)

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

    def _episode(self, key: str) -> _Episode:
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
        if body.get("stop"):
            raise ApiError(400, "stop sequences are not supported: a turn ends at the model's end-of-turn token "
                                "or max_tokens", "unsupported")
        for name in ("temperature", "top_p"):
            asked, runs = body.get(name), getattr(self.rollout, name, None)
            if asked is not None and runs is not None and asked != runs and name not in self._warned:
                self._warned.add(name)
                log.warning(f"an agent request asked {name}={asked}; the policy samples at rollout.{name}={runs}, "
                            "as training needs (logged once)")

    async def _generate(self, episode: _Episode, body: dict, prepare) -> tuple[list[Sample], Any, int]:
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
        self.submissions.put(_Submission(episode, number, request, future))
        samples = await asyncio.wrap_future(future)
        return samples, prepared, number

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

    def _answer(self, kind: str, key: str, number: int, context: list[int], samples: list[Sample], choices: list,
                body: dict) -> dict:
        generated = sum(len(s.response_ids) for s in samples)
        out = {"id": f"{key}-{number}", "object": kind, "created": int(time.time()), "model": self.model_name,
               "choices": choices,
               "usage": {"prompt_tokens": len(context), "completion_tokens": generated,
                         "total_tokens": len(context) + generated}}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = list(context)
        return out


class AgentRunner:
    """task.agent's episodes on one rank, with the rank's endpoint (see the module docstring)."""

    def __init__(self, engine, tokenizer, cfg: DistflowConfig, harness: Callable, local_rank: int = 0,
                 exclude: Callable | None = None):
        """`harness`, `exclude`: task.agent's and task.agent_exclude's functions (resolved with the task,
        distflow.tasks.Task)."""
        self.engine, self.cfg, self.harness = engine, cfg, harness
        self.gateway = Gateway(tokenizer, cfg, exclude)
        self.api_key = secrets.token_urlsafe(24)
        port = cfg.agent.port + local_rank if cfg.agent.port else 0
        self.endpoint = Endpoint(build_app(self.gateway, self.api_key), cfg.agent.host, port)
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="distflow-harness")
        self.loop.set_default_executor(self.pool)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="distflow-harness-loop")
        self.thread.start()
        self.counter = 0
        self._warned: set[str] = set()
        log.info(f"agent endpoint on {self.endpoint.url} (OpenAI-compatible; model {cfg.agent.served_model_name!r})")

    def run(self, items: list[PromptItem], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        g = self.gateway
        g.greedy, g.version = greedy, self.engine.version
        episodes = []
        for i, item in enumerate(items):
            for j in range(n):
                self.counter += 1
                ep = _Episode(f"{self.counter}", len(episodes), derive_seed(seeds[i], j), g.book())
                with g.lock:
                    g.episodes[ep.key] = ep
                ep.harness = asyncio.run_coroutine_threadsafe(self._call(self._context(ep, item, j)), self.loop)
                episodes.append(ep)
        self._pump(episodes)
        with g.lock:
            for ep in episodes:
                ep.closed = True
                del g.episodes[ep.key]
        samples = [self._sample(ep, item) for ep, item in zip(episodes, (it for it in items for _ in range(n)))]
        return [samples[i * n:(i + 1) * n] for i in range(len(items))]

    # ------------------------------------------------------------------ the main thread's loop
    def _pump(self, episodes: list[_Episode]) -> None:
        """Engine requests in, finished samples out, until every harness has returned or been cut.
        With agent.wait=wave the engine steps only while every running episode has a request out;
        the requests that arrived since the last step then join in (episode, request) order."""
        inflight: dict[str, _Submission] = {}
        held: list[_Submission] = []
        incoming, wave = self.gateway.submissions, self.cfg.agent.wait == "wave"
        limit, last = self.cfg.agent.episode_timeout_s, time.monotonic()
        while True:
            while not incoming.empty():
                held.append(incoming.get_nowait())
            out = {id(s.episode) for s in held} | {id(s.episode) for s in inflight.values()}
            now = time.monotonic()
            elapsed, last = now - last, now
            for ep in episodes:  # charge each harness its own time; cut one past its limit
                if not ep.harness.done() and id(ep) not in out:
                    ep.busy_s += elapsed
                    if ep.busy_s > limit:
                        self._cut(ep)
            live = [ep for ep in episodes if not ep.harness.done()]
            release = not wave or all(id(ep) in out for ep in live)
            if release and held:
                for sub in sorted(held, key=lambda s: (s.episode.order, s.number)):
                    self._take(sub, inflight)
                held = []
            if not inflight and not held and not live and incoming.empty():
                return
            if release and self.engine.pending():
                for request_id, samples in self.engine.step():
                    inflight.pop(request_id).future.set_result(samples)
            else:  # a harness is working (tools, its own logic): wait for a request, a return or a deadline
                try:
                    held.append(incoming.get(timeout=0.005))
                except queue.Empty:
                    pass

    def _take(self, sub: _Submission, inflight: dict[str, _Submission]) -> None:
        if sub.episode.closed:  # a cut episode's harness asked again
            sub.future.set_exception(ApiError(410, "the episode is over", "episode_over"))
            return
        self.engine.submit(sub.request)
        inflight[sub.request.request_id] = sub

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(" ".join(message.split()))

    def _cut(self, ep: _Episode) -> None:
        """End an episode whose harness ran past its own time. It has no request out (time waiting for
        the engine is not its own), so nothing runs in the engine for it; later requests get 410."""
        self._warn_once("cut", f"agent episode {ep.key}: the harness ran past agent.episode_timeout_s="
                               f"{self.cfg.agent.episode_timeout_s} of its own time; cut, its turns kept as a "
                               "truncated sample (logged once, later ones only counted in agent/cut)")
        with self.gateway.lock:
            ep.closed = ep.cut = True
        ep.harness.cancel()

    # ------------------------------------------------------------------ the harness's side
    def _context(self, ep: _Episode, item: PromptItem, index: int) -> AgentContext:
        messages = [dict(m) for m in item.messages] or [{"role": "user", "content": item.prompt_text}]
        return AgentContext(f"{self.endpoint.url}/e/{ep.key}/v1", self.api_key, self.cfg.agent.served_model_name,
                            messages, item.answer, dict(item.fields), ep.seed, index)

    async def _call(self, ctx: AgentContext):
        """The harness's result: a coroutine function awaited on the loop, any other function run in
        the loop's thread pool (blocking clients welcome), and what it returns awaited if awaitable."""
        if inspect.iscoroutinefunction(self.harness):
            return await self.harness(ctx)
        result = await asyncio.get_running_loop().run_in_executor(None, self.harness, ctx)
        return await result if inspect.isawaitable(result) else result

    def _sample(self, ep: _Episode, item: PromptItem) -> Sample:
        """The episode's training row, with how it went."""
        if not ep.cut:
            try:
                result = ep.harness.result(timeout=0)
                if result is not None and not (isinstance(result, (int, float)) and math.isfinite(result)):
                    raise TypeError(f"the harness returned {result!r}, not a finite number or None")
                ep.reward = float(result or 0.0)
            except Exception as e:  # noqa: BLE001 - the harness's own failure ends only its episode
                ep.failed = True
                self._warn_once("failed", f"agent episode {ep.key}: the harness failed: {type(e).__name__}: {e}; its "
                                          "turns are kept (logged once, later ones only counted in agent/failed)")
        book = ep.book
        if book.main is None:  # no request was answered: an empty response
            sample = Sample(list(item.prompt_ids), [], [], ep.cut, [], EpisodeInfo(), [])
        else:
            sample = book.main.sample(cut=ep.cut)
        info = sample.episode
        info.env_reward, info.requests, info.restarts, info.excluded = ep.reward, ep.requests, book.restarts, \
            ep.excluded
        info.branches, info.cut, info.failed = len(book.trajectories) - 1 - book.restarts if book.trajectories else 0, \
            ep.cut, ep.failed
        return sample

    def close(self) -> None:
        self.endpoint.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.pool.shutdown(wait=False, cancel_futures=True)
