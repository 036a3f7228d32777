"""Forward passes over a rank's batch, and the loss passes over one mini-batch.

Sharding-invariance lives here. Every rank runs the same number of FSDP forward (and
backward) passes — the count is agreed with an all_reduce(MAX) and short ranks pad with
zero-weight passes, even a rank that has no samples at all (dynamic sampling can leave one
empty). The loss normaliser (token or sequence count) is summed over all ranks; each
micro-batch's loss is divided by it and multiplied by the world size (FSDP averages
gradients over ranks), which yields the gradient a single process would get on the whole
global mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch

from distflow.algorithms import aggregate_denominator, aggregate_numerator, compute_token_loss, value_loss
from distflow.algorithms.mismatch import MismatchSums, combine, mismatch_vector
from distflow.config import DistflowConfig
from distflow.distributed import all_reduce
from distflow.sample import Sample
from distflow.train.batch import CURRENT_POLICY, TokenBatch, UpdateBatch
from distflow.train.critic import Critic
from distflow.train.policy import Policy


@dataclass
class UpdateSums:
    """This rank's sums over its loss passes (policy and critic)."""

    loss: float = 0.0  # the policy loss, already divided by the global denominator
    tokens: float = 0.0  # tokens the policy loss trained on
    clip_low: float = 0.0
    clip_high: float = 0.0
    dual_clip: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    tis_weight: float = 0.0
    value_loss: float = 0.0
    value_clipped: float = 0.0
    value_sq_error: float = 0.0
    value_sum: float = 0.0
    value_tokens: float = 0.0
    moe_aux: float = 0.0  # mixture-of-experts routers (distflow.train.router), per policy loss pass
    moe_load: float = 0.0
    moe_passes: float = 0.0
    mismatch: MismatchSums = field(default_factory=MismatchSums)  # engine vs policy, first epoch only

    @classmethod
    def read(cls, sums: "DeviceSums") -> "UpdateSums":
        values = sums.read()
        mismatch = values.pop("mismatch", None)
        out = cls(**values)
        if mismatch is not None:
            out.mismatch = MismatchSums.from_values(mismatch)
        return out

    def __iadd__(self, other: "UpdateSums") -> "UpdateSums":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


