"""The engine/policy probe: after a resync the engine must compute the logprobs the policy trains.

A wrong or partial resync, a model family the engine implements differently, or a dtype past its
expected rounding shows up as a logprob gap on the same tokens. The trainer runs it at start-up
and on probed steps; past PROBE_LIMIT every rank stops with one line.
"""

from __future__ import annotations

import logging

import torch

from distflow.distributed import all_reduce
from distflow.errors import RunAborted
from distflow.sample import Sample
from distflow.train.batch import TokenBatch

log = logging.getLogger("distflow")

# The probe stops the run above these max |engine - policy| logprobs (run.allow_engine_mismatch:
# it warns instead). In float32 both sides compute the same function and differ by summation
# order: <= 1e-6 on the tiny model and 6e-5 to 1.3e-4 on SmolLM2-135M with vLLM on CPU (the demo's
# metrics), so 1e-3 already means a wrong or partial resync. In bfloat16 the engine's kernels round
# differently from the trainer's, and the max over a step's prompt and response tokens reached 0.35
# to 1.26 nats on healthy SmolLM2 demo runs (vLLM on CPU, 8 probes; the trained tokens' own mean
# |diff| is ~0.035, mismatch/abs_mean); unloaded or wrong tensors give several nats. So bf16's
# probe catches only a broken resync; the exactness check is float32's. docs/concepts.md lists the
# expected ranges.
PROBE_LIMIT = {"float32": 1e-3, "bfloat16": 3.0}


@torch.no_grad()
def logprob_gaps(engine, policy, seqs: list[list[int]], pad_id: int, rows=None) -> list[torch.Tensor]:
    """|engine - policy| logprob of every token after the first of each of `seqs`, at temperature 1:
    after a resync the two must agree (a wrong or partial resync shows up here). `rows`: the
    same sequences as a `TokenBatch` that scores all their tokens (`TokenBatch.whole`, the
    step's own rows, not padded again); padded from `seqs` when None."""
    return engine_gaps(engine, seqs, policy_logprobs(policy, seqs, pad_id, rows))


@torch.no_grad()
def policy_logprobs(policy, seqs: list[list[int]], pad_id: int, rows=None) -> list[torch.Tensor]:
    """The policy's logprob of every token after the first of each of `seqs` (float32, on the CPU)."""
    if rows is None:
        rows = TokenBatch.from_samples([Sample(seq[:1], seq[1:], [], False) for seq in seqs], pad_id, policy.device)
    policy_lp = policy.logprobs(rows, 1.0)
    return [policy_lp[i, : len(seq) - 1].float().cpu() for i, seq in enumerate(seqs)]


def engine_gaps(engine, seqs: list[list[int]], policy_lp: list[torch.Tensor]) -> list[torch.Tensor]:
    """|engine - policy| logprob per token of `seqs`, the policy's given (policy_logprobs): a rank
    that holds the engine but not the policy (a split run's rollout rank) compares here."""
    return [(torch.tensor(lp) - p).abs() for lp, p in zip(engine.prompt_logprobs(seqs), policy_lp)]


def max_logprob_diff(engine, policy, seqs: list[list[int]], pad_id: int, rows=None) -> float:
    """Max |engine - policy| logprob of every token after the first of `seqs` (see logprob_gaps)."""
    return largest_gap(logprob_gaps(engine, policy, seqs, pad_id, rows))


def largest_gap(gaps: list[torch.Tensor]) -> float:
    """The largest gap of any token (0 when none)."""
    diff = 0.0
    for gap in gaps:
        diff = max(diff, float(gap.max()))
    return diff


def mismatch_line(diff: float, dtype: str, model_type: str, when: str) -> str | None:
    """None while `diff` is what `dtype` explains (PROBE_LIMIT), else the one line that says the
    engine does not compute what the policy trains. NaN (nothing probed) passes."""
    limit = PROBE_LIMIT[dtype]
    if not diff > limit:
        return None
    return (f"{when}: the engine's logprobs differ from the policy's by up to {diff:.3g} ({model_type}, {dtype}; at "
            f"most {limit:g} expected): the engine does not compute what the policy trains, or does not hold its "
            "weights; run.allow_engine_mismatch=true trains anyway")


