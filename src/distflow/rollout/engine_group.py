"""One tensor-parallel engine driven by k consecutive ranks, each rank still asking for its own data.

vLLM's external launcher runs a scheduler on every rank of a tensor-parallel group and needs
every one of them to make the same calls with the same requests in the same order. The trainer
stays SPMD: each rank samples its own prompts and owns its groups. Before every engine call the
ranks of a group all-gather their requests (token ids and per-prompt seeds, a few KB), the
engine serves the concatenation once, and each rank keeps its own slice of the answer. Nothing
funnels through one rank, and what a rank sends depends on its own requests and k, not on the
world size.

Step by step (`submit`, `step`, `abort`) a rank queues its requests locally; once per engine step the
group gathers every rank's new requests and its stop flag in one all_gather, submits the union
(request ids prefixed by the owning rank's place in the group) and steps the engine once, unless
every rank's stop rule holds. A rank whose rule held earlier keeps receiving what finishes meanwhile.
An abort gathers the ids of every rank, so all workers abort the same requests.

Seeds: a prompt's sample seed is derived exactly as with one engine per rank (from its stream
position, distflow.seeds.sample_seed) and travels with the prompt, so every rank of the group hands
vLLM the same seed for it; the engine seed (run.seed) is the same on every rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from distflow.distributed import waiting
from distflow.rollout.base import Request, RolloutEngine
from distflow.sample import Sample


class EngineGroup:
    """A RolloutEngine over a tensor-parallel engine shared by the ranks of `group`."""

    def __init__(self, engine: RolloutEngine, group):
        self.engine, self.group = engine, group
        self.index, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._queued: list[Request] = []  # submitted here, not yet gathered
        self._own: set[str] = set()  # this rank's requests pending in the engine (or queued)

    def _gather(self, request: tuple) -> list[tuple]:
        parts: list = [None] * self.size
        with waiting():
            dist.all_gather_object(parts, request, group=self.group)
        if len({p[0] for p in parts}) != 1:  # the call's options, which must agree across the group
            raise RuntimeError(f"the ranks of a tensor-parallel engine group made different calls: {[p[0] for p in parts]}")
        return parts

    def _mine(self, parts: list[tuple], answers: list) -> list:
        start = sum(len(p[1]) for p in parts[: self.index])
        return answers[start : start + len(parts[self.index][1])]

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        parts = self._gather((("generate", n, greedy), prompts, seeds))
        everyone = [p for part in parts for p in part[1]]
        all_seeds = [s for part in parts for s in part[2]]
        return self._mine(parts, self.engine.generate(everyone, n, all_seeds, greedy))

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        parts = self._gather((("prompt_logprobs",), seqs))
        return self._mine(parts, self.engine.prompt_logprobs([s for part in parts for s in part[1]]))

    # ------------------------------------------------------------------ step-wise generation
    def _engine_id(self, index: int, request_id: str) -> str:
        return f"{index}/{request_id}"

    def submit(self, request: Request) -> None:
        """Queued until the group's next step, which gathers every rank's new requests."""
        if request.request_id in self._own:
            raise ValueError(f"request {request.request_id!r} is already pending")
        self._queued.append(request)
        self._own.add(request.request_id)

    def step(self) -> list[tuple[str, list[Sample]]]:
        """One engine step for the whole group (a rank with nothing of its own still steps with the others)."""
        return self.step_unless(False) or []

    def step_unless(self, stop: bool) -> list[tuple[str, list[Sample]]] | None:
        """One gather of new requests and stop flags, then one engine step unless every rank wants to
        stop (None then; requests gathered are submitted either way)."""
        parts = self._gather((("step",), self._queued, stop))
        self._queued = []
        for index, part in enumerate(parts):
            for r in part[1]:
                self.engine.submit(Request(self._engine_id(index, r.request_id), r.prompt_ids, r.n, r.seed,
                                           r.max_tokens, r.ignore_eos, r.greedy))
        if all(part[2] for part in parts):
            return None
        prefix, mine = f"{self.index}/", []
        for request_id, samples in self.engine.step():
            if request_id.startswith(prefix):
                mine.append((request_id[len(prefix):], samples))
                self._own.discard(mine[-1][0])
        return mine

    def abort(self, request_ids: list[str]) -> dict[str, list[Sample]]:
        """Every rank of the group aborts together; each gets back its own partials (a request still
        queued comes back with nothing generated)."""
        queued = {r.request_id: r for r in self._queued if r.request_id in request_ids}
        self._queued = [r for r in self._queued if r.request_id not in queued]
        sent = [i for i in request_ids if i in self._own and i not in queued]
        parts = self._gather((("abort",), sent))
        partials = self.engine.abort([self._engine_id(index, i) for index, part in enumerate(parts) for i in part[1]])
        out = {i: partials[self._engine_id(self.index, i)] for i in sent if self._engine_id(self.index, i) in partials}
        out.update({i: [Sample(list(r.prompt_ids), [], [], True, versions=[]) for _ in range(r.n)] for i, r in queued.items()})
        self._own -= set(out) | set(sent)
        return out

    def pending(self) -> int:
        """This rank's own requests not yet finished or aborted."""
        return len(self._own)

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     keep_running: bool = False) -> None:
        """Every rank streams the full tensors; vLLM's loader keeps each worker's slice."""
        self.engine.load_weights(weights, version, keep_running)

    def sleep(self) -> None:
        self.engine.sleep()

    def shutdown(self) -> None:
        self.engine.shutdown()