class DeviceSums:
    """A loss pass's metric sums, kept on the device as float64 tensors (float32 sums widened, as
    Python's float() would) and read in one host sync per mini-batch, so the host is never
    stopped mid-update to wait for the device's micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.mismatch: torch.Tensor | None = None

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_mismatch(self, vector: torch.Tensor) -> None:
        self.mismatch = vector if self.mismatch is None else combine(self.mismatch, vector)

    def read(self) -> dict:
        keys = list(self.sums)
        parts = [torch.stack([self.sums[k] for k in keys])] if keys else []
        if self.mismatch is not None:
            parts.append(self.mismatch)
        if not parts:
            return {}
        values = torch.cat(parts).tolist()  # the one host sync
        out: dict = dict(zip(keys, values[:len(keys)]))
        if self.mismatch is not None:
            out["mismatch"] = values[len(keys):]
        return out


@dataclass
class UpdateResult:
    """What one update phase did on this rank."""

    sums: UpdateSums = field(default_factory=UpdateSums)
    passes: int = 1  # optimizer steps taken or attempted (ppo_epochs x mini_batches)
    grad_norm: float = 0.0  # mean pre-clip norm over the policy's optimizer steps
    critic_grad_norm: float = 0.0
    skipped: bool = False  # no sample left anywhere: nothing was trained
    actor_skipped: bool = False  # critic warm-up
    nonfinite_skipped: int = 0  # optimizer steps dropped because a loss or gradient was not finite


def plan_micro_batches(lengths: list[int], size: int, token_budget: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch, sequences of similar length together.

    Sequences are ordered by length, so a micro-batch pads to a near neighbour instead of the
    longest sequence of the rank. With token_budget > 0 a micro-batch grows while its padded
    size (count x longest) stays within the budget (one longer sequence still gets its own);
    otherwise it holds `size` sequences. The loss does not depend on the split (global normaliser).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if token_budget <= 0:
        return [order[k : k + size] for k in range(0, len(order), size)]
    plan: list[list[int]] = []
    for i in order:
        if plan and (len(plan[-1]) + 1) * lengths[i] <= token_budget:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


def micro_batches(tokens: TokenBatch, rows: list[int], cfg: DistflowConfig,
                  pad_id: int) -> Iterator[tuple[list[int], TokenBatch, bool]]:
    """(row indices, their tokens, real) over `rows`, padded to the global number of passes.

    Padding passes reuse the first micro-batch (or a one-token dummy on an empty rank) and
    must contribute nothing: callers weight them by 0 and drop their outputs.
    """
    o = cfg.optim
    lengths = tokens.seq_len[rows].tolist() if rows else []
    plan = [[rows[i] for i in mb] for mb in plan_micro_batches(lengths, o.micro_batch_size, o.micro_batch_tokens)]
    n_passes = int(all_reduce(len(plan), "max"))
    dummy = TokenBatch.from_samples([Sample([pad_id], [pad_id], [0.0], False)], pad_id, tokens.input_ids.device)
    for k in range(n_passes):
        real = k < len(plan)
        idx = plan[k] if real else (plan[0] if plan else [])
        yield idx, (tokens.rows(idx) if idx else dummy), real


@torch.no_grad()
def forward_rows(forward: Callable[[TokenBatch], torch.Tensor], tokens: TokenBatch, cfg: DistflowConfig,
                 pad_id: int) -> torch.Tensor:
    """forward(micro-batch) -> [b, r] per response token, for every row: [B, R], in as many
    passes as any rank."""
    out = torch.zeros_like(tokens.resp_mask)
    for idx, mb, real in micro_batches(tokens, list(range(len(tokens))), cfg, pad_id):
        if real:
            rows = forward(mb)
            out[idx, : rows.shape[1]] = rows.to(out.dtype)
        else:
            forward(mb)
    return out


def response_logprobs(policy: Policy, tokens: TokenBatch, cfg: DistflowConfig, pad_id: int) -> torch.Tensor:
    """[B, R] response logprobs at the rollout temperature."""
    return forward_rows(lambda mb: policy.logprobs(mb, cfg.rollout.temperature), tokens, cfg, pad_id)


def _global_denominator(batches: list[tuple[list[int], TokenBatch, bool]], mask: torch.Tensor, mode: str) -> float:
    """The loss normaliser of the whole global mini-batch (summed over ranks), at least 1."""
    local = sum(aggregate_denominator(_cut(mask, idx, mb), mode) for idx, mb, real in batches if real)
    return max(float(all_reduce(local)), 1.0)


def _cut(per_token: torch.Tensor, idx: list[int], mb: TokenBatch) -> torch.Tensor:
    """The rows `idx` of a [B, R] tensor at the micro-batch's width."""
    return per_token[idx, : mb.resp_mask.shape[1]]


def backward_policy_loss(policy: Policy, batch: UpdateBatch, rows: list[int], cfg: DistflowConfig,
                         pad_id: int) -> UpdateSums:
    """Accumulate gradients of the global mini-batch loss over this rank's `rows` of `batch`;
    returns this rank's metric sums. `old` is the policy at the weights that sampled (the
    update's own forward when one optimizer step follows each rollout), so comparing it with the
    engine's logprobs measures the engine/trainer mismatch for free."""
    a, world = cfg.algorithm, torch.distributed.get_world_size()
    batches = list(micro_batches(batch.tokens, rows, cfg, pad_id))
    denom = _global_denominator(batches, batch.loss_mask, a.loss_agg_mode)
    sums = DeviceSums()
    real_passes = sum(real for _, _, real in batches)
    for k, (idx, mb, real) in enumerate(batches):
        policy.all_reduce_gradients(k == len(batches) - 1)
        logp, entropy = policy.forward(mb, cfg.rollout.temperature, with_entropy=a.entropy_coef != 0)
        if real:
            mask, adv = _cut(batch.loss_mask, idx, mb), _cut(batch.advantages, idx, mb)
            old = logp.detach() if batch.old_logprobs is CURRENT_POLICY else _cut(batch.old_logprobs, idx, mb)
            engine = _cut(batch.sampling_logprobs, idx, mb)
            ref = _cut(batch.ref_logprobs, idx, mb) if batch.ref_logprobs is not None else None
        else:  # a padding pass: zero weight, any finite inputs
            mask, adv, old = torch.zeros_like(logp), torch.zeros_like(logp), logp.detach()
            engine, ref = old, old
        token_loss, info = compute_token_loss(logp, old, adv, mask, a, engine_logp=engine, ref_logp=ref,
                                              entropy=entropy)
        num = aggregate_numerator(token_loss, mask, a.loss_agg_mode, cfg.rollout.response_budget())
        loss = num * (world / denom if real else 0.0)  # padding passes contribute nothing
        if policy.router is not None:  # the mean over this rank's passes; ranks are averaged as all gradients are
            loss = loss + policy.router.aux_loss * (policy.router_aux_loss_coef / real_passes if real else 0.0)
        loss.backward()
        if real and policy.router is not None:
            sums.add("moe_aux", policy.router.aux_loss)
            sums.add("moe_load", policy.router.load_max_over_mean)
            sums.add("moe_passes", torch.ones((), device=logp.device))
        if real:
            m = mask.bool()
            sums.add("loss", num.detach().double() / denom)
            sums.add("tokens", m.sum())
            sums.add_mismatch(mismatch_vector(old, engine, mask))
            for key in ("clip_low", "clip_high", "dual_clip", "kl", "entropy", "tis_weight"):
                if key in info:
                    sums.add(key, info[key].float()[m].sum())
    return UpdateSums.read(sums)


