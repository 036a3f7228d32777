"""The engine/policy probe: after a resync the engine must compute the logprobs the policy trains.

A wrong or partial resync, a model family the engine implements differently, or a dtype past its
expected rounding shows up as a logprob gap on the same tokens. The trainer runs it at start-up
and on probed steps; past PROBE_LIMIT every rank stops with one line.
"""

from __future__ import annotations

import torch

from distflow.sample import Sample
from distflow.train.batch import TokenBatch

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
def max_logprob_diff(engine, policy, seqs: list[list[int]], pad_id: int, rows=None) -> float:
    """Max |engine - policy| logprob of every token after the first of `seqs`, at temperature 1:
    after a resync the two must agree (a wrong or partial resync shows up here). `rows`: the
    same sequences as a `TokenBatch` that scores all their tokens (`TokenBatch.whole`, the
    step's own rows, not padded again); padded from `seqs` when None."""
    engine_lp = engine.prompt_logprobs(seqs)
    if rows is None:
        rows = TokenBatch.from_samples([Sample(seq[:1], seq[1:], [], False) for seq in seqs], pad_id, policy.device)
    policy_lp = policy.logprobs(rows, 1.0)
    diff = 0.0
    for i, lp in enumerate(engine_lp):
        ref = policy_lp[i, : len(lp)].float().cpu()
        diff = max(diff, float((torch.tensor(lp) - ref).abs().max()))
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
