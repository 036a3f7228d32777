"""From a step's typed records to its metric keys: what the run reports, decided in one place.

The phases return records of per-rank sums (`RolloutStats`, `UpdateResult`), gathered in a
`StepRecord`; `step_report`
reduces them over ranks in two all_reduces (sums; maxima with minima folded in) and turns
them into the metric keys this run has (KL keys only with KL on, value keys only with a
critic, ...). The trainer never names a metric key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from distflow.algorithms import distill
from distflow.algorithms.correction_metrics import MAXIMA, correction_metrics
from distflow.algorithms.mismatch import EDGES, percentile
from distflow.config import DistflowConfig
from distflow.distributed import rank_and_world
from distflow.rollout.episodes import AGENT_COUNTS, episode_sums
from distflow.rollout.groups import Rollouts
from distflow.rollout.schedule import staleness
from distflow.rollout.scoring import REWARD_FAILURES
from distflow.metrics.loggers import MetricLogger, reduce_step_metrics
from distflow.run.rundir import RunDir
from distflow.train.model_rewards import model_reward_metrics
from distflow.train.update import UpdateResult

log = logging.getLogger("distflow")


@dataclass(frozen=True)
class StepRecord:
    """What a step produced, as the phases returned it; the report reads the parts present."""

    step: int
    rollouts: Rollouts  # the kept groups (their samples and counts)
    rewards: torch.Tensor  # [groups, G]
    update: UpdateResult
    timing: dict[str, float]
    lr: float
    probe: float | None = None  # max |engine - policy| logprob after the resync; None: not probed
    model_sums: dict[str, float] = field(default_factory=dict)  # reward models' and judges' raw-score sums


def step_report(cfg: DistflowConfig, rec: StepRecord) -> dict[str, float]:
    """The step's metrics, identical on every rank (a collective: every rank calls it)."""
    a = cfg.algorithm
    step, samples, rewards, groups = rec.step, rec.rollouts.samples, rec.rewards, len(rec.rollouts.items)
    stats, upd, timing, lr = rec.rollouts.stats, rec.update, rec.timing, rec.lr
    probe = float("nan") if rec.probe is None else rec.probe
    s = upd.sums
    resp_lens = [len(x.response_ids) for x in samples] or [0]
    sums = {
        "reward_sum": float(rewards.sum()),
        "samples": float(len(samples)),
        "resp_tokens": float(sum(resp_lens)),
        "truncated": float(sum(x.truncated for x in samples)),
        "tokens": float(sum(len(x.prompt_ids) + len(x.response_ids) for x in samples)),
        "kept_groups": float(groups),
        "generated_groups": float(stats.generated_groups),
        **{f"reward/{k}": v for k, v in stats.reward_failures.items()},
        **{f"upd/{f.name}": getattr(s, f.name) for f in fields(s) if f.name not in ("mismatch", "correction")},
        "mismatch/abs_sum": s.mismatch.abs_sum, "mismatch/kl_sum": s.mismatch.kl_sum,
        "mismatch/tokens": s.mismatch.tokens, **{f"mismatch/hist{k}": c for k, c in enumerate(s.mismatch.hist)},
        **{f"rollout_corr/v{k}": v for k, v in enumerate(s.correction.values) if k not in MAXIMA},
    }
    if cfg.task.env or cfg.task.agent:
        sums.update(episode_sums(samples))
    # distillation's sums (every rank has them; the max entry joins the maxima)
    teacher = (upd.distill or distill.no_sums()) if a.needs_teacher else []
    sums.update({f"distill/v{k}": v for k, v in enumerate(teacher) if k != distill.MAX})
    sums.update(rec.model_sums)  # every rank runs every reward model and judge: the same keys
    stale = cfg.pipeline.mode != "sync"  # carry-over and split runs train tokens of older versions
    carryover = cfg.pipeline.mode == "carryover"  # (and carry-over cuts groups: its partial/* counts)
    ages = token_ages(step, samples) if stale else []
    if stale:
        sums.update(carryover_sums(ages, stats.pipeline))
    if cfg.pipeline.mode == "split":  # each trainer has its rollout set's seconds: summed, every rollout rank once
        sums.update({k: stats.pipeline.get(k, 0.0) for k in SPLIT_SUMS})
    timing = with_compute(timing)
    maxima = {f"timing/{k}_s": v for k, v in timing.items()}
    maxima.update({"timing/slowest_rank": slowest_rank_code(timing["compute"]),
                   "response_length/max": float(max(resp_lens)), "sync/max_abs_logprob_diff": probe,
                   "dynamic_sampling/rounds": float(stats.rounds), "mismatch/abs_max": s.mismatch.abs_max,
                   **{f"rollout_corr/v{k}": s.correction.values[k] for k in MAXIMA},
                   **({f"distill/v{distill.MAX}": teacher[distill.MAX]} if teacher else {}),
                   **gpu_memory()})
    if stale:
        maxima.update({"staleness/max": float(max(ages, default=0)),
                       "timing/reprefill_s": stats.pipeline.get("reprefill_s", 0.0)})
    g = reduce_step_metrics(sums, maxima, {f"timing/{k}_min_s": v for k, v in timing.items()})
    g["timing/slowest_rank"] = float(int(g["timing/slowest_rank"]) % rank_and_world()[1])
    n, trained = max(g["samples"], 1.0), max(g["upd/tokens"], 1.0)
    out = {
        "step": step,
        "reward/mean": g["reward_sum"] / n,
        "response_length/mean": g["resp_tokens"] / n,
        "response_length/max": g["response_length/max"],
        "response/truncated_frac": g["truncated"] / n,
        **{k: v for k, v in g.items() if k.startswith(("timing/", "memory/"))},
        "throughput/tokens_per_s": g["tokens"] / max(g["timing/step_s"], 1e-9),
        # per phase, over the slowest rank's phase time: generated tokens while generating; every token the
        # update trained on (prompt and response, once per PPO epoch) while updating
        "throughput/generate_tokens_per_s": g["resp_tokens"] / max(g.get("timing/generate_s", 0.0), 1e-9),
        "throughput/update_tokens_per_s": g["tokens"] * a.ppo_epochs / max(g.get("timing/update_s", 0.0), 1e-9),
        "sync/max_abs_logprob_diff": g["sync/max_abs_logprob_diff"],
        "loss/policy": g["upd/loss"] / upd.passes,
        "clip/fraction_low": g["upd/clip_low"] / trained,
        "clip/fraction_high": g["upd/clip_high"] / trained,
        "grad_norm": upd.grad_norm,
        "lr": lr,
        **{f"reward/{k}": g[f"reward/{k}"] for k in REWARD_FAILURES},
        "update/nonfinite_skipped": float(upd.nonfinite_skipped),
        "update/zero_gradient_skipped": float(upd.zero_gradient_skipped),
        # what the policy's loss passes fed the model, all ranks and epochs: padded rows count their
        # padding, packed rows (optim.shared_prefix) each group's prompt once
        "update/forward_tokens": g["upd/forward_tokens"],
        **mismatch_metrics(g),
        **correction_metrics([g[f"rollout_corr/v{k}"] for k in range(len(s.correction.values))]),
    }
    if a.dual_clip_c is not None:
        out["clip/fraction_dual"] = g["upd/dual_clip"] / trained
    if a.needs_reference:
        out["loss/kl"] = g["upd/kl"] / trained
    if a.entropy_coef != 0:
        out["loss/entropy"] = g["upd/entropy"] / trained
    if g["upd/moe_passes"] > 0:  # a mixture-of-experts policy (distflow.train.router)
        out["moe/aux_loss"] = g["upd/moe_aux"] / g["upd/moe_passes"]
        out["moe/load_max_over_mean"] = g["upd/moe_load"] / g["upd/moe_passes"]
    if cfg.has_critic:
        values = max(g["upd/value_tokens"], 1.0)
        out["value/loss"] = g["upd/value_loss"] / upd.passes
        out["value/clip_fraction"] = g["upd/value_clipped"] / values
        out["value/mean"] = g["upd/value_sum"] / values
        out["value/rmse"] = (g["upd/value_sq_error"] / values) ** 0.5
        out["critic/grad_norm"] = upd.critic_grad_norm
        out["update/actor_skipped"] = float(upd.actor_skipped)
    scorers = [f"reward_model/{m.name}" for m in cfg.task.reward_model_specs] + \
        [f"judge/{j.name}" for j in cfg.task.judge_specs]
    out.update(model_reward_metrics(g, scorers))
    if teacher:
        out.update(distill.distill_metrics([g[f"distill/v{k}"] for k in range(distill.SIZE)]))
    if cfg.task.env or cfg.task.agent:  # episodes: per episode, or summed over ranks
        out.update({"turns/mean": g["turns"] / n, "response_length/generated_mean": g["generated"] / n})
    if cfg.task.env:
        out.update({"tool/calls": g["tool_calls"], "tool/errors": g["tool_errors"],
                    "tool/timeouts": g["tool_timeouts"]})
    if cfg.task.agent:
        out.update({**{f"agent/{k}": g[k] for k in AGENT_COUNTS}, "agent/requests_mean": g["requests"] / n})
    if cfg.run.balance_lengths:
        out.update({f"balance/{k}": v for k, v in stats.balance.items()})
    if stale:  # token-weighted over the trained groups' generated tokens, as verl's staleness keys
        out.update({"staleness/mean": g["staleness_sum"] / max(g["staleness_tokens"], 1.0),
                    "staleness/max": g["staleness/max"],
                    **({f"partial/{k}": g[f"partial/{k}"] for k in PARTIAL_KEYS} if carryover else {})})
    if cfg.pipeline.mode == "split":  # the rollout ranks' time not spent generating (waiting for weights, sending)
        # at least 1 ms of wall: an inflight rank sends a target finished with the one before it at once
        wall = g["rollout_wall_s"]
        out["rollout/idle_ratio"] = max(wall - g["rollout_generate_s"], 0.0) / max(wall, 1e-3)
        if cfg.pipeline.apply == "inflight":  # prompts and responses prefilled again under a version applied
            out["partial/reprefill_tokens"] = g["rollout_reprefill_tokens"]
        if cfg.pipeline.late != "wait":  # groups moved to the next step, or dropped, when their step was due
            out["partial/late_groups"] = g["rollout_late_groups"]
    if a.dynamic_sampling:
        out["dynamic_sampling/kept_groups"] = g["kept_groups"]
        out["dynamic_sampling/generated_groups"] = g["generated_groups"]
        out["dynamic_sampling/rounds"] = g["dynamic_sampling/rounds"]
        out["update/skipped"] = float(upd.skipped)
    return out


