"""Harness episodes on one rank: the user's agent code runs against the rank's endpoint, and its
requests are batched into the rank's step-wise engine.

    runner = AgentRunner(engine, tokenizer, cfg, task.harness, local_rank)   # task.agent set
    groups = runner.run(items, n, seeds)                       # [len(items)][n] Samples

Three threads meet here. The harness's coroutines run on their own event loop (a harness written
with blocking calls runs in a thread of its own); the endpoint's routes run on uvicorn's
(distflow.rollout.agents.endpoint, .gateway); the rank's main thread owns the engine. A request becomes a
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

from distflow.config import DistflowConfig
from distflow.rollout.agents.endpoint import ApiError, Endpoint, build_app
from distflow.rollout.agents.gateway import Episode, Gateway, Submission
from distflow.rollout.base import step_unless
from distflow.sample import EpisodeInfo, Sample
from distflow.seeds import derive_seed
from distflow.tasks.prompts import PromptItem

log = logging.getLogger("distflow")


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
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # a round's blocking harnesses
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="distflow-harness-loop")
        self.thread.start()
        self.counter = 0
        self._warned: set[str] = set()
        log.info(f"agent endpoint on {self.endpoint.url} (OpenAI-compatible; model {cfg.agent.served_model_name!r})")

    def run(self, items: list[PromptItem], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        g = self.gateway
        g.greedy, g.version = greedy, self.engine.version
        # a thread for every blocking harness of the round: with fewer, one not yet started would hold
        # the engine's wave (it has no request out) while the started ones wait on the engine
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(items) * n),
                                                          thread_name_prefix="distflow-harness")
        episodes = []
        for i, item in enumerate(items):
            for j in range(n):
                self.counter += 1
                ep = Episode(f"{self.counter}", len(episodes), derive_seed(seeds[i], j), g.book())
                with g.lock:
                    g.episodes[ep.key] = ep
                ep.harness = asyncio.run_coroutine_threadsafe(self._call(self._context(ep, item, j)), self.loop)
                episodes.append(ep)
        self._pump(episodes)
        self.pool.shutdown(wait=False)  # a cut blocking harness keeps its thread until it returns
        with g.lock:
            for ep in episodes:
                ep.closed = True
                del g.episodes[ep.key]
        samples = [self._sample(ep, item) for ep, item in zip(episodes, (it for it in items for _ in range(n)))]
        return [samples[i * n:(i + 1) * n] for i in range(len(items))]

    # ------------------------------------------------------------------ the main thread's loop
    def _pump(self, episodes: list[Episode]) -> None:
        """Engine requests in, finished samples out, until every harness has returned or been cut.
        With agent.wait=wave the engine steps only while every running episode has a request out;
        the requests that arrived since the last step then join in (episode, request) order.

        A tensor-parallel engine group (distflow.rollout.engine_group) steps as one: each rank joins
        a step once its own wave is ready (its running episodes all have a request out), so the
        group steps once every rank's is, and a rank whose episodes are over keeps joining, with
        its stop flag, until every rank's are."""
        grouped = hasattr(self.engine, "step_unless")
        inflight: dict[str, Submission] = {}
        held: list[Submission] = []
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
            over = not inflight and not held and not live and incoming.empty()
            if over and not grouped:
                return
            if release and (self.engine.pending() or grouped):
                if grouped and not over and not self.engine.pending():  # (free: a harness is working)
                    time.sleep(0.005)
                finished = step_unless(self.engine, over)
                if finished is None:
                    return
                for request_id, samples in finished:
                    inflight.pop(request_id).future.set_result(samples)
            else:  # a harness is working (tools, its own logic): wait for a request, a return or a deadline
                try:
                    held.append(incoming.get(timeout=0.005))
                except queue.Empty:
                    pass

    def _take(self, sub: Submission, inflight: dict[str, Submission]) -> None:
        if sub.episode.closed:  # a cut episode's harness asked again
            sub.future.set_exception(ApiError(410, "the episode is over", "episode_over"))
            return
        self.engine.submit(sub.request)
        inflight[sub.request.request_id] = sub

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(" ".join(message.split()))

    def _cut(self, ep: Episode) -> None:
        """End an episode whose harness ran past its own time. It has no request out (time waiting for
        the engine is not its own), so nothing runs in the engine for it; later requests get 410."""
        self._warn_once("cut", f"agent episode {ep.key}: the harness ran past agent.episode_timeout_s="
                               f"{self.cfg.agent.episode_timeout_s} of its own time; cut, its turns kept as a "
                               "truncated sample (logged once, later ones only counted in agent/cut)")
        with self.gateway.lock:
            ep.closed = ep.cut = True
        ep.harness.cancel()

    # ------------------------------------------------------------------ the harness's side
    def _context(self, ep: Episode, item: PromptItem, index: int) -> AgentContext:
        messages = [dict(m) for m in item.messages] or [{"role": "user", "content": item.prompt_text}]
        return AgentContext(f"{self.endpoint.url}/e/{ep.key}/v1", self.api_key, self.cfg.agent.served_model_name,
                            messages, item.answer, dict(item.fields), ep.seed, index)

    async def _call(self, ctx: AgentContext):
        """The harness's result: a coroutine function awaited on the loop, any other function run in
        a thread of the round's pool (blocking clients welcome), and what it returns awaited if awaitable."""
        if inspect.iscoroutinefunction(self.harness):
            return await self.harness(ctx)
        result = await asyncio.get_running_loop().run_in_executor(self.pool, self.harness, ctx)
        return await result if inspect.isawaitable(result) else result

    def _sample(self, ep: Episode, item: PromptItem) -> Sample:
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
            if self.cfg.agent.rows == "every" and len(book.trajectories) > 1:
                others = [t for t in book.trajectories if t is not book.main]
                sample.rows = [t.row(ep.cut) for t in [book.main, *others]]
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
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
