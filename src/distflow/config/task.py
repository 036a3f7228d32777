"""The task section: the prompts and their answers (a file, a Hub dataset or a procedural
reasoning_gym task), the rewards (functions, reward models, LLM judges), and an environment for
multi-turn episodes."""

from __future__ import annotations

import dataclasses
import math
import os
import string
from typing import Any, Dict, List, Literal, Optional

from distflow.config.fields import ConfigError, knob, section
from distflow.config.model import model_path_checks

JUDGE_FIELDS = ("question", "answer", "reference")  # what a judge's template may name


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
    """One entry of task.reward_models: a sequence classifier with one label, whose score (the
    logit) joins the rewards times `weight`."""

    path: str
    weight: float = 1.0
    name: str = ""  # its metrics' name; empty: the folder's name
    dtype: Optional[str] = None  # its compute dtype; null: model.dtype
    max_tokens: int = 4096  # longer conversations keep their last max_tokens tokens
    batch_tokens: int = 16384  # padded tokens per forward pass (a longer sequence gets one of its own)
    offload: bool = False  # its shards in host memory between uses, copied in block by block (teacher.offload)


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """One entry of task.judges: a causal LM asked `template` about each sample; the score is
    P(yes) / (P(yes) + P(no)) at the next token, times `weight`."""

    path: str
    template: str
    yes: str = "Yes"
    no: str = "No"
    weight: float = 1.0
    name: str = ""
    dtype: Optional[str] = None
    max_tokens: int = 4096
    batch_tokens: int = 16384
    offload: bool = False


def _specs(cls, entries: list, key: str) -> list:
    known = {f.name for f in dataclasses.fields(cls)}
    out, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a mapping of {sorted(known)}, got {entry!r}")
        unknown = sorted(set(entry) - known)
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in entry]
        if unknown or missing:
            raise ConfigError(f"{where}: " + (f"unknown keys {unknown}" if unknown else f"missing {missing}") +
                              f"; its keys are {sorted(known)}")
        spec = cls(**entry)
        spec = dataclasses.replace(spec, name=spec.name or os.path.basename(os.path.normpath(spec.path)))
        if not (isinstance(spec.weight, (int, float)) and math.isfinite(spec.weight)):
            raise ConfigError(f"{where}.weight must be a finite number, got {spec.weight!r}")
        if spec.max_tokens < 1 or spec.batch_tokens < 1:
            raise ConfigError(f"{where}: max_tokens and batch_tokens must be >= 1, got {spec.max_tokens}, "
                              f"{spec.batch_tokens}")
        if not isinstance(spec.offload, bool):
            raise ConfigError(f"{where}.offload must be true or false, got {spec.offload!r}")
        if spec.dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"{where}.dtype must be float32, bfloat16 or null (model.dtype), got {spec.dtype!r}")
        if spec.name in names:
            raise ConfigError(f"{where}: another entry is also named {spec.name!r}; give each a distinct name")
        names.add(spec.name)
        out.append(spec)
    return out


def check_template(template: str, where: str) -> None:
    """A judge's template must name {answer} and nothing but JUDGE_FIELDS (one line otherwise)."""
    try:
        named = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        template.format(**{k: "" for k in JUDGE_FIELDS})
    except (ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"{where}.template cannot be rendered ({type(e).__name__}: {e}); it may name "
                          f"{{{'}, {'.join(JUDGE_FIELDS)}}}, and a literal brace is written twice") from None
    if "answer" not in named:
        raise ConfigError(f"{where}.template has no {{answer}}: the judge would not see the sample it scores")


