"""The whole run's schema: its sections, the one validation pass, and the one config record.

The Hydra recipe composes a plain nested dict against `hydra_schema(DistflowConfig)` (types and
unknown keys), `DistflowConfig.from_dict` builds the typed sections, and `validate()` runs
every check that needs no model, data or process group, so every rank stops alike, before
anything loads. Library code only ever sees these objects, never Hydra.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from distflow.config.agent import AgentConfig
from distflow.config.algorithm import AlgorithmConfig
from distflow.config.checkpoint import CheckpointConfig
from distflow.config.critic import CriticConfig
from distflow.config.teacher import TeacherConfig
from distflow.config.data import DataConfig
from distflow.config.fields import (
    ConfigError,
    check_choices,
    flat_record,
    from_dict,
    knob,
    operational_keys,
    section,
    to_record,
)
from distflow.config.logging import LoggingConfig
from distflow.config.model import LoraConfig, ModelConfig
from distflow.config.optim import OptimConfig
from distflow.config.pipeline import PipelineConfig
from distflow.config.rollout import RolloutConfig
from distflow.config.run import RunConfig
from distflow.config.task import TaskConfig
from distflow.config.validation import ValidationConfig

__all__ = ["DistflowConfig", "config_record", "config_differences", "LoraConfig"]


@section
class DistflowConfig:
    model: ModelConfig = knob(factory=ModelConfig)
    rollout: RolloutConfig = knob(factory=RolloutConfig)
    algorithm: AlgorithmConfig = knob(factory=AlgorithmConfig)
    optim: OptimConfig = knob(factory=OptimConfig)
    critic: CriticConfig = knob(factory=CriticConfig)
    teacher: TeacherConfig = knob(factory=TeacherConfig)
    data: DataConfig = knob(factory=DataConfig)
    pipeline: PipelineConfig = knob(factory=PipelineConfig)
    task: TaskConfig = knob(factory=TaskConfig)
    agent: AgentConfig = knob(factory=AgentConfig)
    run: RunConfig = knob(factory=RunConfig)
    checkpoint: CheckpointConfig = knob(factory=CheckpointConfig)
    validation: ValidationConfig = knob(factory=ValidationConfig)
    logging: LoggingConfig = knob(factory=LoggingConfig)

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> "DistflowConfig":
        """The config a plain nested dict describes (defaults for what it leaves out)."""
        return from_dict(cls, tree)

    @property
    def has_critic(self) -> bool:
        """PPO's value model exists exactly when the estimator needs values."""
        return self.algorithm.needs_critic

    def validate(self) -> "DistflowConfig":
        """Every config-only check, in one pass: choices, each section's own ranges, then the rules
        across sections. ConfigError (one line) on the first that fails."""
        check_choices(self)
        sections = [getattr(self, f.name) for f in fields(self) if f.name != "critic" or self.has_critic]
        for ok, msg in [check for part in sections for check in part.checks()] + _across_sections(self):
            if not ok:
                raise ConfigError(msg)
        return self


