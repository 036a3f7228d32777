"""The loop a rollout rank of a split run runs: generate each step's groups with the version the
staged schedule names, and send every trainer its share.

Targets go in order. Before generating target s the rank applies versions, one announce at a time,
until its engine holds s - 1 - eta (distflow.pipeline.schedule.engine_version); each version is
followed by its trainer's control message for that step (stop there: a signal, saved). A thread
receives the versions as the trainer broadcasts them (distflow.pipeline.weights.StagedVersions, up to
eta ahead of the engine's), so the trainer does not wait for the target in progress. So with
eta >= 1 the rank generates step s + eta while the trainers train step s, and with eta = 0 the two
roles take turns exactly as a sync run's phases do. The groups of a target go to the trainer that a
sync run on the trainers' count of ranks would have drawn them on (Roles.trainer_of), one message
per trainer, with this rank's data cursor for its publisher (checkpoint state on the trainers).

This rank holds no checkpoint state of its own: what it generated and sent is the trainers' to keep,
and a resume's first version carries its cursor and first target back.
"""

from __future__ import annotations

import logging
import time

import torch

from distflow.distributed import enter_scope, shutdown
from distflow.distributed.roles import RoleGroups
from distflow.errors import RunAborted
from distflow.metrics.timer import PhaseTimer
from distflow.pipeline.links import Links, error_line
from distflow.pipeline.schedule import engine_version
from distflow.pipeline.weights import StagedVersions, WeightReceiver
from distflow.probe import engine_gaps, largest_gap
from distflow.rollout import Rollout
from distflow.rollout.groups import Rollouts
from distflow.run.preemption import Stopped, StopSignal
from distflow.startup import Run
from distflow.tasks import Task

log = logging.getLogger("distflow")


