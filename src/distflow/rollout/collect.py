"""The rollout side of a rank as one component: the engine, the rank's data shard and the task's
workers, driven through `collect`, `evaluate`, `load_weights` and `sleep`.

A rank that only generates (the asynchronous roles) runs this without distflow.train: it takes
token ids and weights in, and hands out groups of samples with their pending rewards. Each round's
groups come from the source pipeline.mode picks (distflow.rollout.driver): one blocking engine
call per round (per turn with episodes), or the carry-over driver, which cuts the tail and carries
it to the next step. With dynamic sampling (DAPO) groups are scored at once, those whose rewards
are all equal are dropped, and every rank keeps generating until the GLOBAL number of kept groups
reaches the target or the round limit is hit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import torch

from distflow.algorithms import dynamic_sampling_keep
from distflow.config import DistflowConfig
from distflow.distributed import DistInfo, all_reduce
from distflow.rollout.balance import balance_groups
from distflow.rollout.carry import CarryBuffer
from distflow.rollout.driver import CarryoverDriver, SyncSource
from distflow.rollout.engines import build_engine
from distflow.rollout.episode_driver import EpisodeCarryover
from distflow.rollout.episodes import EpisodeRunner, SingleTurn
from distflow.rollout.evaluation import evaluate
from distflow.rollout.groups import Rollouts
from distflow.rollout.scoring import score_groups
from distflow.run.rundir import RunDir
from distflow.tasks import ShardedSampler

log = logging.getLogger("distflow")


class Rollout:
    def __init__(self, cfg: DistflowConfig, dist: DistInfo, task, tokenizer, model_path: str, engine_group, timer,
                 per_rank: int | None = None):
        """`task`: the run's Task (rows, workers, environment); `engine_group`: this rank's tensor-parallel
        group (ParallelLayout.engine_group); `timer`: the step's PhaseTimer; `per_rank`: groups per rank
        and round (default data.prompts_per_rank; a split run's rollout ranks share the trainers'). Builds
        the engine: every rank together (vLLM runs a collective)."""
        self.cfg, self.dist, self.task, self.tokenizer, self.timer = cfg, dist, task, tokenizer, timer
        self.per_rank = cfg.data.prompts_per_rank if per_rank is None else per_rank
        r = cfg.run
        self.items = task.rows("train")
        self.heldout = task.rows("heldout") if cfg.validation.wanted else []
        self.sampler = ShardedSampler(len(self.items), dist.rank, dist.world_size, r.seed, cfg.data.shuffle)
        self.scoring_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distflow-scoring")
        with timer.phase("startup:engine"):  # most of the start-up's memory and time
            self.engine = build_engine(model_path, cfg.model, cfg.rollout, dist.device, r.seed, engine_group)
        # single-turn generation, multi-turn episodes with the task's environment, or a harness's
        if cfg.task.agent:
            from distflow.rollout.agents.episodes import AgentRunner  # (FastAPI and uvicorn load only here)

            self.runner = AgentRunner(self.engine, tokenizer, cfg, task.harness, dist.local_rank, task.exclude)
        elif self.task.multi_turn:
            self.runner = EpisodeRunner(self.engine, self.task.workers, self.tokenizer, cfg.rollout,
                                        lockstep=cfg.rollout.tensor_parallel_size > 1)
        else:
            self.runner = SingleTurn(self.engine)
        self.carry = CarryBuffer(dist.rank, dist.world_size)  # checkpoint state in carry-over mode
        self.source = SyncSource(self.runner, r.seed, cfg.algorithm.group_size)
        if cfg.pipeline.mode == "carryover":
            self.source = EpisodeCarryover(self.engine, self.runner, cfg, self.carry,
                                           lambda p: self.items[self.sampler.item(p)]) \
                if self.task.multi_turn else CarryoverDriver(self.engine, cfg, self.carry)

    # ----------------------------------------------------------------- generation
    def rank_state(self) -> dict:
        """What a checkpoint keeps of this rank's rollout side: the data cursor, and the carried groups."""
        return {"sampler": self.sampler, **({"carry": self.carry} if self.cfg.pipeline.mode == "carryover" else {})}

    def collect(self, step: int) -> tuple[Rollouts, Future]:
        """Generate this step's groups, balance them across ranks, and start scoring; returns the
        rollouts and the pending rewards ([groups, G])."""
        return self.hand_over(self.gather(step))

    def gather(self, step: int) -> Rollouts:
        """This step's groups on this rank: its rounds of generation (with dynamic sampling, until the
        ranks together kept their quota or the round limit is hit)."""
        a, per_rank, phase = self.cfg.algorithm, self.per_rank, self.timer.phase
        kept = Rollouts(a.group_size)
        for r in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            with phase("generate"):
                part = self.generate(step, self.source.admits(step, per_rank, r == 0), per_rank)
            kept.stats.rounds += 1
            kept.stats.generated_groups += len(part.items)
            if not a.dynamic_sampling:
                kept = dataclasses.replace(part, stats=kept.stats)
                break
            with phase("reward"):
                part.rewards = self.score(part)
            kept.keep_groups(part, dynamic_sampling_keep(part.rewards))
            if int(all_reduce(len(kept.items))) >= per_rank * self.dist.world_size:
                break
        kept.stats.pipeline = self.source.end_step(step)  # carry-over: cut what still runs; the engine is empty
        if a.dynamic_sampling and kept.rewards is None:
            kept.rewards = torch.zeros((0, a.group_size))
        return kept

    def hand_over(self, kept: Rollouts) -> tuple[Rollouts, Future]:
        """Balance the groups across the ranks (a collective) and start scoring those not scored yet;
        returns them and the pending rewards ([groups, G])."""
        phase = self.timer.phase
        if self.cfg.run.balance_lengths:  # the update waits for the rank with the most tokens
            with phase("balance"):
                moved, kept.stats.balance = balance_groups(kept.groups(), kept.token_costs(), self.dist.device)
                kept.set_groups(moved)
        pending: Future = Future()
        if kept.rewards is not None:
            pending.set_result(kept.rewards)
        else:  # scored in the task's worker processes while the trainer computes logprobs
            pending = self.scoring_thread.submit(self.score, kept)
        return kept, pending

    def generate(self, step: int, n_prompts: int, quota: int) -> Rollouts:
        """A round: `n_prompts` new positions admitted, at least `quota` groups handed out."""
        positions = self.sampler.next_positions(n_prompts)
        items = [self.items[self.sampler.item(p)] for p in positions]
        log.debug(f"step {step} items (epoch, index): {json.dumps(self.sampler.last_positions)}")
        done = self.source.round(step, positions, items, quota)
        for position, group in zip(done.positions, done.groups):
            for s in group:
                s.position = position
        return Rollouts(self.cfg.algorithm.group_size, [self.items[self.sampler.item(p)] for p in done.positions],
                        [s for g in done.groups for s in g])

    def score(self, rollouts: Rollouts) -> torch.Tensor:
        rewards, failures = score_groups(self.task.workers, self.tokenizer, rollouts.items, rollouts.samples,
                                         self.cfg.algorithm.group_size)
        rollouts.stats.add_failures(failures)
        return rewards

    def evaluate(self, tag: str = "eval") -> dict[str, float]:
        """Held-out greedy pass@1 (and sampled pass@k), sharded over all ranks (a collective); with
        validation.save_samples, each rank's greedy answers go to validation/<tag>.rank<R>.jsonl."""
        samples = None
        if self.cfg.validation.save_samples:
            samples = RunDir(self.cfg.run.output_dir).validation / f"{tag}.rank{self.dist.rank}.jsonl"
        with self.timer.phase("validate"):
            return evaluate(self.runner, self.task.workers, self.tokenizer, self.heldout, self.dist,
                            self.cfg.validation.pass_k, seed=self.cfg.run.seed, samples_file=samples)

    # ----------------------------------------------------------------- the engine's weights
    @property
    def version(self) -> int:
        """The policy version the engine holds: optimizer steps it has seen."""
        return self.engine.version

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.engine.prompt_logprobs(seqs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                     keep_running: bool = False) -> None:
        """Replace the engine's weights from a stream of (HF name, full tensor); wakes it. `keep_running`:
        running requests go on under them (pipeline.kv_after_update=keep)."""
        self.engine.load_weights(weights, version, keep_running)

    def load_adapter(self, tensors: dict[str, torch.Tensor], config, version: int) -> None:
        """A LoRA policy's adapters only (model.lora.resync=adapter); wakes the engine."""
        self.engine.load_adapter(tensors, config, version)

    def sleep(self) -> None:
        """Free what the engine can for the update; the next load_weights/load_adapter wakes it."""
        self.engine.sleep()

    def close(self) -> None:
        self.scoring_thread.shutdown(wait=True)
        if hasattr(self.runner, "close"):  # an agent runner's endpoint and harness loop
            self.runner.close()
        self.engine.shutdown()