PARTIAL_KEYS = ("carried_groups", "carried_tokens", "reprefill_tokens", "forced_groups")
# the rollout ranks' stats (without the prefix: distflow.pipeline.rollout_rank.RolloutRank.send), summed
SPLIT_SUMS = ("rollout_wall_s", "rollout_generate_s", "rollout_reprefill_tokens", "rollout_late_groups")


def token_ages(step: int, samples: list) -> list[int]:
    """Each generated token's staleness: versions between the engine's at this step (step - 1) and its own."""
    return staleness(step, [v for x in samples for v in (x.versions or [])])


def carryover_sums(ages: list[int], pipeline: dict[str, float]) -> dict[str, float]:
    """This rank's carry-over counts (distflow.rollout.driver) and its tokens' staleness (`ages`,
    token_ages), to be summed."""
    return {"staleness_sum": float(sum(ages)), "staleness_tokens": float(len(ages)),
            **{f"partial/{k}": pipeline.get(k, 0.0) for k in PARTIAL_KEYS}}


def mismatch_metrics(g: dict[str, float]) -> dict[str, float]:
    """The engine/trainer mismatch keys from the summed histogram (distflow.algorithms.mismatch)."""
    tokens = max(g["mismatch/tokens"], 1.0)
    hist = [g[f"mismatch/hist{k}"] for k in range(len(EDGES) + 1)]
    return {"mismatch/abs_mean": g["mismatch/abs_sum"] / tokens, "mismatch/abs_p99": percentile(hist, 0.99),
            "mismatch/abs_max": g["mismatch/abs_max"], "mismatch/kl": g["mismatch/kl_sum"] / tokens}


