"""A trainer's rollout in a split run: the step's groups arrive from the rollout ranks.

It stands where a sync run's `Rollout` stands in the trainer's loop (collect, load_weights, sleep,
rank_state), so the loop is the same: `collect(s)` receives the groups targeted at step s from every
rollout rank (one message each, possibly empty), orders them by stream position and hands them to
the local Rollout's `hand_over` (balance over the trainers, then scoring); `load_weights` publishes
the version to this trainer's rollout set. Trainer t trains the positions a sync run on T ranks
gives rank t (Roles.trainer_of), so at eta = 0 its batch is that run's rank t's, bit for bit.

Groups already generated for later steps are data a checkpoint keeps: `state_dict` receives the
targets the checkpoint's step leaves in flight (distflow.pipeline.schedule.held_targets) and writes
them with each rollout rank's data cursor; a resume hands the cursors back with the first version.
A resume on another number of trainers deals the held groups anew (`load_pooled`).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from distflow.config import ConfigError, DistflowConfig
from distflow.distributed.roles import RoleGroups
from distflow.errors import RunAborted
from distflow.metrics.report import SPLIT_SUMS
from distflow.pipeline.links import Links, received
from distflow.pipeline.schedule import dealt_retries, held_targets, weights_needed
from distflow.pipeline.weights import WeightPublisher
from distflow.rollout import Rollout
from distflow.rollout.groups import RolloutStats, Rollouts
from distflow.sample import sample_from_data, sample_to_data


class RemoteRollout:
    def __init__(self, cfg: DistflowConfig, local: Rollout, groups: RoleGroups):
        """`local`: this trainer's own Rollout (its engine stays asleep; its task scores, its balance
        runs over the trainers); `groups`: the split's process groups."""
        roles, self.rank = groups.roles, groups.rank
        self.roles, self.local, self.cfg = roles, local, cfg
        self.eta, self.steps, self.group_size = cfg.pipeline.max_staleness, cfg.run.steps, cfg.algorithm.group_size
        self.links = Links(groups.link_group, self.rank, cfg.run.collective_timeout_s)
        self.rollout_set = roles.rollout_set(self.rank)
        self.publisher = WeightPublisher(self.links, self.rank, self.rollout_set,
                                         groups.weight_groups.get(self.rank), cfg.run.collective_timeout_s)
        self.sources = list(range(roles.trainers, roles.world_size))  # every rollout rank, one message per step
        self.inbox: dict[int, list[dict]] = {}  # target -> the messages of a step received before it
        self.cursors: dict[int, dict] = {}  # rollout rank of this trainer's set -> its sampler after its last send
        self.resumed = False  # the first version after a resume carries the cursors back
        self.step = 0
        self.signalled = False  # a rollout rank got SIGTERM/SIGUSR1: the run saves and stops at this step's end
        self.aborted = False  # this trainer forwarded an error: its rollout set stops, taking nothing more
        self.probe_out: dict | None = None  # a probed version's sequences and policy logprobs, for the next control
        self.probe_in: float | None = None  # the largest engine/policy gap this trainer's rollout set sent back
        local.sleep()  # the rollout ranks generate: this engine only keeps vLLM's start-up symmetric

    @property
    def items(self) -> list:
        return self.local.items

    def rank_state(self) -> dict:
        return {"pipeline": self}

    # ----------------------------------------------------------------- groups in
    def collect(self, step: int) -> tuple[Rollouts, Future]:
        self.step = step
        with self.local.timer.phase("recv_wait"):  # timing/recv_wait_s: blocked until the step's groups came
            messages = self.inbox.pop(step) if step in self.inbox else self._receive(step)
        return self.local.hand_over(self._merge(messages))

    def _receive(self, target: int) -> list[dict]:
        messages = []
        for src in self.sources:
            m = received(self.links.recv(src, f"the groups of step {target}"))
            if m["target"] != target:
                raise RunAborted(f"rank {src} sent the groups of step {m['target']} where step {target}'s were due")
            if src in self.rollout_set:
                self.cursors[src] = m["cursor"]
                if m.get("probe") is not None:
                    self.probe_in = max(self.probe_in or 0.0, m["probe"])
            self.signalled |= m["signal"]
            messages.append(m)
        return messages

    def _merge(self, messages: list[dict]) -> Rollouts:
        """The step's groups in stream order, with the rollout stats of this trainer's rollout set."""
        groups = sorted((g for m in messages for g in m["groups"]), key=lambda g: g[0])
        items = self.local.items
        kept = Rollouts(self.group_size, [items[self.local.sampler.item(p)] for p, _, _ in groups],
                        [s for _, samples, _ in groups for s in samples])
        if self.cfg.algorithm.dynamic_sampling:  # scored where they were kept
            kept.rewards = torch.tensor([r for _, _, r in groups], dtype=torch.float32).reshape(-1, self.group_size)
        stats = RolloutStats(rounds=max((m["rounds"] for m in messages), default=0))
        for m in messages:
            if m["stats"] is not None:
                stats.generated_groups += m["stats"]["generated_groups"]
                stats.add_failures(m["stats"]["reward_failures"])
                for key in SPLIT_SUMS:  # this trainer's rollout set's: rollout_<the rollout rank's stat>
                    total = stats.pipeline.get(key, 0.0)
                    stats.pipeline[key] = total + m["stats"].get(key.removeprefix("rollout_"), 0.0)
        kept.stats = stats
        return kept

    # ----------------------------------------------------------------- weights and control out
    def load_weights(self, weights, version: int) -> None:
        """Publish `version` to this trainer's rollout set (its tensors only where a target needs them)."""
        self._publish(weights, version)

    def load_adapter(self, tensors: dict, config, version: int) -> None:
        """Publish `version` as a LoRA policy's adapters alone (model.lora.resync=adapter): its tensors, and
        its PEFT config in every announce, which the rollout ranks' engines load as the adapter they serve."""
        self._publish(tensors.items(), version, {"adapter": config})

    def _publish(self, weights, version: int, fields: dict | None = None) -> None:
        notes = {}
        if self.resumed:  # where each rollout rank goes on: its cursor, and the first target no checkpoint holds
            nxt = max(self.inbox, default=version) + 1
            notes = {dst: {"cursor": self.cursors[dst], "next": nxt} for dst in self.rollout_set}
            self.resumed = False
        notes = {dst: {**notes.get(dst, {}), **(fields or {})} for dst in self.rollout_set}
        needed = weights_needed(version, self.eta, self.steps, self.cfg.pipeline.apply == "inflight")
        self.publisher.publish(weights if needed else None, version, notes)

    def control(self, step: int, halt: bool) -> None:
        """After the step boundary: whether the run stops here (a signal: saved, stopping), and a probed
        version's sequences and policy logprobs (distflow.pipeline.split_trainer.RemoteProbe)."""
        probe, self.probe_out = self.probe_out, None
        for dst in self.rollout_set:
            self.links.send(dst, {"kind": "control", "step": step, "halt": halt, "probe": probe})

    def abort(self, line: str) -> None:
        """Forward this trainer's error to its rollout set, so they stop with its line."""
        self.links.abort(self.rollout_set, line)
        self.aborted = True

    def sleep(self) -> None:
        """Nothing: the engine that generates is on the rollout ranks."""

    def close(self) -> None:
        if not self.aborted:  # the abort line had its flush; what else is under way may have no taker
            self.links.flush()
        self.local.close()

    # ----------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        """The targets the checkpoint's step leaves in flight (received now: they were generated with
        versions already published), as data, and the cursors of this trainer's rollout set."""
        for target in held_targets(self.step, self.eta, self.steps):
            if target not in self.inbox:
                self.inbox[target] = self._receive(target)
        inbox = {str(t): [_to_data(m) for m in messages] for t, messages in self.inbox.items()}
        return {"inbox": inbox, "cursors": {str(k): v for k, v in self.cursors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """The same trainers as the run that wrote it: its groups in flight as they were dealt. The rollout
        ranks may differ in number: every data cursor is the one global stream offset (ShardedSampler)."""
        self.inbox = {int(t): [_from_data(m) for m in messages] for t, messages in state["inbox"].items()}
        self._take_cursors(list(state["cursors"].values()), self.rollout_set)

    def load_pooled(self, states: list[dict]) -> None:
        """A resume on another number of trainers: every saving trainer's groups in flight, dealt to this
        run's trainers as new targets are (Roles.trainer_of from each target's first stream position),
        with the generating ranks' stats on trainer 0, so that the metrics count every group once."""
        messages: dict[int, list[dict]] = {}
        for state in states:
            for t, saved in state["inbox"].items():
                messages.setdefault(int(t), []).extend(saved)
        self.inbox = {t: self._dealt(t, ms) for t, ms in sorted(messages.items())}
        self._take_cursors([c for state in states for c in state["cursors"].values()],
                           list(range(self.roles.trainers, self.roles.world_size)))

    def _dealt(self, target: int, messages: list[dict]) -> list[dict]:
        """The saved messages of `target` with this trainer's groups only; their stats stay on trainer 0
        (`_merge` sums them there, so every rollout rank's counts are reported once)."""
        if any("first" not in m for m in messages):
            raise ConfigError(f"the checkpoint's groups of step {target} do not say where the step's stream "
                              "starts (an older distflow wrote them): resume it with the number of trainer ranks "
                              "that wrote it")

        def mine(m: dict) -> list:
            return [g for g in m["groups"] if self.roles.trainer_of(g[0], m["first"]) == self.rank]

        return [_from_data({**m, "groups": mine(m), "stats": m["stats"] if self.rank == 0 else None, "cursor": None})
                for m in messages]

    def _take_cursors(self, saved: list[dict], dealt_over: list[int]) -> None:
        """This trainer's rollout set's data cursors: the saved ones agree (one global stream offset). The
        positions they name to draw again (pipeline.late=retarget moved them past the checkpoint) are
        dealt over `dealt_over` (this trainer's set, or every rollout rank when every trainer reads every
        saved cursor: distflow.pipeline.schedule.dealt_retries)."""
        if len({c["offset"] for c in saved}) != 1:
            raise ConfigError(f"the checkpoint's rollout cursors disagree ({sorted({c['offset'] for c in saved})}): "
                              "it is not a split run's checkpoint this distflow can resume")
        cursor = {k: v for k, v in saved[0].items() if k != "retry"}
        retries = dealt_retries(saved, dealt_over, self.rollout_set)
        self.cursors = {dst: {**cursor, "retry": retries[dst]} for dst in self.rollout_set}
        self.resumed = True


def _to_data(message: dict) -> dict:
    """A received message as a checkpoint's inbox holds it: its samples as data."""
    return {**message, "groups": [[p, [sample_to_data(s) for s in samples], r] for p, samples, r in message["groups"]]}


def _from_data(message: dict) -> dict:
    """A message of a checkpoint's inbox with its samples rebuilt."""
    groups = [(p, [sample_from_data(s) for s in samples], r) for p, samples, r in message["groups"]]
    return {**message, "groups": groups}
