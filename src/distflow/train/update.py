"""The update engine: forward passes over a rank's batch, and the loss passes over its mini-batches.

`Updater` is built once per run. It plans each batch once: micro-batches of the whole batch (the
logprob, reference and value passes) and of each mini-batch, padded rows or packed shared-prefix
rows (distflow.train.shared_prefix), every later pass reads the plan.

Sharding-invariance lives here. Every rank runs the same number of FSDP forward (and
backward) passes — the counts are agreed in one all_reduce(MAX) per plan and short ranks pad
with zero-weight passes, even a rank that has no samples at all (dynamic sampling can leave one
empty). The loss normaliser (token or sequence count) is summed over all ranks; each
micro-batch's loss is divided by it and multiplied by the world size (FSDP averages
gradients over ranks), which yields the gradient a single process would get on the whole
global mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from distflow.algorithms import aggregate_denominator, aggregate_numerator, compute_token_loss, value_loss
from distflow.algorithms.correction_metrics import CorrectionSums, correction_vector
from distflow.algorithms.correction_metrics import combine as combine_correction
from distflow.algorithms.mismatch import MismatchSums, mismatch_vector
from distflow.algorithms.mismatch import combine as combine_mismatch
from distflow.config import DistflowConfig
from distflow.distributed import all_reduce, rank_and_world
from distflow.distributed.devices import concrete
from distflow.sample import Sample
from distflow.train.batch import CURRENT_POLICY, TokenBatch, UpdateBatch
from distflow.train.critic import Critic
from distflow.train.policy import Policy
from distflow.train.shared_prefix import Batch, pack, plan_packed, row_tokens


@dataclass
class UpdateSums:
    """This rank's sums over its loss passes (policy and critic)."""

    loss: float = 0.0  # the policy loss, already divided by the global denominator
    tokens: float = 0.0  # tokens the policy loss trained on
    forward_tokens: float = 0.0  # tokens its passes fed the model: padding included, a shared prompt once
    clip_low: float = 0.0
    clip_high: float = 0.0
    dual_clip: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    value_loss: float = 0.0
    value_clipped: float = 0.0
    value_sq_error: float = 0.0
    value_sum: float = 0.0
    value_tokens: float = 0.0
    moe_aux: float = 0.0  # mixture-of-experts routers (distflow.train.router), per policy loss pass
    moe_load: float = 0.0
    moe_passes: float = 0.0
    mismatch: MismatchSums = field(default_factory=MismatchSums)  # engine vs policy, first epoch only
    correction: CorrectionSums = field(default_factory=CorrectionSums)  # the rollout correction, first epoch only

    @classmethod
    def read(cls, sums: "DeviceSums") -> "UpdateSums":
        values = sums.read()
        mismatch, correction = values.pop("mismatch", None), values.pop("correction", None)
        out = cls(**values)
        if mismatch is not None:
            out.mismatch = MismatchSums.from_values(mismatch)
        if correction is not None:
            out.correction = CorrectionSums(correction)
        return out

    def first_epoch_only(self) -> None:
        """Forget the measurements a later epoch repeats (every row was measured in the first)."""
        self.mismatch, self.correction = MismatchSums(), CorrectionSums()

    def __iadd__(self, other: "UpdateSums") -> "UpdateSums":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


class DeviceSums:
    """A loss pass's metric sums, kept on the device as float64 tensors (float32 sums widened, as
    Python's float() would) and read in one host sync per mini-batch, so the host is never
    stopped mid-update to wait for the device's micro-batches. `vectors` are measurement vectors
    (the engine mismatch, the rollout correction), each with its own way to combine."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.vectors: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_vector(self, key: str, vector: torch.Tensor,
                   combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.vectors[key] = combine(self.vectors[key], vector) if key in self.vectors else vector

    def read(self) -> dict:
        keys = list(self.sums)
        parts = ([torch.stack([self.sums[k] for k in keys])] if keys else []) + list(self.vectors.values())
        if not parts:
            return {}
        values = torch.cat(parts).tolist()  # the one host sync
        out: dict = dict(zip(keys, values[:len(keys)]))
        at = len(keys)
        for key, vector in self.vectors.items():
            out[key], at = values[at:at + len(vector)], at + len(vector)
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
    zero_gradient_skipped: int = 0  # optimizer steps not taken: the global gradient was exactly zero
    distill: list[float] | None = None  # distillation's per-rank sums (distflow.algorithms.distill), if any


def plan_micro_batches(lengths: list[int], size: int, token_budget: int = 0) -> list[list[int]]:
    """Row indices of each padded micro-batch, sequences of similar length together.

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