def with_compute(timing: dict[str, float]) -> dict[str, float]:
    """The phase times plus wait (seconds blocked in distflow's collectives, 0 if not measured)
    and compute = step - wait: the part of the step that was this rank's own work."""
    out = {**timing, "wait": timing.get("wait", 0.0)}
    out["compute"] = max(out.get("step", 0.0) - out["wait"], 0.0)
    return out


def slowest_rank_code(compute_s: float) -> float:
    """This rank's compute time in whole milliseconds with its rank number folded in, so that the
    maxima's all_reduce alone finds the slowest rank: max(code) % world is its rank (ties go to the
    highest rank). float64 holds it exactly below 2**53 / world ms (centuries per step)."""
    rank, world = rank_and_world()
    return float(round(compute_s * 1000.0) * world + rank)


class StragglerWatch:
    """Names a rank that is the slowest (most compute time, waits excluded) for `steps`
    consecutive steps and at least `margin` slower than the fastest: on a cluster a slow node
    (thermal throttling, a bad link, a noisy neighbour) holds every step back, and the metric
    alone is easy to miss. One warning per streak; steps=0 turns it off."""

    def __init__(self, steps: int, margin: float = 0.1):
        self.steps, self.margin = steps, margin
        self.rank, self.streak = -1, 0

    def observe(self, metrics: dict[str, float]) -> str | None:
        rank = int(metrics.get("timing/slowest_rank", -1))
        slow, fast = metrics.get("timing/compute_s", 0.0), metrics.get("timing/compute_min_s", 0.0)
        if rank < 0 or slow <= fast * (1 + self.margin):
            self.rank, self.streak = -1, 0
            return None
        self.streak = self.streak + 1 if rank == self.rank else 1
        self.rank = rank
        if self.steps and self.streak == self.steps:
            return (f"rank {rank} was the slowest for {self.streak} consecutive steps (last step: {slow:.2f} s of "
                    f"its own work vs {fast:.2f} s on the fastest rank); every rank waits for it")
        return None


