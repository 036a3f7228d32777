"""The update side's data, padded once: token tensors plus per-token [B, R] tensors.

After rollout a rank's samples are left-padded into one `TokenBatch`; every later phase
(logprobs, values, advantages, the loss) reads and writes [B, R] tensors aligned with its
response mask. A padded micro-batch is a row selection of it (`TokenBatch.rows`), never a
cut-and-re-pad of per-sample lists; a packed one (distflow.train.shared_prefix) is built from
its rows and returns its outputs in the same [b, R] shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Union

import torch

from distflow.sample import Sample, left_pad


@dataclass(frozen=True)
class TokenBatch:
    """Left-padded sequences, so every response ends at the last column.

    Left padding lets the forward pass compute logits only for the last R+1 positions
    (`logits_to_keep`), which hold every response token; the LM head over prompt tokens —
    a large share of a small model's FLOPs — is skipped. Position ids are explicit, so
    padding never shifts positions (they match the engine's 0..n-1).
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    resp_len: torch.Tensor  # [B] response tokens per row
    # [B, R] 1 on the response tokens the policy generated, left-aligned: 0 on padding and on the
    # observation tokens an environment appended between turns (context only, so every phase that
    # reads this mask — logprobs, advantages, the losses — leaves them out).
    resp_mask: torch.Tensor

    @staticmethod
    def from_samples(samples: list[Sample], pad_id: int, device: torch.device) -> "TokenBatch":
        ids, attn = left_pad([s.prompt_ids + s.response_ids for s in samples], pad_id)
        resp_width = max(1, max(len(s.response_ids) for s in samples))
        rmask = torch.zeros((len(samples), resp_width), dtype=torch.float32)
        for i, s in enumerate(samples):
            rmask[i, : len(s.response_ids)] = 1.0 if s.mask is None else torch.tensor(s.mask, dtype=torch.float32)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        resp_len = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
        return TokenBatch(ids.to(device), attn.to(device), pos.to(device), resp_len.to(device), rmask.to(device))

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> torch.Tensor:
        """[B] prompt + response tokens per row."""
        return self.attention_mask.sum(-1)

    def width(self, idx: list[int]) -> int:
        """Response width of the rows `idx` (at least 1): the R of `rows(idx)`."""
        return max(1, int(self.resp_len[idx].max())) if idx else 1

    # What a forward pass reads (the same as distflow.train.shared_prefix.PackedRows offers):

    def model_inputs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids)

    @property
    def logits_to_keep(self) -> int:
        """The last R+1 positions predict every response token."""
        return self.resp_mask.shape[1] + 1

    @property
    def window_index(self) -> torch.Tensor:
        """[B, R] indices into the window of the last R+1 positions: column t of row i is the
        position whose output predicts (or values the state before) response token t.

        A row with r response tokens has token t at window index R - r + t + 1, so the output at
        window index R - r + t belongs to it (clamped past the end; those columns are masked)."""
        width = self.resp_mask.shape[1]
        t = torch.arange(width, device=self.resp_len.device)[None, :]
        return (width - self.resp_len[:, None] + t).clamp(max=width - 1)

    @property
    def targets(self) -> torch.Tensor:
        """[B, R] the response tokens (padding where a response is shorter)."""
        return self.input_ids[:, -self.logits_to_keep:].gather(1, self.window_index + 1)

    def select(self, kept: torch.Tensor) -> torch.Tensor:
        """[B, R+1, ...] outputs of the kept window -> [B, R, ...] per response token."""
        idx = self.window_index
        idx = idx.view(*idx.shape, *([1] * (kept.dim() - 2))).expand(*idx.shape, *kept.shape[2:])
        return kept.gather(1, idx)

    def select_full(self, out: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] outputs at every position -> [B, R, ...] per response token."""
        return self.select(out[:, -self.logits_to_keep:])

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def rows(self, idx: list[int]) -> "TokenBatch":
        """The rows `idx`, trimmed to their own widths: exactly `from_samples` of those samples."""
        length, width = max(1, int(self.seq_len[idx].max())), self.width(idx)
        return TokenBatch(self.input_ids[idx, -length:], self.attention_mask[idx, -length:],
                          self.position_ids[idx, -length:], self.resp_len[idx], self.resp_mask[idx, :width])

    def whole(self, idx: list[int]) -> "TokenBatch":
        """The rows `idx` with every token after the first scored, prompt tokens included (the
        engine probe's view): exactly `from_samples` of those sequences as one-token prompts."""
        rows = self.rows(idx)
        scored = rows.seq_len - 1
        width = max(1, int(scored.max())) if idx else 1
        mask = (torch.arange(width, device=scored.device)[None, :] < scored[:, None]).float()
        return TokenBatch(rows.input_ids, rows.attention_mask, rows.position_ids, scored, mask)


class _CurrentPolicy:
    """Marker for `UpdateBatch.old_logprobs`: the policy that sampled is the one being trained
    (one optimizer step per rollout), so the update uses its own detached logprobs as the old
    ones and the importance ratio is exactly 1."""

    def __repr__(self) -> str:
        return "CURRENT_POLICY"


CURRENT_POLICY = _CurrentPolicy()
OldLogprobs = Union[torch.Tensor, _CurrentPolicy]


@dataclass(frozen=True)
class UpdateBatch:
    """One rank's training batch: tokens plus per-token [B, R] tensors on the training device.

    `loss_mask` marks the tokens the policy loss trains on (the response mask, minus what a
    filter drops); `resp_mask` (in `tokens`) marks every real response token. Optional fields
    are None when the run has no such component (no reference model, no critic).
    """

    tokens: TokenBatch
    loss_mask: torch.Tensor
    sampling_logprobs: torch.Tensor  # the engine's own, for truncated IS
    advantages: torch.Tensor
    old_logprobs: OldLogprobs = CURRENT_POLICY
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # the critic's, at rollout time
    returns: torch.Tensor | None = None  # the critic's targets
    # [B, R] the policy version that generated each response token (0 on padding); None when a
    # sample did not record its versions
    token_versions: torch.Tensor | None = None
    # [B, R] how many versions each token's generating policy is behind the engine's at this step
    # (carried-over tokens lag); None: no versions recorded
    token_lag: torch.Tensor | None = None
    # [B, R] the tokens the engine/trainer mismatch is measured on: those of the engine's current
    # version (older ones differ by the updates between); None: the loss mask
    mismatch_mask: torch.Tensor | None = None
    # [B, R] log pi_student - log pi_teacher of each response token (on-policy distillation)
    teacher_log_ratio: torch.Tensor | None = None
    # 1 / the mean truncated importance weight over the whole step's batch (all ranks), when the
    # rollout correction normalises its weights (rollout_is_batch_normalize); 1 otherwise
    is_weight_scale: float = 1.0
    # [B] the sample each row belongs to when samples train as several rows (distflow.sample.training_rows)
    sample_of: torch.Tensor | None = None
    sample_resp_len: torch.Tensor | None = None  # [samples] their response lengths, for the reward shaping

    @property
    def resp_len(self) -> torch.Tensor:
        """[samples] each sample's response length (a sample of several rows: its whole response)."""
        return self.tokens.resp_len if self.sample_resp_len is None else self.sample_resp_len

    @staticmethod
    def from_samples(samples: list[Sample], pad_id: int, device: torch.device,
                     drop_truncated: bool = False) -> "UpdateBatch":
        """Tokens and masks; advantages start at 0. drop_truncated takes samples cut at
        max_new_tokens out of the loss (DAPO's overlong filter)."""
        if not samples:
            return UpdateBatch.empty(device)
        tokens = TokenBatch.from_samples(samples, pad_id, device)
        keep = torch.tensor([not (drop_truncated and s.truncated) for s in samples], dtype=torch.float32)
        width = tokens.resp_mask.shape[1]
        engine = pad_rows([torch.tensor(s.logprobs, dtype=torch.float32) for s in samples], width)
        versions = None
        if all(s.versions is not None for s in samples):
            versions = pad_rows([torch.tensor(s.versions, dtype=torch.long) for s in samples], width).to(device)
        return UpdateBatch(tokens, tokens.resp_mask * keep.to(device)[:, None], engine.to(device),
                           torch.zeros_like(tokens.resp_mask), token_versions=versions)

    @staticmethod
    def empty(device: torch.device) -> "UpdateBatch":
        """A rank with no samples (dynamic sampling can leave one empty)."""
        z = torch.zeros((0, 1), device=device)
        zl = torch.zeros((0, 1), dtype=torch.long, device=device)
        tokens = TokenBatch(zl, zl, zl, torch.zeros(0, dtype=torch.long, device=device), z)
        return UpdateBatch(tokens, z, z, z)

    def __len__(self) -> int:
        return len(self.tokens)

    def with_(self, **fields) -> "UpdateBatch":
        return replace(self, **fields)


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D per-sample tensors into [len(rows), width], zero-padded or cut ([0, width] float
    when there are none)."""
    if not rows:
        return torch.zeros((0, width))
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        n = min(width, r.shape[0])
        out[i, :n] = r[:n]
    return out
