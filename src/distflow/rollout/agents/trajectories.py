"""Exact tokens for harness conversations: each request's context as token ids, and each
trajectory's record of what the engine generated.

A harness resends its whole conversation with every request. Re-rendering it would re-tokenize
the model's own earlier turns, and text does not round-trip to the same ids (a different split,
a normalised space), so the trained tokens would differ from the sampled ones. Instead every
request is matched against the episode's recorded trajectories: when its messages start with
everything a trajectory holds (its messages and the assistant turns the endpoint returned, as
`turn_key` compares them) and go on, the context is that trajectory's ids, exactly as they were
generated, plus the new messages encoded as observations (distflow.rollout.episodes'
ObservationEncoder: the template's continuation, contents as text). The generated turn extends
the trajectory. Any other request (the first, an edited or compacted history, other tools)
starts a new trajectory from the chat template rendered once (PromptEncoder).

Branches: a request that extends a trajectory which has moved on since (a retry of an earlier
turn), and every choice but the first of a request with n > 1, fork it at the shared prefix. The
episode's sample (what its reward scores) is the trajectory its last request extended or started.
It trains (agent.rows=every) as one row per trajectory, each holding the tokens that trajectory
generated itself: a branch's row has the prefix it shares with the trajectory it forked from as
its prompt, so every generated token is trained exactly once, and siblings forked at one point
share one prompt, which a packed update (optim.shared_prefix) computes once for all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from distflow.rollout.agents.messages import BadRequest, turn_key
from distflow.sample import EpisodeInfo, Sample

COMPLETION = "<completions>"  # the `tools` of a /v1/completions trajectory: chat requests never extend one


def _offered(tools: list[dict] | None) -> str | None:
    """The tools a request offers, as canonical JSON (what a trajectory is matched on)."""
    return json.dumps(tools, sort_keys=True) if tools else None


@dataclass
class Trajectory:
    """A conversation as token ids: the first request's rendered prompt, then each generated turn
    (mask 1, the engine's logprobs and versions) and the observations between them (mask 0)."""

    prompt_ids: list[int]
    tools: str | None  # the tools offered, as canonical JSON (a request with other tools starts anew)
    messages: list[dict] = field(default_factory=list)  # template messages: the first request's, then every turn
    keys: list[tuple] = field(default_factory=list)  # turn_key of each message
    prompt_messages: int = 0  # how many of messages were the first request's
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    open_turn: bool = False  # the last turn ended without its end-of-turn token (its token limit, a stop sequence)
    truncated: bool = False  # the last turn stopped at its token limit
    turns: int = 0
    text: str | None = None  # a text completion's prompt and turns as the client has them
    own_from: int = 0  # ids before this index came from the trajectory it forked from (its row's prompt)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def fork(self, ids: int, messages: int) -> "Trajectory":
        """A copy of this trajectory as it was with `ids` response tokens and `messages` messages."""
        return Trajectory(list(self.prompt_ids), self.tools, self.messages[:messages], self.keys[:messages],
                          self.prompt_messages, self.ids[:ids], self.mask[:ids], self.logprobs[:ids],
                          self.versions[:ids], self.open_turn, self.truncated, self.turns, None)

    def extend(self, messages: list[dict], observation: list[int], sample: Sample, turn: dict, version: int,
               stopped: bool = False) -> None:
        """Append the request's new messages (their ids: `observation`) and the turn generated for them
        (`stopped`: cut at a stop sequence)."""
        seen = self.versions[-1] if self.versions else version
        self.ids += observation + sample.response_ids
        self.mask += [0] * len(observation) + [1] * len(sample.response_ids)
        self.logprobs += [0.0] * len(observation) + list(sample.logprobs)
        self.versions += [seen] * len(observation) + list(sample.versions or [version] * len(sample.response_ids))
        self.messages += [*messages, turn]
        self.keys += [turn_key(m) for m in (*messages, turn)]
        self.open_turn, self.truncated, self.turns = sample.truncated or stopped, sample.truncated, self.turns + 1

    def row(self, cut: bool) -> Sample:
        """The tokens this trajectory generated itself as a training row: what it shares with the
        trajectory it forked from (and the messages before its first turn) is the row's prompt."""
        k = self.own_from
        return Sample(self.prompt_ids + self.ids[:k], self.ids[k:], self.logprobs[k:], self.truncated or cut,
                      self.mask[k:], versions=self.versions[k:])

    def sample(self, cut: bool) -> Sample:
        """The training row: the prompt, and every turn and observation after it, observations masked;
        truncated when the last turn hit its limit or the episode was cut."""
        transcript = self.messages[self.prompt_messages:]
        return Sample(list(self.prompt_ids), list(self.ids), list(self.logprobs), self.truncated or cut,
                      list(self.mask), EpisodeInfo(transcript=transcript, turns=self.turns), list(self.versions))


@dataclass
class Prepared:
    """A request's context, before the engine answers it."""

    context: list[int]
    messages: list[dict]  # the request's messages not yet in `base` (all of them for a new trajectory)
    observation: list[int]  # their ids, when they continue `base`
    tools: str | None
    base: Trajectory | None = None
    base_ids: int = 0  # the size of base when the request was matched
    base_messages: int = 0
    text: str | None = None  # a text completion's whole prompt


class TrajectoryBook:
    """One episode's trajectories (see the module docstring). `encode_prompt(messages, tools)`,
    `encode_observation(messages, last_token)` and `encode_text(text, first)` (a completion's plain
    text; `first`: with the tokenizer's start tokens) are the policy tokenizer's encoders;
    `max_prompt` and `budget` are the rollout's prompt and response limits."""

    def __init__(self, encode_prompt, encode_observation, max_prompt: int, budget: int, encode_text=None):
        self.encode_prompt, self.encode_observation, self.encode_text = encode_prompt, encode_observation, encode_text
        self.max_prompt, self.budget = max_prompt, budget
        self.trajectories: list[Trajectory] = []
        self.main: Trajectory | None = None  # the trajectory of the last request
        self.restarts = 0  # requests after the first that extended no trajectory

    def prepare(self, messages: list[dict], tools: list[dict] | None) -> Prepared:
        """The context of a chat request: a recorded trajectory's exact ids plus the new messages, or
        the rendered conversation. BadRequest (context_length_exceeded) when it leaves no room to generate."""
        keys = [turn_key(m) for m in messages]
        offered = _offered(tools)
        base = max((t for t in self.trajectories
                    if t.tools == offered and len(t.keys) < len(keys) and keys[:len(t.keys)] == t.keys),
                   key=lambda t: len(t.keys), default=None)
        if base is None:
            return self._start(self.encode_prompt(messages, tools)[0], messages, offered)
        new = messages[len(base.keys):]
        return self._continue(base, new, self.encode_observation(new, None if base.open_turn or not base.ids
                                                                     else base.ids[-1]))

    def apart(self, messages: list[dict], tools: list[dict] | None) -> Prepared:
        """The context of a request that is not part of the episode's trajectories (task.agent_exclude):
        the rendered conversation, matched against nothing and never recorded."""
        return self._start(self.encode_prompt(messages, tools)[0], messages, _offered(tools), counts=False)

    def prepare_text(self, prompt: str | list[int]) -> Prepared:
        """The context of a completion request: a trajectory's exact ids when the prompt continues it
        (its text, or its ids, followed by more), then the rest encoded; else the prompt alone."""
        mine = [t for t in self.trajectories if t.tools == COMPLETION]
        if isinstance(prompt, str):
            base = max((t for t in mine if t.text is not None and len(prompt) > len(t.text)
                        and prompt.startswith(t.text)), key=lambda t: len(t.text), default=None)
            rest = prompt[len(base.text):] if base is not None else prompt
            ids = self.encode_text(rest, base is None)
        else:
            base = max((t for t in mine if len(prompt) > len(t.context) and prompt[:len(t.context)] == t.context),
                       key=lambda t: len(t.context), default=None)
            rest, ids = None, list(prompt[len(base.context):] if base is not None else prompt)
        shown = [{"role": "user", "content": rest if rest is not None else f"<{len(ids)} token ids>"}]
        prepared = self._start(ids, shown, COMPLETION) if base is None else self._continue(base, shown, ids)
        prepared.text = prompt if isinstance(prompt, str) else None
        return prepared

    def _start(self, ids: list[int], messages: list[dict], tools: str | None, counts: bool = True) -> Prepared:
        self.restarts += counts and bool(self.trajectories)
        if len(ids) > self.max_prompt:
            raise BadRequest(f"context_length_exceeded: the conversation is {len(ids)} tokens, more than the "
                             f"prompt limit rollout.max_prompt_tokens={self.max_prompt}")
        return Prepared(ids, messages, [], tools)

    def _continue(self, base: Trajectory, messages: list[dict], observation: list[int]) -> Prepared:
        if len(base.ids) + len(observation) >= self.budget:
            raise BadRequest(f"context_length_exceeded: the conversation's turns and messages come to "
                             f"{len(base.ids) + len(observation)} tokens, leaving none of the response limit "
                             f"rollout.max_total_tokens={self.budget}")
        return Prepared(base.context + observation, messages, observation, base.tools, base, len(base.ids),
                        len(base.keys))

    def room(self, prepared: Prepared) -> int:
        """Tokens the request may still generate within the response limit."""
        used = len(prepared.base.ids) + len(prepared.observation) if prepared.base is not None else 0
        return self.budget - used

    def record(self, prepared: Prepared, turns: list[tuple[Sample, dict]], version: int,
               stopped: list[bool] | None = None) -> list[Trajectory]:
        """The engine's samples for a prepared request (with their template messages; `stopped`: each
        cut at a stop sequence), each as a trajectory: the first extends the one it matched if that
        has not moved on since; the others are branches from the shared prefix."""
        out = []
        for k, (sample, turn) in enumerate(turns):
            base = prepared.base
            if base is None:
                t = Trajectory(list(prepared.context), prepared.tools, prompt_messages=len(prepared.messages))
            else:
                unchanged = len(base.ids) == prepared.base_ids and len(base.keys) == prepared.base_messages
                t = base if k == 0 and unchanged else base.fork(prepared.base_ids, prepared.base_messages)
            if t is not base:
                t.own_from = prepared.base_ids + len(prepared.observation)
                self.trajectories.append(t)
            t.extend(prepared.messages, prepared.observation, sample, turn, version, bool(stopped and stopped[k]))
            if prepared.text is not None:
                t.text = prepared.text + turn["content"]
            out.append(t)
        self.main = out[0]
        return out
