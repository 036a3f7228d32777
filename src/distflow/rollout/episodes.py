"""Rollouts per rank: one engine call per prompt batch, or multi-turn episodes with an environment.

    runner = SingleTurn(engine)                       # task.env unset
    runner = EpisodeRunner(engine, pool, tokenizer, rollout_cfg, lockstep)
    groups = runner.run(items, n, seeds)              # [len(items)][n] Samples

An episode alternates model turns and the environment's observations (distflow.tasks.envs). Every
turn is one engine call for all of the rank's active episodes; the environment's steps for a
turn are one batch in the reward pool's workers. Token in, token out: a sample's response is
the generated ids and the observation ids concatenated exactly as they were appended, and the
next turn's prompt is the prompt plus that response, never decoded and re-encoded. Only
observations are tokenized (rendered by the chat template, as a conversation continues, by
`ObservationEncoder`). `Sample.mask` marks generated tokens 1 and observation tokens 0;
observation tokens carry logprob 0 and are never trained.

An episode ends when the environment says done, after rollout.max_turns model turns, when the
next observation or turn would pass the response budget (rollout.max_total_tokens; marked
truncated, a turn cut at the budget keeps its first tokens), or when an environment step fails
(it raised, returned something else than a Step, timed out or killed its worker: counted in
tool/errors or tool/timeouts). A turn cut at rollout.max_new_tokens is answered like any other
(the template closes it); it marks the sample truncated only when it is the episode's last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distflow.config import ConfigError, RolloutConfig
from distflow.tasks.prompts import PromptItem
from distflow.tasks.rewards.pool import RewardPool
from distflow.rollout.base import RolloutEngine
from distflow.sample import EpisodeInfo, Sample
from distflow.seeds import derive_seed

_TURN = "\u2063distflow-turn\u2063"  # stands for the model's turn when rendering the template


class SingleTurn:
    """One engine call: the G samples of each prompt are the response."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def run(self, items: list[PromptItem], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        return self.engine.generate([it.prompt_ids for it in items], n, seeds, greedy)


class ObservationEncoder:
    """Token ids of observation messages appended after a model turn, as the chat template renders
    them when a conversation continues: the end of the model's turn (unless the model generated
    it: its end-of-turn token), the messages, and the next generation prompt.

    The template renders a fixed conversation whose assistant content is a marker; everything
    after the marker is this text. Observations are the only text distflow encodes during a
    rollout; their ids are appended as they are.

    An observation's content is text, never control tokens: a tool's output that prints the
    template's own markers (`<|im_end|>`, `<|im_start|>assistant`) must not end the tool's turn or
    open a turn for the model. The template is rendered with a marker in place of each message's
    content; the template's text around them is encoded as usual (its control tokens stay control
    tokens) and the content with split_special_tokens, as ordinary text tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": _TURN}]

    def text(self, messages: list[dict], last_token: int | None) -> str:
        return "".join(piece for piece, _ in self.pieces(messages, last_token))

    def pieces(self, messages: list[dict], last_token: int | None) -> list[tuple[str, bool]]:
        """The rendered continuation as (text, is_content) pieces: the template's own text, and
        each message's content where the template puts it."""
        marked = [{**m, "content": _content_marker(i)} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        text = self._render(marked, last_token)
        pieces: list[tuple[str, bool]] = []
        for k, part in enumerate(_MARKER.split(text)):  # template text, then a message index, alternately
            if k % 2 == 0:
                pieces.append((part, False))
            else:
                pieces.append((messages[int(part)]["content"], True))
        return [p for p in pieces if p[0]]

    def _render(self, messages: list[dict], last_token: int | None) -> str:
        try:
            full = self.tokenizer.apply_chat_template(self.prefix + messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja raises its own types (e.g. a role the template refuses)
            roles = [m.get("role") for m in messages]
            raise ConfigError(f"the model's chat template cannot render the environment's messages (roles {roles}) "
                              f"after a model turn: {type(e).__name__}: {e}") from e
        text = full[full.index(_TURN) + len(_TURN):]
        if last_token is not None:  # the model's own end-of-turn token is already in the sequence
            end = self.tokenizer.decode([last_token])
            if end and text.startswith(end):
                text = text[len(end):]
        return text

    def __call__(self, messages: list[dict], last_token: int | None) -> list[int]:
        ids: list[int] = []
        for piece, content in self.pieces(messages, last_token):
            ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=content)["input_ids"]
        return ids


def _content_marker(index: int) -> str:
    return f"\u2063distflow-content-{index}\u2063"


_MARKER = re.compile("\u2063distflow-content-(\\d+)\u2063")


@dataclass
class Episode:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each token's policy version (an observation: its turn's)
    info: EpisodeInfo = field(default_factory=EpisodeInfo)
    truncated: bool = False

    def sample(self) -> Sample:
        return Sample(self.prompt_ids, self.ids, self.logprobs, self.truncated, self.mask, self.info, self.versions)

    @staticmethod
    def of(s: Sample) -> "Episode":
        """An episode again from its sample (a carried one, distflow.rollout.episode_driver)."""
        return Episode(list(s.prompt_ids), list(s.response_ids), list(s.mask or [1] * len(s.response_ids)),
                       list(s.logprobs), list(s.versions or []), s.episode or EpisodeInfo(), s.truncated)


