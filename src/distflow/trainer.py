"""The GRPO loop, identical on every rank: generate -> score -> advantages -> update -> sync -> log.

There is no controller. Each rank samples its own prompts, generates all samples of a group
locally (so group statistics need no communication), and joins the others only through
FSDP's collectives and a few small all_reduces (global token counts, metrics).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoTokenizer

from distflow.algorithms import group_normalized_advantages
from distflow.checkpoint import Checkpointer, ModelOptimState, resolve_resume, rng_state, set_rng_state
from distflow.config import DistflowConfig
from distflow.data.prompts import PromptItem, load_prompts
from distflow.data.sampler import ShardedSampler
from distflow.distributed import barrier, broadcast_object, init_distributed, shutdown
from distflow.metrics import MetricLogger, reduce_step_metrics
from distflow.models.tiny import resolve_model_path
from distflow.policy import Policy, TokenBatch
from distflow.rewards.registry import load_reward
from distflow.rollout import Sample, build_engine
from distflow.rollout.weight_sync import full_parameters
from distflow.update import backward_policy_loss

log = logging.getLogger("distflow")


@dataclass
class Rollouts:
    """One step's local batch: samples in group-major order (group_size consecutive per prompt)."""

    items: list[PromptItem]
    samples: list[Sample]
    rewards: torch.Tensor | None = None  # [num_prompts, group_size]
    advantages: torch.Tensor | None = None  # [num_prompts * group_size]
    old_logprobs: list[torch.Tensor] | None = None  # per sample, when the update needs them