def _across_sections(cfg: DistflowConfig) -> list[tuple[bool, str]]:
    """The rules that tie one section's keys to another's."""
    r, a, lora, budget = cfg.rollout, cfg.algorithm, cfg.model.lora, cfg.rollout.response_budget()
    seqs = cfg.data.prompts_per_rank * a.group_size
    return [
        (r.max_turns == 1 or bool(cfg.task.env or cfg.task.agent),
         f"rollout.max_turns={r.max_turns} needs an environment to answer the turns: set task.env (or task.agent)"),
        (not (cfg.task.agent and cfg.task.env),
         "task.agent and task.env are two ways to run episodes: set one (a harness can call its own tools)"),
        (cfg.task.agent or not cfg.task.agent_exclude,
         "task.agent_exclude picks requests of a harness's episodes: it needs task.agent"),
        (not cfg.task.agent or cfg.pipeline.mode == "sync",
         "task.agent runs with pipeline.mode=sync (harness episodes are not carried over yet)"),
        (not cfg.task.agent or r.tensor_parallel_size == 1
         or cfg.agent.episode_timeout_s < cfg.run.collective_timeout_s,
         f"agent.episode_timeout_s={cfg.agent.episode_timeout_s} must be < run.collective_timeout_s="
         f"{cfg.run.collective_timeout_s} with a tensor-parallel engine (a rank waits in the group's step while "
         "another rank's harness works)"),
        (a.overlong_buffer_len < budget,
         f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be < the response length limit {budget} "
         "(rollout.max_new_tokens; multi-turn: rollout.max_total_tokens)"),
        (cfg.optim.mini_batches < 1 or seqs % cfg.optim.mini_batches == 0,
         f"{seqs} sequences per rank do not split into optim.mini_batches={cfg.optim.mini_batches}"),
        (not lora.enabled or lora.resync != "adapter" or r.engine == "vllm",
         "model.lora.resync=adapter needs rollout.engine=vllm (vLLM's LoRA support); use resync=merged"),
        (not lora.enabled or lora.resync != "adapter" or r.tensor_parallel_size == 1,
         "model.lora.resync=adapter with rollout.tensor_parallel_size > 1 is not supported; use resync=merged"),
        (cfg.pipeline.max_staleness == 0 or a.rollout_correction.weights_or_masks or a.rollout_correction.bypass_mode,
         f"pipeline.max_staleness={cfg.pipeline.max_staleness} trains tokens of older policies and needs a correction "
         "for them: choose one with rollout_correction=token_tis (or another preset), or set "
         "algorithm.rollout_correction.rollout_is"),
        (cfg.pipeline.max_concurrency is None or cfg.pipeline.max_concurrency >= a.group_size,
         f"pipeline.max_concurrency={cfg.pipeline.max_concurrency} is below algorithm.group_size={a.group_size}: "
         "a group's samples run together"),
        *_split_rules(cfg),
        (cfg.pipeline.oversample == 0 or (cfg.pipeline.apply == "inflight" and a.dynamic_sampling),
         f"pipeline.oversample={cfg.pipeline.oversample:g} needs pipeline.apply=inflight with "
         "algorithm.dynamic_sampling (staged runs draw more rounds instead)"),
        (not a.needs_teacher or bool(cfg.teacher.path),
         "algorithm.advantage=distill learns from a teacher: set teacher.path to its model folder"),
        (a.needs_teacher or not cfg.teacher.path,
         f"teacher.path is set but algorithm.advantage={a.advantage} does not use a teacher: set "
         "algorithm.advantage=distill (algorithm=distill), or leave teacher.path empty"),
        (not (a.dynamic_sampling and cfg.task.has_reward_models),
         "algorithm.dynamic_sampling keeps groups by their reward functions' scores, before reward models and judges "
         "score them: not supported with task.reward_models or task.judges"),
        (not cfg.validation.wanted or cfg.task.has_heldout,
         "validation needs a held-out split: set task.heldout_size" if cfg.task.name == "reasoning_gym"
         else "validation needs a held-out split: set task.heldout_path"),
    ]


def _split_rules(cfg: DistflowConfig) -> list[tuple[bool, str]]:
    """What role-split ranks (pipeline.mode=split) do not run yet: each stops at start-up with its line."""
    if cfg.pipeline.mode != "split":
        return []
    k, inflight = cfg.rollout.tensor_parallel_size, cfg.pipeline.apply == "inflight"
    return [
        # vLLM replaces its one adapter in place: requests running across it would change adapters
        (not (cfg.model.lora.enabled and cfg.model.lora.resync == "adapter" and cfg.pipeline.kv_after_update == "keep"),
         "pipeline.kv_after_update=keep with model.lora.resync=adapter: the running requests would change adapters "
         "mid-sequence; use kv_after_update=recompute, or lora.resync=merged"),
        # the ranks of a tensor-parallel engine make the same engine calls in the same order: a staged rank's
        # applications are fixed by the schedule, an inflight rank's by when each version arrives
        (k == 1 or not inflight,
         f"pipeline.apply=inflight with rollout.tensor_parallel_size={k}: the ranks of an engine would apply each "
         "version where it reaches them, not at one engine step; use pipeline.apply=staged"),
    ]


def config_record(cfg: DistflowConfig, auto: dict[str, Any] | None = None) -> dict[str, Any]:
    """The resolved config as JSON data: config.json, the checkpoint marker and W&B all store this.
    `auto` (the start-up plan's: each key it made concrete -> what the user wrote, "auto" or null) is
    stored beside the sections under AUTO, so the record says both what ran and what was asked for."""
    record = to_record(cfg)
    if auto:
        record[AUTO] = dict(auto)
    return record


AUTO = "auto"  # the record's entry beside the sections: the keys the user left automatic
OPERATIONAL = operational_keys(DistflowConfig)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: saved -> current' for every key that names the run (is not operational) and differs.
    A key newer than the saved run counts as saved at its default. A key differs only when both its
    value and what was asked for (a record's AUTO entry) differ, so a saved "auto" (a record written
    before the start-up plan resolved every automatic value) equals the value "auto" resolves to now."""
    a, a_asked = _values_and_asked(saved, flat_record(config_record(DistflowConfig()), DistflowConfig))
    b, b_asked = _values_and_asked(current, {})
    missing = "(unset)"
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}" for k in sorted((a.keys() | b.keys()) - OPERATIONAL)
            if a.get(k, missing) != b.get(k, missing) and a_asked.get(k, missing) != b_asked.get(k, missing)]


def _values_and_asked(record: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A record's flat values, and the same with the user's automatic settings back in place."""
    sections = {k: v for k, v in record.items() if k != AUTO}
    values = {**defaults, **flat_record(sections, DistflowConfig)}
    return values, {**values, **record.get(AUTO, {})}