def backward_value_loss(critic: Critic, batch: UpdateBatch, rows: list[int], cfg: DistflowConfig,
                        pad_id: int) -> UpdateSums:
    """The critic's counterpart of backward_policy_loss: clipped value loss, aggregated with the
    algorithm's loss_agg_mode over the global mini-batch, same passes on every rank."""
    a, world = cfg.algorithm, torch.distributed.get_world_size()
    batches = list(micro_batches(batch.tokens, rows, cfg, pad_id))
    resp_mask = batch.tokens.resp_mask
    denom = _global_denominator(batches, resp_mask, a.loss_agg_mode)
    sums = DeviceSums()
    real_passes = sum(real for _, _, real in batches)
    for k, (idx, mb, real) in enumerate(batches):
        critic.all_reduce_gradients(k == len(batches) - 1)
        values = critic.values(mb)
        if real:
            mask, old, ret = _cut(resp_mask, idx, mb), _cut(batch.values, idx, mb), _cut(batch.returns, idx, mb)
        else:
            mask, old, ret = torch.zeros_like(values), values.detach(), values.detach()
        token_loss, info = value_loss(values, old, ret, mask, cfg.critic.value_clip)
        num = aggregate_numerator(token_loss, mask, a.loss_agg_mode, cfg.rollout.response_budget())
        (num * (world / denom if real else 0.0)).backward()
        if real:
            m = mask.bool()
            sums.add("value_loss", num.detach().double() / denom)
            sums.add("value_clipped", info["clipped"].sum())
            sums.add("value_sq_error", (info["error"] ** 2).sum())
            sums.add("value_sum", values.detach()[m].sum())
            sums.add("value_tokens", m.sum())
    return UpdateSums.read(sums)


def optimize(policy: Policy | None, critic: Critic | None, batch: UpdateBatch, cfg: DistflowConfig,
             pad_id: int) -> UpdateResult:
    """algorithm.ppo_epochs x optim.mini_batches optimizer steps over the rank's batch, of the
    policy (None: not trained this step, e.g. critic warm-up) and of the critic (if any).

    Mini-batch m is rows [m*n, (m+1)*n) of the batch on every rank; each model's step is dropped
    on all ranks when its loss or gradient norm is not finite on any (ShardedModel.step)."""
    o, a = cfg.optim, cfg.algorithm
    result = UpdateResult(passes=o.mini_batches * a.ppo_epochs, actor_skipped=policy is None)
    per_mini = -(-len(batch) // o.mini_batches)
    norms: dict[str, list[float]] = {"policy": [], "critic": []}
    for epoch in range(a.ppo_epochs):
        for m in range(o.mini_batches):
            rows = list(range(m * per_mini, min(len(batch), (m + 1) * per_mini)))
            for name, model, backward in (("policy", policy, backward_policy_loss),
                                          ("critic", critic, backward_value_loss)):
                if model is None:
                    continue
                sums = backward(model, batch, rows, cfg, pad_id)
                if epoch > 0:
                    sums.mismatch = MismatchSums()  # every row was measured in the first epoch
                result.sums += sums
                norm, taken = model.step(sums.loss if name == "policy" else sums.value_loss)
                norms[name].append(norm)
                result.nonfinite_skipped += not taken
    result.grad_norm = sum(norms["policy"]) / max(len(norms["policy"]), 1)
    result.critic_grad_norm = sum(norms["critic"]) / max(len(norms["critic"]), 1)
    return result