class RolloutRank:
    def __init__(self, run: Run, stop_signal: StopSignal, groups: RoleGroups, observers: list | None = None):
        self.run, self.cfg, self.stop_signal, self.rank = run, run.cfg, stop_signal, groups.rank
        cfg, roles = run.cfg, groups.roles
        self.dist = groups.role_dist(run.dist)  # rank j of the R rollout ranks: its sampler and seeds
        self.timer = PhaseTimer(run.dist.device, cfg.logging.sync_timing, observers or [])
        self.trainers, self.roles = list(range(roles.trainers)), roles
        self.publisher = roles.publisher(self.rank)
        with self.timer.phase("startup"):
            self.task = Task.from_config(cfg.task, run.tokenizer, cfg.rollout.max_prompt_tokens)
            log.info(f"rollout rank {self.dist.rank} of {self.dist.world_size}: loading {cfg.model.path} into the "
                     f"{cfg.rollout.engine} engine; weights from trainer {self.publisher}")
            per_rank = cfg.data.prompts_per_rank * roles.trainers // roles.rollout_ranks
            self.rollout = Rollout(cfg, self.dist, self.task, run.tokenizer, run.plan.model_path,
                                   run.plan.layout.engine_group, self.timer, per_rank)
        timeout = cfg.run.collective_timeout_s
        self.links = Links(groups.link_group, self.rank, timeout)
        self.receiver = WeightReceiver(self.links, self.publisher, groups.weight_groups[self.publisher],
                                       run.dist.device, timeout)
        self.version, self.target = 0, 1
        self.probe_wanted: dict | None = None  # a probed version's sequences and policy logprobs
        self.probe_gap: float | None = None  # the largest gap measured since the last send
        self.stopped: Stopped | None = None
        self.ran_through = False  # every target generated and the trainers' last control taken
        self.retry: list[int] = []  # after a resume: positions to draw again first (distflow.pipeline.inflight)
        self.sent_at = time.perf_counter()  # the end of the last send: each target's share of wall time starts there

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        """Generate every target of the run (named as the trainer's, so the recipe runs either); an error
        here reaches the trainers as this rank's line instead of leaving them to wait out the deadline."""
        p = self.cfg.pipeline
        self.versions = StagedVersions(self.receiver, self.cfg.run.steps, self.cfg.run.collective_timeout_s,
                                       p.versions_ahead, host=p.staging == "host")
        try:
            self.generate()
            self.ran_through = self.stopped is None
        except RunAborted:
            raise
        except Exception as e:
            self.links.abort(self.trainers, f"{error_line(self.rank, e)}; stopped generating step {self.target}")
            raise

    def generate(self) -> None:
        """The staged schedule's targets, one after another (see the module docstring)."""
        eta, steps = self.cfg.pipeline.max_staleness, self.cfg.run.steps
        if self.run.resume.checkpoint is not None:
            self.resume()
        while self.target <= steps:
            while self.version < engine_version(self.target, eta):
                if not self.advance():
                    return
            self.timer.new_step(self.target)
            first = self.rollout.sampler.state_dict()["offset"]  # the step's first stream position
            start = time.perf_counter()
            kept = self.rollout.gather(self.target)
            self.send(self.target, kept, first, generate_s=time.perf_counter() - start)
            self.target += 1
        while self.version < steps:  # the trainers' last versions and their controls
            if not self.advance():
                return

    def resume(self) -> None:
        """The version the trainers resumed with, this rank's data cursor and its first target."""
        first, tensors = self.versions.wait()
        self.apply(first, tensors)
        self.start_from(first)

    def start_from(self, first: dict) -> None:
        """Where a resume goes on: the data cursor and first target its first announce carries."""
        cursor = dict(first["cursor"])
        self.retry = cursor.pop("retry", [])  # positions drawn before the cursor, not trained (pipeline.late)
        self.rollout.sampler.load_state_dict(cursor)
        self.target = first["next"]
        log.info(f"resumed at version {self.version}: generating from step {self.target}")

    def advance(self) -> bool:
        """The next version and its step's control message; False when the run stops there (a control
        may also come alone: the trainers stopped before their first step)."""
        while (item := self.versions.wait())[0]["kind"] == "weights":
            self.apply(*item)
        goes_on = self.goes_on(item[0])
        self.answer_probe()  # the engine holds the control's version (if it came with weights), nothing runs
        return goes_on

    def goes_on(self, control: dict) -> bool:
        """Whether the run goes on after a control message (else it stopped there: a signal, saved); a
        probed version's sequences and policy logprobs wait for `answer_probe`."""
        if control.get("probe") is not None:
            self.probe_wanted = control["probe"]
        if control["halt"]:
            self.stopped = Stopped(control["step"], None, self.stop_signal.name or "a signal to another rank")
            log.warning(f"{self.stopped.signal}: the trainers stopped after step {control['step']}; "
                        "relaunch with the same run.output_dir to resume")
            return False
        return True

    def answer_probe(self) -> None:
        """The engine/policy gap on the probed version's sequences, if the engine holds that version (call
        it with nothing running); it leaves with the next groups (distflow.pipeline.split_trainer.RemoteProbe)."""
        wanted = self.probe_wanted
        if wanted is None or self.rollout.engine.version != wanted["version"]:
            return
        # every probed version comes to every rank, with no sequences where its trainer had none: the ranks
        # of a tensor-parallel engine call it together
        gaps = engine_gaps(self.rollout, wanted["seqs"], [torch.tensor(lp) for lp in wanted["logprobs"]])
        if wanted["seqs"]:
            self.probe_gap = max(self.probe_gap or 0.0, largest_gap(gaps))
        self.probe_wanted = None

    def apply(self, announce: dict, tensors: list | None) -> None:
        """A version as staged: its weights into the engine (None: announced without them)."""
        if tensors is not None:
            with self.timer.phase("receive"):
                self.load(announce, tensors)
        self.version = announce["version"]

    def load(self, announce: dict, tensors: list, keep_running: bool = False) -> None:
        """A received version into the engine: the full weights, or a LoRA policy's adapters (the announce
        then carries their PEFT config: model.lora.resync=adapter)."""
        if announce.get("adapter") is not None:
            self.rollout.load_adapter(dict(tensors), announce["adapter"], announce["version"])
        else:
            self.rollout.load_weights(tensors, announce["version"], keep_running)

    def send(self, target: int, kept: Rollouts, first: int, generate_s: float, cursor: dict | None = None,
             counts: dict[str, int] | None = None) -> None:
        """Each trainer its groups of `target` (whose stream positions start at `first`); its publisher
        also this rank's counts, its data cursor (`cursor`: the sampler's just after it drew `target`'s
        positions; None: now), and the seconds since the previous send with the part of them it
        generated (the rest it waited for weights or sent: `rollout/idle_ratio`), and `counts` summed
        over the rollout ranks (inflight: tokens prefilled again, groups retargeted or dropped)."""
        cursor = self.rollout.sampler.state_dict() if cursor is None else cursor
        g = self.cfg.algorithm.group_size
        shares: dict[int, list] = {t: [] for t in self.trainers}
        for i in range(len(kept.items)):
            samples = kept.samples[i * g:(i + 1) * g]
            rewards = kept.rewards[i].tolist() if kept.rewards is not None else None
            shares[self.roles.trainer_of(samples[0].position, first)].append((samples[0].position, samples, rewards))
        now = time.perf_counter()
        stats = {"generated_groups": kept.stats.generated_groups, "reward_failures": kept.stats.reward_failures,
                 "wall_s": now - self.sent_at, "generate_s": generate_s,
                 **{k: float(v) for k, v in (counts or {}).items()}}
        signal = self.stop_signal.name is not None
        for t in self.trainers:
            mine = t == self.publisher
            self.links.send(t, {"kind": "groups", "target": target, "first": first, "groups": shares[t],
                                "rounds": kept.stats.rounds,
                                "stats": stats if mine else None,
                                "cursor": cursor if mine else None, "signal": signal,
                                "probe": self.probe_gap if mine else None})
        self.probe_gap = None
        self.sent_at = now

    def close(self) -> None:
        self.stop_signal.uninstall()
        if hasattr(self, "versions"):
            self.versions.close()
        if hasattr(self, "links") and self.ran_through:  # else the trainers stopped (a signal, an error) and will
            self.links.flush()  # take no more groups: what this rank sent ahead is left behind, not waited for
        if hasattr(self, "rollout"):
            self.rollout.close()
        if hasattr(self, "task"):
            self.task.close()
        if self.run.dist.owns_group:
            shutdown()
        enter_scope(None)  # this process's next run (tests, notebooks) starts on the whole world again
        self.run.run_dir.unlock()
