"""One generated sequence as it leaves rollout and enters training: the record both wings share.

`Sample` holds token ids and the engine's sampling logprobs; a multi-turn episode adds a mask
(generated vs observation tokens) and an `EpisodeInfo`. It sits below distflow.rollout, which
makes samples, and distflow.train, which pads them into the update batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    # Log-probability of each response token under the engine's sampling distribution
    # (after temperature), as the engine computed it.
    logprobs: list[float]
    truncated: bool  # hit max_new_tokens without an end-of-sequence token (an episode: its budget)
    # Multi-turn episodes (distflow.rollout.episodes): 1 on each generated token, 0 on each observation
    # token the environment appended between turns (context, never trained); None = all generated.
    mask: list[int] | None = None
    episode: "EpisodeInfo | None" = None  # what the episode did (turns, transcript, tool counts)
    # The policy version (optimizer steps taken) whose weights generated each response token; an
    # observation token gets its turn's. None: not recorded (a sample built outside an engine).
    versions: list[int] | None = None
    position: int | None = None  # the prompt's place in the run's global prompt stream (keys its seed)
    # A harness episode that recorded several trajectories (branches, restarts) trains as these rows,
    # each holding only the tokens it generated itself (its shared prefix is its prompt), with this
    # sample's reward and advantage; None: the sample is its own one row.
    rows: "list[Sample] | None" = None

    @property
    def generated(self) -> int:
        """Response tokens the model generated (observation tokens excluded)."""
        return len(self.response_ids) if self.mask is None else sum(self.mask)


def sample_to_data(s: Sample) -> dict:
    """A sample as JSON data (checkpoint state: carried groups, groups in flight); `sample_from_data` reads it."""
    return {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "logprobs": s.logprobs,
            "truncated": s.truncated, "versions": s.versions, "mask": s.mask,
            "episode": None if s.episode is None else dataclasses.asdict(s.episode)}


def sample_from_data(d: dict) -> Sample:
    ids, lps, versions = list(map(int, d["response_ids"])), list(map(float, d["logprobs"])), d["versions"]
    versions = None if versions is None else list(map(int, versions))
    mask = None if d.get("mask") is None else list(map(int, d["mask"]))
    if len(lps) != len(ids) or any(x is not None and len(x) != len(ids) for x in (versions, mask)):
        raise ValueError("a saved sample's tokens, logprobs, versions and mask differ in length")
    episode = None if d.get("episode") is None else EpisodeInfo(**d["episode"])
    return Sample(list(map(int, d["prompt_ids"])), ids, lps, bool(d["truncated"]), mask, episode, versions)


@dataclass
class EpisodeInfo:
    """One multi-turn episode beyond its token ids: what scoring and the metrics read."""

    transcript: list[dict] = field(default_factory=list)  # the model's turns and the observations, as messages
    turns: int = 0  # model turns generated
    env_reward: float = 0.0  # the sum of the environment's step rewards
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, failed tools, failed environment steps
    tool_timeouts: int = 0
    # a harness episode's (distflow.rollout.agents): engine requests, requests that started a new trajectory
    # after the first, requests kept apart (task.agent_exclude), branches (a retried turn, n > 1), and
    # whether it was cut or its harness failed
    requests: int = 0
    restarts: int = 0
    excluded: int = 0
    branches: int = 0
    cut: bool = False
    failed: bool = False

    @property
    def final_text(self) -> str:
        """The model's last turn: the answer a task reward scores."""
        return next((m["content"] for m in reversed(self.transcript) if m["role"] == "assistant"), "")


def training_rows(samples: list[Sample]) -> tuple[list[Sample], list[int] | None]:
    """The rows a step trains on, sample by sample, and the sample each row belongs to (None when
    every sample is its own row)."""
    if all(s.rows is None for s in samples):
        return samples, None
    rows = [r for s in samples for r in (s.rows or [s])]
    return rows, [i for i, s in enumerate(samples) for _ in (s.rows or [s])]


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as [N, longest] ids and attention mask, each sequence ending at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask
