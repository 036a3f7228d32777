"""The rollout-engine protocol: token ids in, token ids and sampling logprobs out.

Engines never see text or rewards, only token ids, so the policy trains on exactly the tokens
that were sampled (no decode/re-encode drift).

Engines are step-wise: `submit` queues a request (n samples of one prompt, with its own seed),
`step` runs one engine iteration over everything running and returns the requests it finished,
`abort` takes requests out and hands back what they had generated. A caller can therefore stop
generating at any engine step (the carry-over of partial rollouts stands on this) and submit
more while others run. `generate` is the blocking call on top: submit all, step until done
(`generate_by_steps`), so a step-wise engine and a blocking one sample the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from distflow.sample import Sample


@dataclass(frozen=True)
class Request:
    """What `submit` queues: n samples of `prompt_ids`, drawn with `seed` (sample i of the request
    draws from the seed's own generator, so a request's samples do not depend on what else runs)."""
    request_id: str
    prompt_ids: list[int]
    n: int
    seed: int
    max_tokens: int | None = None  # None: rollout.max_new_tokens
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (benchmarks' fixed lengths)
    greedy: bool = False


class RolloutEngine(Protocol):
    version: int  # the policy version the engine's weights are: optimizer steps taken before they were sent

    def submit(self, request: Request) -> None:
        """Queue `request`; it starts at the next `step`. Its id must not be pending already."""

    def step(self) -> list[tuple[str, list[Sample]]]:
        """One engine iteration over every running request: (request id, its n samples in order) for
        each request whose samples have all finished in it."""

    def abort(self, request_ids: list[str]) -> dict[str, list[Sample]]:
        """Take the pending requests `request_ids` out; each one's n samples as far as they got
        (tokens and logprobs kept), for a caller that continues them later. A sample that had ended
        keeps its ending: not truncated after an end-of-sequence token, max_tokens long after its
        budget; any other is truncated and shorter than its budget."""

    def pending(self) -> int:
        """Requests submitted and not yet finished or aborted."""

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        """n samples for each prompt (grouped by prompt); seeds make sampling reproducible."""

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """logp(seq[t] | seq[:t]) for t >= 1 at temperature 1: used to verify weight sync."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     keep_running: bool = False) -> None:
        """Replace all weights in place from a stream of (HF parameter name, full tensor), which are
        the policy at `version`; wakes a sleeping engine (the resync is the only way out of sleep).
        Without `keep_running` nothing may be running; with it, running requests go on with their KV
        cache, and each token is tagged with the version that sampled it."""

    def sleep(self) -> None:
        """Free what the engine can for the update phase; nothing generates until load_weights."""

    def shutdown(self) -> None: ...


def generate_by_steps(engine: RolloutEngine, prompts: list[list[int]], n: int, seeds: list[int],
                      greedy: bool = False) -> list[list[Sample]]:
    """The blocking generate of a step-wise engine: submit every prompt, step until all finished,
    the groups in prompt order. Needs an engine with nothing else pending."""
    if engine.pending():
        raise RuntimeError(f"generate needs an idle engine; {engine.pending()} request(s) are pending")
    ids = [f"generate-{i}" for i in range(len(prompts))]
    for request_id, prompt, seed in zip(ids, prompts, seeds):
        engine.submit(Request(request_id, list(prompt), n, seed, greedy=greedy))
    done: dict[str, list[Sample]] = {}
    while engine.pending():
        done.update(engine.step())
    return [done[i] for i in ids]


def step_unless(engine: RolloutEngine, stop: bool) -> list[tuple[str, list[Sample]]] | None:
    """One engine step unless `stop` holds; None when stopped. The ranks of a tensor-parallel group
    (EngineGroup.step_unless) stop together, once every rank's flag holds, so their calls stay alike."""
    group_step = getattr(engine, "step_unless", None)
    if group_step is not None:
        return group_step(stop)
    return None if stop else engine.step()