class EpisodeRunner:
    """Multi-turn episodes on one rank (see the module docstring).

    `lockstep`: the engine is shared by a tensor-parallel group whose ranks must make the same
    calls, so every rank takes all max_turns turns (with no prompts once its episodes are over).
    """

    def __init__(self, engine: RolloutEngine, pool: RewardPool, tokenizer, rollout: RolloutConfig,
                 lockstep: bool = False):
        self.engine, self.pool, self.tokenizer, self.cfg = engine, pool, tokenizer, rollout
        self.encode_observation = ObservationEncoder(tokenizer)
        self.budget, self.lockstep = rollout.response_budget(), lockstep

    def run(self, items: list[PromptItem], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        episodes = [Episode(list(it.prompt_ids)) for it in items for _ in range(n)]
        fields = [it.fields for it in items for _ in range(n)]
        active = list(range(len(episodes)))
        outputs = [s for g in self.engine.generate([it.prompt_ids for it in items], n, seeds, greedy) for s in g]
        for turn in range(1, self.cfg.max_turns + 1):
            if turn > 1:
                if not active and not self.lockstep:
                    break
                contexts = [episodes[e].prompt_ids + episodes[e].ids for e in active]
                turn_seeds = [derive_seed(seeds[e // n], e % n, turn) for e in active]
                outputs = [g[0] for g in self.engine.generate(contexts, 1, turn_seeds, greedy)]
            stepping = [e for e, out in zip(active, outputs) if self.add_turn(episodes[e], out)]
            results, _ = self.pool.steps([(fields[e], episodes[e].info.transcript) for e in stepping])
            active = [e for e, res in zip(stepping, results)
                      if self.add_observation(episodes[e], res, last_turn=turn == self.cfg.max_turns)]
        return [[episodes[i * n + j].sample() for j in range(n)] for i in range(len(items))]

    def add_turn(self, ep: Episode, out: Sample) -> bool:
        """Append a generated turn; True when the environment is to answer it (False: the turn
        was cut at the response budget, which ends the episode)."""
        room = self.budget - len(ep.ids)
        ids, lps = out.response_ids[:room], out.logprobs[:room]
        ep.ids += ids
        ep.mask += [1] * len(ids)
        ep.logprobs += lps
        ep.versions += (out.versions or [self.engine.version] * len(out.response_ids))[:room]
        ep.info.turns += 1
        ep.info.transcript.append({"role": "assistant",
                                   "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
        # a turn cut at max_new_tokens is still answered; it marks the sample only if it is the last
        ep.truncated = out.truncated or len(ids) < len(out.response_ids)
        return len(ids) == len(out.response_ids)

    def add_observation(self, ep: Episode, result: tuple, last_turn: bool) -> bool:
        """Apply the environment's step; True when the episode goes on to another turn."""
        kind, step = result
        if kind != "ok":  # the step raised, returned no Step, timed out or killed its worker
            ep.info.tool_timeouts += kind == "timeout"
            ep.info.tool_errors += kind != "timeout"
            return False
        info = ep.info
        info.env_reward += float(step.reward)
        info.tool_calls += step.tool_calls
        info.tool_errors += step.tool_errors
        info.tool_timeouts += step.tool_timeouts
        if step.done or last_turn or not step.messages:
            return False
        # the model's end-of-turn token, when it wrote one, is already in the sequence
        obs = self.encode_observation(step.messages, ep.ids[-1] if ep.ids and not ep.truncated else None)
        if len(ep.ids) + len(obs) >= self.budget:  # no room left for the observation and a token
            ep.truncated = True
            return False
        ep.truncated = False  # another turn follows
        ep.ids += obs
        ep.mask += [0] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        ep.versions += [ep.versions[-1] if ep.versions else self.engine.version] * len(obs)  # its turn's
        info.transcript.extend(step.messages)
        return True


AGENT_COUNTS = ("requests", "restarts", "excluded", "branches", "cut", "failed")  # a harness episode's (distflow.rollout.agents)


def episode_sums(samples: list[Sample]) -> dict[str, float]:
    """This rank's multi-turn sums: model turns, generated tokens (observations excluded), tool
    calls, errors and timeouts, and a harness episode's counts."""
    eps = [x.episode for x in samples if x.episode is not None]
    return {"turns": float(sum(e.turns for e in eps)), "generated": float(sum(x.generated for x in samples)),
            "tool_calls": float(sum(e.tool_calls for e in eps)), "tool_errors": float(sum(e.tool_errors for e in eps)),
            "tool_timeouts": float(sum(e.tool_timeouts for e in eps)),
            **{k: float(sum(getattr(e, k) for e in eps)) for k in AGENT_COUNTS}}