def start_line(diff: float, mean: float, dtype: str) -> str:
    """The start-up probe's line while `diff` is within PROBE_LIMIT: the statistic the limit
    applies to (the max), the mean beside it, and the limit of the dtype, so that a bfloat16 max
    of a few tenths reads as the healthy value it is; 3 significant digits keep float32's ~1e-6."""
    return (f"start-up probe ({dtype}): max |engine - policy| logprob {diff:.3g}, mean {mean:.3g}, "
            f"within the {dtype} bound {PROBE_LIMIT[dtype]:g}")


class EngineProbe:
    """The probe as the run uses it: once at start-up on the rank's first prompts, then after the
    resync of every `run.sync_probe_every`-th step (and the first) on the step's own rows. Every rank
    takes the largest gap of any rank; past PROBE_LIMIT they all stop with the same line
    (run.allow_engine_mismatch: a warning)."""

    def __init__(self, engine, policy, run_cfg, dtype: str, pad_id: int):
        """`engine`: anything with `prompt_logprobs` (the Rollout); `run_cfg`: the run section."""
        self.engine, self.policy, self.r, self.dtype, self.pad_id = engine, policy, run_cfg, dtype, pad_id

    def at_start(self, items: list) -> float:
        """Once before any step, whatever run.sync_probe_every says: the engine as loaded (or resynced from
        the checkpoint) against the policy, on the rank's first prompts (`items`: PromptItems); a
        mismatched family stops here."""
        seqs = [item.prompt_ids for item in items[: max(self.r.sync_probe_seqs, 2)]] or [[self.pad_id] * 2]
        diff, mean = self.check(seqs, "start-up", mean=True)
        if not diff > PROBE_LIMIT[self.dtype]:  # past it, check() stopped the run or warned, in one line
            log.info(start_line(diff, mean, self.dtype))
        return diff

    def after_sync(self, step: int, samples: list[Sample], tokens: TokenBatch) -> float | None:
        """Max |engine - policy| logprob on this step's first sequences (the batch's own rows), after
        the resync; None when this step is not probed."""
        if (probed := self.probed(step, samples, tokens)) is None:
            return None
        seqs, rows = probed
        return self.check(seqs or [[self.pad_id] * 2], f"step {step}", rows)[0]

    def probed(self, step: int, samples: list[Sample], tokens: TokenBatch) -> tuple[list, TokenBatch | None] | None:
        """A probed step's first sequences (possibly none) and their rows in the step's batch; None when
        run.sync_probe_every skips the step (step 1 is always probed)."""
        n, every = self.r.sync_probe_seqs, self.r.sync_probe_every
        if n == 0 or (step % every and step != 1):
            return None
        seqs = [s.prompt_ids + s.response_ids for s in samples[:n]]
        return seqs, tokens.whole(list(range(len(seqs)))) if seqs else None

    def check(self, seqs: list[list[int]], when: str, rows: TokenBatch | None = None,
              mean: bool = False) -> tuple[float, float]:
        """The largest |engine - policy| logprob of any rank on `seqs`, and with `mean` the mean
        over all ranks' tokens (NaN without; one more collective); past PROBE_LIMIT it stops the run
        (run.allow_engine_mismatch: warns). Collective."""
        gaps = logprob_gaps(self.engine, self.policy, seqs, self.pad_id, rows)
        diff = float(all_reduce(largest_gap(gaps), op="max")[0])
        average = float("nan")
        if mean:
            total, count = all_reduce([sum(float(g.sum()) for g in gaps), sum(g.numel() for g in gaps)]).tolist()
            average = total / count if count else float("nan")
        self.judge(diff, when)
        return diff, average

    def judge(self, diff: float, when: str) -> None:
        """Past PROBE_LIMIT: stop the run with the one line (run.allow_engine_mismatch: warn with it)."""
        line = mismatch_line(diff, self.dtype, self.policy.model.config.model_type, when)
        if line and not self.r.allow_engine_mismatch:
            raise RunAborted(line)
        if line:
            log.warning(line)