def sample_seed(*parts: int) -> int:
    """A 31-bit seed derived from (run seed, step, rank, index): reproducible and resumable."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Trainer:
    def __init__(self, cfg: DistflowConfig):
        self.cfg = cfg.validate()
        t = cfg.trainer
        # Order matters: process group, then engine (reuses it), then the FSDP policy.
        self.dist = init_distributed(t.backend, t.device, t.collective_timeout_s)
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        self.model_path = resolve_model_path(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.reward_fn = load_reward(cfg.task.reward)
        self.items = load_prompts(cfg.task, self.tokenizer, cfg.rollout.max_prompt_tokens)
        self.sampler = ShardedSampler(len(self.items), self.dist.rank, self.dist.world_size, t.seed, cfg.data.shuffle)
        self.engine = build_engine(self.model_path, cfg.model, cfg.rollout, self.dist.device, t.seed)
        self.policy = Policy(self.model_path, cfg.model, cfg.optim, self.dist.device, self.dist.world_size)
        self.engine_dtype = getattr(torch, cfg.model.dtype)
        self.checkpointer = Checkpointer(t.output_dir, t.keep_last, self.dist.rank)
        self.step = 0
        self.history: list[dict] = []  # every logged step, kept so a resume can rewrite metrics.jsonl
        self.resume()
        self.logger = MetricLogger(t.output_dir, self.dist.is_main, t.steps, t.progress_bar)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        t = self.cfg.trainer
        while self.step < t.steps:
            self.step += 1
            timing: dict[str, float] = {}
            t0 = time.perf_counter()
            with _timed(timing, "generate"):
                batch = self.generate()
            inject_fault(t.fault_inject, self.dist.rank, self.step)
            with _timed(timing, "reward"):
                self.score(batch)
            self.compute_advantages(batch)
            self.engine.sleep()
            with _timed(timing, "logprob"):
                self.compute_old_logprobs(batch)
            with _timed(timing, "update"):
                update_stats = self.update(batch)
            self.engine.wake_up()
            with _timed(timing, "sync"):
                self.sync_weights()
            with _timed(timing, "probe"):
                probe_diff = self.probe_sync(batch)
            timing["step"] = time.perf_counter() - t0
            metrics = self.step_metrics(batch, timing, update_stats, probe_diff)
            self.history.append(metrics)
            self.logger.log(metrics)
            if self.step == t.steps or (t.checkpoint_every and self.step % t.checkpoint_every == 0):
                self.save_checkpoint()
        if t.export_at_end:
            self.export(os.path.join(t.output_dir, "hf_model"))

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        rank_state = {"rng": rng_state(), "sampler": self.sampler.state_dict()}
        shared = {"history": self.history, "scheduler": self.policy.scheduler.state_dict(),
                  "model_path": self.model_path, "world_size": self.dist.world_size}
        self.checkpointer.save(self.step, ModelOptimState(self.policy.model, self.policy.optimizer), rank_state, shared)

    def resume(self) -> None:
        """Restore everything a checkpoint holds, then give the engine the restored weights."""
        t = self.cfg.trainer
        found = resolve_resume(t.resume, t.output_dir)
        path = broadcast_object(str(found) if found else None)  # rank 0's view of the filesystem decides
        if path is None:
            return
        rank_state, shared = self.checkpointer.load(Path(path), ModelOptimState(self.policy.model, self.policy.optimizer))
        self.policy.scheduler.load_state_dict(shared["scheduler"])
        self.sampler.load_state_dict(rank_state["sampler"])
        set_rng_state(rank_state["rng"])
        self.step, self.history = shared["step"], shared["history"]
        rewrite_metrics(t.output_dir, self.history, self.dist.is_main)
        self.sync_weights()
        log_main(self.dist.is_main, f"resumed from step {self.step} ({path})")

    def export(self, out_dir: str) -> None:
        """Collective: gathers full weights; rank 0 writes a plain HF folder."""
        from distflow.export import save_hf_folder

        full = get_model_state_dict(self.policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dist.is_main:
            save_hf_folder(self.model_path, full, out_dir)
        barrier()

    # ----------------------------------------------------------------- phases
    def generate(self) -> Rollouts:
        idx = self.sampler.next_indices(self.cfg.data.prompts_per_rank)
        items = [self.items[i] for i in idx]
        seeds = [sample_seed(self.cfg.trainer.seed, self.step, self.dist.rank, i) for i in idx]
        groups = self.engine.generate([it.prompt_ids for it in items], self.cfg.algorithm.group_size, seeds)
        return Rollouts(items, [s for g in groups for s in g])

    def score(self, batch: Rollouts) -> None:
        g = self.cfg.algorithm.group_size
        texts = self.tokenizer.batch_decode([s.response_ids for s in batch.samples], skip_special_tokens=True)
        rewards = []
        for i, (sample, text) in enumerate(zip(batch.samples, texts)):
            item = batch.items[i // g]
            fields = {"answer": item.answer, **item.fields}
            rewards.append(float(self.reward_fn(item.prompt_text, text, sample.response_ids, fields)))
        batch.rewards = torch.tensor(rewards, dtype=torch.float32).view(-1, g)

    def compute_advantages(self, batch: Rollouts) -> None:
        a = self.cfg.algorithm
        batch.advantages = group_normalized_advantages(batch.rewards, a.scale_rewards, a.eps).reshape(-1)

    def _needs_old_logprobs(self) -> bool:
        # With one optimizer step per rollout the policy that sampled is the one being trained,
        # so the ratio is 1 by construction and old logprobs are the detached current ones.
        return self.cfg.algorithm.ppo_epochs > 1 or self.cfg.optim.mini_batches > 1

    @torch.no_grad()
    def compute_old_logprobs(self, batch: Rollouts) -> None:
        if not self._needs_old_logprobs():
            return
        temp, size = self.cfg.rollout.temperature, self.cfg.optim.micro_batch_size
        batch.old_logprobs = []
        for i in range(0, len(batch.samples), size):
            mb = TokenBatch.from_samples(batch.samples[i : i + size], self.pad_id, self.dist.device)
            batch.old_logprobs += list(self.policy.logprobs(mb, temp))

    def update(self, batch: Rollouts) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps on this step's rollouts."""
        o = self.cfg.optim
        per_mini = len(batch.samples) // o.mini_batches
        totals: dict[str, float] = {}
        grad_norms = []
        for _ in range(self.cfg.algorithm.ppo_epochs):
            for lo in range(0, len(batch.samples), per_mini):
                hi = lo + per_mini
                old = batch.old_logprobs[lo:hi] if batch.old_logprobs is not None else None
                stats = backward_policy_loss(
                    self.policy, batch.samples[lo:hi], batch.advantages[lo:hi], old, self.cfg, self.pad_id
                )
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                grad_norms.append(self.policy.step())
        totals["loss"] /= len(grad_norms)
        totals["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return totals

    def sync_weights(self) -> None:
        bucket = self.cfg.rollout.sync_bucket_mib << 20
        self.engine.load_weights(full_parameters(self.policy.model, self.engine_dtype, bucket))

    @torch.no_grad()
    def probe_sync(self, batch: Rollouts) -> float:
        """Max |engine - policy| logprob on this step's sequences, after the resync."""
        n = min(self.cfg.trainer.sync_probe_seqs, len(batch.samples))
        if n == 0:
            return float("nan")
        seqs = [s.prompt_ids + s.response_ids for s in batch.samples[:n]]
        engine_lp = self.engine.prompt_logprobs(seqs)
        as_samples = [Sample(seq[:1], seq[1:], [], False) for seq in seqs]
        policy_lp = self.policy.logprobs(TokenBatch.from_samples(as_samples, self.pad_id, self.dist.device), 1.0)
        diff = 0.0
        for i, lp in enumerate(engine_lp):
            ref = policy_lp[i, : len(lp)].float().cpu()
            diff = max(diff, float((torch.tensor(lp) - ref).abs().max()))
        return diff

    # ----------------------------------------------------------------- metrics
    def step_metrics(self, batch: Rollouts, timing: dict[str, float], upd: dict[str, float], probe: float) -> dict:
        resp_lens = [len(s.response_ids) for s in batch.samples]
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
        sums = {
            "reward_sum": float(batch.rewards.sum()),
            "samples": float(len(batch.samples)),
            "resp_tokens": float(sum(resp_lens)),
            "truncated": float(sum(s.truncated for s in batch.samples)),
            "tokens": float(tokens),
            "loss/policy": upd["loss"],
            "clip_low": upd["clip_low"],
            "clip_high": upd["clip_high"],
            "trained_tokens": upd["tokens"],
        }
        maxima = {f"timing/{k}_s": v for k, v in timing.items()}
        maxima.update({"response_length/max": float(max(resp_lens)), "sync/max_abs_logprob_diff": probe})
        g = reduce_step_metrics(sums, maxima)
        n, trained = max(g["samples"], 1.0), max(g["trained_tokens"], 1.0)
        return {
            "step": self.step,
            "reward/mean": g["reward_sum"] / n,
            "response_length/mean": g["resp_tokens"] / n,
            "response_length/max": g["response_length/max"],
            "response/truncated_frac": g["truncated"] / n,
            **{k: v for k, v in g.items() if k.startswith("timing/")},
            "throughput/tokens_per_s": g["tokens"] / max(g["timing/step_s"], 1e-9),
            "sync/max_abs_logprob_diff": g["sync/max_abs_logprob_diff"],
            "loss/policy": g["loss/policy"],
            "clip/fraction_low": g["clip_low"] / trained,
            "clip/fraction_high": g["clip_high"] / trained,
            "grad_norm": upd["grad_norm"],
            "lr": self.policy.lr,
        }

    def close(self) -> None:
        self.logger.close()
        self.engine.shutdown()
        shutdown()


def inject_fault(spec: str, rank: int, step: int) -> None:
    """Test-only: trainer.fault_inject="RANK:STEP[:kill|raise]" fails that rank mid-step,
    on the first attempt only (torchrun restarts set TORCHELASTIC_RESTART_COUNT)."""
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    f_rank, f_step, *mode = spec.split(":")
    if int(f_rank) == rank and int(f_step) == step:
        if (mode or ["kill"])[0] == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def rewrite_metrics(output_dir: str, history: list[dict], is_main: bool) -> None:
    """On resume, metrics.jsonl becomes exactly the checkpoint's history: steps a killed run
    logged after its last checkpoint are dropped, so each step appears once."""
    if not is_main:
        return
    with open(os.path.join(output_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(m) + "\n" for m in history)


def log_main(is_main: bool, message: str) -> None:
    if is_main:
        print(f"distflow: {message}", flush=True)


class _timed:
    def __init__(self, out: dict[str, float], key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.out[self.key] = time.perf_counter() - self.t