@section
class TaskConfig:
    name: Literal["jsonl", "reasoning_gym"] = knob(
        "jsonl", "jsonl: prompts from a local file or a Hub dataset (path); reasoning_gym: a procedural task.")
    path: str = knob("", "A local jsonl/json/parquet/csv file, or a Hub dataset owner/name[:config][@split].")
    prompt_key: str = knob("prompt", "The prompt column: a string (one user turn) or chat messages.")
    answer_key: str = knob("answer", "The reference answer's column (every reward sees it as item['answer']).")
    system_prompt: Optional[str] = knob(None, "A system message put before each prompt that has none.")
    split: str = knob("train", "HF split expression for file datasets (e.g. train[:1000]).")
    heldout_path: str = knob("", "File tasks: the held-out split validation uses.")
    reward: str = knob("numeric", "A built-in reward name or package.module:function (distflow.tasks.rewards.registry).")
    rewards: Dict[str, float] = knob(factory=dict, doc="A weighted combination {reward spec: weight}; when "
                                     "non-empty it replaces reward.")
    reward_models: List[Dict[str, Any]] = knob(factory=list, doc=(
        "Reward models, each {path, weight: 1.0, name: its folder's, dtype: null (model.dtype), max_tokens: 4096, "
        "batch_tokens: 16384}: a Hugging Face sequence classifier with one label, frozen and sharded like the KL "
        "reference; weight x its score is added to the rewards (docs/tasks.md)."))
    judges: List[Dict[str, Any]] = knob(factory=list, doc=(
        "LLM judges, each {path, template, yes: 'Yes', no: 'No', weight: 1.0, name, dtype, max_tokens, "
        "batch_tokens}: a causal LM reads template (naming {question}, {answer} and optionally {reference}) and "
        "weight x P(yes) / (P(yes) + P(no)) at its next token is added to the rewards; one forward, no "
        "generation (docs/tasks.md)."))
    reward_timeout_s: float = knob(10.0, "Hard limit per reward call (and per environment step), enforced in the "
                                   "reward pool's worker processes.", operational=True)
    reward_workers: int = knob(2, "Reward worker processes per rank.", operational=True)
    env: str = knob(
        "", "An environment for multi-turn episodes (distflow.tasks.envs): tools (the built-in tool-using environment, "
        "distflow.tasks.envs.ToolEnv) or package.module:Class; empty: single-turn generation. Its steps run in the reward "
        "pool's workers, under reward_timeout_s per step.")
    env_args: Dict[str, Any] = knob(factory=dict, doc="Keyword arguments of the environment's class.")
    agent: str = knob(
        "", "A harness for agent episodes (distflow.rollout.agents): package.module:function, called (async or not) once "
        "per episode with an AgentContext; it talks to the policy through the rank's OpenAI-compatible endpoint "
        "(agent.*), which records the exact tokens. Empty: no harness.")
    agent_exclude: str = knob(
        "", "package.module:function(request) -> bool, for task.agent: true for a request that is not part of the "
        "policy's trajectory (a title, a summary the harness asks for): answered by the engine, never trained or "
        "continued (agent/excluded). Empty: every request counts.")
    gym_dataset: str = knob("basic_arithmetic", "name=reasoning_gym: the dataset's name.")
    gym_config: Dict[str, Any] = knob(factory=dict, doc="name=reasoning_gym: the dataset's config.")
    size: int = knob(1000, "name=reasoning_gym: training items.")
    seed: int = knob(0, "name=reasoning_gym: the training items' seed.")
    heldout_size: int = knob(0, "name=reasoning_gym: held-out items (0: no held-out split).")
    heldout_seed: int = knob(1_000_003, "name=reasoning_gym: a different seed, so held-out items are disjoint from "
                             "training.")

    @property
    def reward_model_specs(self) -> list[RewardModelSpec]:
        return _specs(RewardModelSpec, self.reward_models, "task.reward_models")

    @property
    def judge_specs(self) -> list[JudgeSpec]:
        return _specs(JudgeSpec, self.judges, "task.judges")

    @property
    def has_reward_models(self) -> bool:
        """Rewards computed by models (reward models or judges) besides the reward functions."""
        return bool(self.reward_models or self.judges)

    @property
    def has_heldout(self) -> bool:
        return self.heldout_size >= 1 if self.name == "reasoning_gym" else bool(self.heldout_path)

    def checks(self) -> list[tuple[bool, str]]:
        paths = [check for i, rm in enumerate(self.reward_model_specs)  # each entry parses, or one line
                 for check in model_path_checks(rm.path, f"task.reward_models[{i}].path")]
        for i, judge in enumerate(self.judge_specs):
            check_template(judge.template, f"task.judges[{i}]")
            paths += model_path_checks(judge.path, f"task.judges[{i}].path")
        return [*paths,
            (self.name != "jsonl" or bool(self.path),
             "task.path is not set: give a local jsonl/json/parquet/csv file or a hub dataset name"),
            (self.reward_timeout_s > 0 and self.reward_workers >= 0,
             "task.reward_timeout_s must be > 0 and task.reward_workers >= 0"),
        ]
