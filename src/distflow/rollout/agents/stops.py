"""Stop sequences (OpenAI's `stop`, Anthropic's `stop_sequences`): a turn ends at the first of them.

The engine generates the turn as usual; the endpoint then cuts each answer after the token that
completes the earliest stop sequence in its text. The answer's text ends before the sequence (as
OpenAI's does); its token ids, which the trajectory keeps and trains, run to that token (as vLLM's
do), so what trains is exactly a prefix of what was sampled, with the engine's logprobs. The cut
turn has no end-of-turn token: the next request's messages close it through the chat template,
as they close a turn cut at its token limit. Tokens sampled past the cut are discarded.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from distflow.rollout.agents.messages import BadRequest
from distflow.sample import Sample

MAX_STOPS = 16


def parse_stops(value, key: str) -> list[str]:
    """A request's stop sequences: None, one string, or a list of non-empty strings."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops) and len(stops) <= MAX_STOPS):
        raise BadRequest(f"{key} must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings, "
                         f"got {value!r}")
    return stops


@dataclasses.dataclass(frozen=True)
class Answer:
    """One choice as the client sees it: the (possibly cut) sample, its text, and the stop
    sequence that ended it (None: it ended at its end-of-turn token or its token limit)."""

    sample: Sample
    text: str
    stop: str | None = None


def cut_at_stop(sample: Sample, stops: list[str], decode: Callable[[list[int]], str]) -> Answer:
    """`sample` cut after the token that completes the earliest of `stops` in its text, if any."""
    text = decode(sample.response_ids)
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return Answer(sample, text)
    where, stop = min(found)
    ids = sample.response_ids
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop sequence (decoding only grows the text)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    cut = dataclasses.replace(sample, response_ids=ids[:lo], logprobs=sample.logprobs[:lo], truncated=False,
                              versions=None if sample.versions is None else sample.versions[:lo])
    return Answer(cut, text[:where], stop)