@dataclass(frozen=True)
class MicroBatch:
    """One forward (and backward) pass: `rows` of the rank's batch, in the order of `inputs`'
    outputs. A padding pass (real=False) repeats real inputs and must contribute nothing."""

    rows: list[int]
    inputs: Batch
    real: bool = True

    def cut(self, per_token: torch.Tensor) -> torch.Tensor:
        """This pass's rows of a [B, R] tensor, at its own width."""
        return per_token[self.rows, : self.inputs.resp_mask.shape[1]]


@dataclass(frozen=True)
class StepPlan:
    """A batch's micro-batches, planned once: the whole batch, and each mini-batch."""

    tokens: TokenBatch
    whole: list[MicroBatch]
    minis: list[list[MicroBatch]]


class Updater:
    """The update engine, built once per run: the loss settings, the response budget, how
    micro-batches are cut (padded rows, or packed rows sharing each group's prompt) and the pad
    id. `plan` cuts a batch once; the passes run over the plan."""

    def __init__(self, cfg: DistflowConfig, pad_id: int):
        o, a = cfg.optim, cfg.algorithm
        self.algorithm, self.value_clip = a, cfg.critic.value_clip
        self.temperature, self.response_budget = cfg.rollout.temperature, cfg.rollout.response_budget()
        self.micro_batch_size, self.token_budget = o.micro_batch_size, o.micro_batch_tokens
        self.mini_batches, self.epochs = o.mini_batches, a.ppo_epochs
        # decided once by the start-up plan (distflow.distributed.devices.shared_prefix); "auto" is refused
        self.shared_prefix = concrete("optim.shared_prefix", o.shared_prefix) == "on"
        self.pad_id = pad_id

    # --- planning -------------------------------------------------------------------------

    def mini_batch_rows(self, n: int) -> list[list[int]]:
        """Mini-batch m is rows [m*k, (m+1)*k) of the batch, on every rank."""
        per = -(-n // self.mini_batches)
        return [list(range(m * per, min(n, (m + 1) * per))) for m in range(self.mini_batches)]

    def plan(self, tokens: TokenBatch) -> StepPlan:
        """The micro-batches of the whole batch and of each mini-batch, their pass counts agreed
        across ranks in one all_reduce."""
        lists = [list(range(len(tokens)))] + self.mini_batch_rows(len(tokens))
        planned = self._agreed(tokens, lists)
        return StepPlan(tokens, planned[0], planned[1:])

    def micro_batches(self, tokens: TokenBatch, rows: list[int]) -> list[MicroBatch]:
        """The agreed micro-batches of `rows` alone (one all_reduce)."""
        return self._agreed(tokens, [rows])[0]

    def _agreed(self, tokens: TokenBatch, lists: list[list[int]]) -> list[list[MicroBatch]]:
        samples = row_tokens(tokens) if self.shared_prefix and len(tokens) else []
        planned = [self._cut(tokens, rows, samples) for rows in lists]
        counts = all_reduce([len(p) for p in planned], "max").long().tolist()
        return [self._pad(p, n, tokens.input_ids.device) for p, n in zip(planned, counts)]

    def _cut(self, tokens: TokenBatch, rows: list[int], samples) -> list[MicroBatch]:
        if not rows:
            return []
        if not self.shared_prefix:
            lengths = tokens.seq_len[rows].tolist()
            return [MicroBatch(idx, tokens.rows(idx))
                    for idx in ([rows[i] for i in mb] for mb in
                                plan_micro_batches(lengths, self.micro_batch_size, self.token_budget))]
        # the padded path's largest micro-batch, unless a budget is set
        budget = self.token_budget or self.micro_batch_size * max(len(samples[i].prompt) + len(samples[i].response)
                                                                  for i in rows)
        out = []
        for units in plan_packed(samples, rows, budget):
            order, packed = pack(samples, units, tokens.resp_mask, tokens.input_ids.device)
            out.append(MicroBatch(order, packed))
        return out

    def _pad(self, plan: list[MicroBatch], n: int, device: torch.device) -> list[MicroBatch]:
        """`plan` padded to n passes: the first micro-batch again, or a one-token dummy."""
        if plan:
            filler = MicroBatch(plan[0].rows, plan[0].inputs, False)
        else:
            dummy = Sample([self.pad_id], [self.pad_id], [0.0], False)
            filler = MicroBatch([], TokenBatch.from_samples([dummy], self.pad_id, device), False)
        return plan + [filler] * (n - len(plan))

    # --- forward passes over the whole batch ------------------------------------------------

    @torch.no_grad()
    def _forward_rows(self, forward: Callable[[Batch], torch.Tensor], micro: list[MicroBatch],
                      like: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(like)
        for mb in micro:
            rows = forward(mb.inputs)
            if mb.real:
                out[mb.rows, : rows.shape[1]] = rows.to(out.dtype)
        return out

    def logprobs(self, model, plan: StepPlan) -> torch.Tensor:
        """[B, R] response logprobs at the rollout temperature (a policy, or its frozen base)."""
        return self._forward_rows(lambda b: model.logprobs(b, self.temperature), plan.whole, plan.tokens.resp_mask)

    def values(self, critic: Critic, plan: StepPlan) -> torch.Tensor:
        """[B, R] the critic's values."""
        return self._forward_rows(critic.values, plan.whole, plan.tokens.resp_mask)

    # --- loss passes ----------------------------------------------------------------------

    def _denominator(self, micro: list[MicroBatch], mask: torch.Tensor) -> float:
        """The loss normaliser of the whole global mini-batch (summed over ranks), at least 1."""
        local = sum(aggregate_denominator(mb.cut(mask), self.algorithm.loss_agg_mode) for mb in micro if mb.real)
        return max(float(all_reduce(local)), 1.0)

    def backward_policy(self, policy: Policy, batch: UpdateBatch, rows: list[int],
                        micro: list[MicroBatch] | None = None) -> UpdateSums:
        """Accumulate gradients of the global mini-batch loss over this rank's `rows` of `batch`
        (cut as `micro`, planned here when not given); returns this rank's metric sums. `old` is
        the policy at the weights that sampled (the update's own forward when one optimizer step
        follows each rollout), so comparing it with the engine's logprobs measures the
        engine/trainer mismatch for free."""
        a, world = self.algorithm, rank_and_world()[1]  # FSDP's mesh
        micro = self.micro_batches(batch.tokens, rows) if micro is None else micro
        denom = self._denominator(micro, batch.loss_mask)
        sums = DeviceSums()
        real_passes = sum(mb.real for mb in micro)
        for k, mb in enumerate(micro):
            policy.all_reduce_gradients(k == len(micro) - 1)
            logp, entropy = policy.forward(mb.inputs, self.temperature, with_entropy=a.entropy_coef != 0)
            if mb.real:
                mask, adv = mb.cut(batch.loss_mask), mb.cut(batch.advantages)
                old = logp.detach() if batch.old_logprobs is CURRENT_POLICY else mb.cut(batch.old_logprobs)
                engine = mb.cut(batch.sampling_logprobs)
                ref = mb.cut(batch.ref_logprobs) if batch.ref_logprobs is not None else None
            else:  # a padding pass: zero weight, any finite inputs
                mask, adv, old = torch.zeros_like(logp), torch.zeros_like(logp), logp.detach()
                engine, ref = old, old
            token_loss, info = compute_token_loss(logp, old, adv, mask, a, engine_logp=engine, ref_logp=ref,
                                                  entropy=entropy, weight_scale=batch.is_weight_scale)
            num = aggregate_numerator(token_loss, mask, a.loss_agg_mode, self.response_budget)
            loss = num * (world / denom if mb.real else 0.0)  # padding passes contribute nothing
            if policy.router is not None:  # the mean over this rank's passes; ranks are averaged as all gradients are
                loss = loss + policy.router.aux_loss * (policy.router_aux_loss_coef / real_passes if mb.real else 0.0)
            loss.backward()
            if mb.real and policy.router is not None:
                sums.add("moe_aux", policy.router.aux_loss)
                sums.add("moe_load", policy.router.load_max_over_mean)
                sums.add("moe_passes", torch.ones((), device=logp.device))
            if mb.real:
                m = mask.bool()
                sums.add("loss", num.detach().double() / denom)
                sums.add("tokens", m.sum())
                sums.add("forward_tokens", torch.full((), float(mb.inputs.input_ids.numel()), device=logp.device))
                measured = mask if batch.mismatch_mask is None else mb.cut(batch.mismatch_mask)
                sums.add_vector("mismatch", mismatch_vector(old, engine, measured), combine_mismatch)
                lag = mb.cut(batch.token_lag) if batch.token_lag is not None else None
                sums.add_vector("correction", correction_vector(info["correction"], mask, self.response_budget, lag),
                                combine_correction)
                for key in ("clip_low", "clip_high", "dual_clip", "kl", "entropy"):
                    if key in info:
                        sums.add(key, info[key].float()[m].sum())
        return UpdateSums.read(sums)

    def backward_value(self, critic: Critic, batch: UpdateBatch, rows: list[int],
                       micro: list[MicroBatch] | None = None) -> UpdateSums:
        """The critic's counterpart of backward_policy: clipped value loss, aggregated with the
        algorithm's loss_agg_mode over the global mini-batch, same passes on every rank."""
        a, world = self.algorithm, rank_and_world()[1]  # FSDP's mesh
        micro = self.micro_batches(batch.tokens, rows) if micro is None else micro
        resp_mask = batch.tokens.resp_mask
        denom = self._denominator(micro, resp_mask)
        sums = DeviceSums()
        for k, mb in enumerate(micro):
            critic.all_reduce_gradients(k == len(micro) - 1)
            values = critic.values(mb.inputs)
            if mb.real:
                mask, old, ret = mb.cut(resp_mask), mb.cut(batch.values), mb.cut(batch.returns)
            else:
                mask, old, ret = torch.zeros_like(values), values.detach(), values.detach()
            token_loss, info = value_loss(values, old, ret, mask, self.value_clip)
            num = aggregate_numerator(token_loss, mask, a.loss_agg_mode, self.response_budget)
            (num * (world / denom if mb.real else 0.0)).backward()
            if mb.real:
                m = mask.bool()
                sums.add("value_loss", num.detach().double() / denom)
                sums.add("value_clipped", info["clipped"].sum())
                sums.add("value_sq_error", (info["error"] ** 2).sum())
                sums.add("value_sum", values.detach()[m].sum())
                sums.add("value_tokens", m.sum())
        return UpdateSums.read(sums)

    def optimize(self, policy: Policy | None, critic: Critic | None, batch: UpdateBatch,
                 plan: StepPlan) -> UpdateResult:
        """algorithm.ppo_epochs x optim.mini_batches optimizer steps over the rank's batch, of the
        policy (None: not trained this step, e.g. critic warm-up) and of the critic (if any).

        Each model's step is dropped on all ranks when its loss or gradient norm is not finite
        on any, or its gradient is exactly zero (ShardedModel.step)."""
        result = UpdateResult(passes=self.mini_batches * self.epochs, actor_skipped=policy is None)
        norms: dict[str, list[float]] = {"policy": [], "critic": []}
        rows = self.mini_batch_rows(len(batch))
        for epoch in range(self.epochs):
            for m, micro in enumerate(plan.minis):
                for name, model, backward in (("policy", policy, self.backward_policy),
                                              ("critic", critic, self.backward_value)):
                    if model is None:
                        continue
                    sums = backward(model, batch, rows[m], micro)
                    if epoch > 0:
                        sums.first_epoch_only()
                    result.sums += sums
                    norm, outcome = model.step(sums.loss if name == "policy" else sums.value_loss)
                    norms[name].append(norm)
                    result.nonfinite_skipped += outcome == "nonfinite"
                    result.zero_gradient_skipped += outcome == "zero_gradient"
        result.grad_norm = sum(norms["policy"]) / max(len(norms["policy"]), 1)
        result.critic_grad_norm = sum(norms["critic"]) / max(len(norms["critic"]), 1)
        return result