def gpu_memory() -> dict[str, float]:
    """On CUDA: the step's peak of torch's allocator on this rank's GPU (policy, engine tensors the
    allocator serves, activations) and the device's whole use at the end of the step (vLLM's pools
    and NCCL included), in GiB; then the peak is reset for the next step. Nothing on CPU."""
    if not torch.cuda.is_initialized():
        return {}
    free, total = torch.cuda.mem_get_info()
    out = {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "memory/device_used_gib": (total - free) / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return out


def run_summary(steps: int, wall_s: float, world_size: int, evaluations: dict[str, dict],
                last_metrics: dict) -> dict:
    """summary.json's content: held-out pass@1 before/after (when evaluated) and the last reward."""
    summary: dict = {"steps": steps, "wall_s": wall_s, "world_size": world_size}
    for when in ("before", "after"):
        if when in evaluations:
            summary[f"heldout_pass1_{when}"] = evaluations[when]["val/pass@1"]
            summary["heldout_items"] = int(evaluations[when]["val/items"])
            if "val/tool_calls" in evaluations[when]:  # multi-turn: how the greedy episodes went
                summary[f"heldout_turns_{when}"] = evaluations[when]["val/turns"]
                summary[f"heldout_tool_calls_{when}"] = evaluations[when]["val/tool_calls"]
    if "before" in evaluations and "after" in evaluations:
        summary["heldout_pass1_delta"] = summary["heldout_pass1_after"] - summary["heldout_pass1_before"]
    if last_metrics:
        summary["final_reward_mean"] = last_metrics["reward/mean"]
    return summary


class Reporter:
    """The run's metrics as one component: each step's record turned into metric keys (a collective),
    logged by rank 0, a lagging rank named, and the run's summary at the end.

    `metrics` is a collective; `log` and `finish` hold none (rank 0 writes, every rank reads the
    reduced metrics). The trainer runs `log` under `one_rank_may_fail`, so an error there stops every
    rank with its line; `finish` is left alone: nothing collective follows it, rank 0's error (a
    RunAborted naming the file) is the job's and the other ranks have finished."""

    def __init__(self, cfg: DistflowConfig, run_dir: RunDir, is_main: bool, world_size: int, record: dict,
                 resumed_step: int = 0):
        """`record`: the config record the loggers keep (W&B's run config)."""
        self.cfg, self.world_size = cfg, world_size
        self.logger = MetricLogger(run_dir, is_main, cfg.run.steps, cfg.logging, record, resumed_step=resumed_step)
        self.stragglers = StragglerWatch(cfg.logging.straggler_warn_steps)

    def metrics(self, record: StepRecord) -> dict[str, float]:
        return step_report(self.cfg, record)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0 writes the step's row; a failed write into the run folder is noted, not raised
        (distflow.run.output), and stops every rank at the step's end."""
        self.logger.log(metrics)
        if note := self.stragglers.observe(metrics):
            log.warning(f"step {step}: {note}")

    def finish(self, step: int, wall_s: float, evaluations: dict[str, dict], last_metrics: dict) -> None:
        """summary.json and the plots."""
        summary = run_summary(step, wall_s, self.world_size, evaluations, last_metrics)
        self.logger.finish(summary, plots=self.cfg.logging.plot_at_end)

    def close(self) -> None:
        self.logger.close()
