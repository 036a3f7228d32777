"""The task section: the prompts and their answers (a file, a Hub dataset or a procedural
reasoning_gym task), the rewards, and an environment for multi-turn episodes."""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from distflow.config.fields import knob, section


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
    reward_timeout_s: float = knob(10.0, "Hard limit per reward call (and per environment step), enforced in the "
                                   "reward pool's worker processes.", operational=True)
    reward_workers: int = knob(2, "Reward worker processes per rank.", operational=True)
    env: str = knob(
        "", "An environment for multi-turn episodes (distflow.tasks.envs): tools (the built-in tool-using environment, "
        "distflow.tasks.envs.ToolEnv) or package.module:Class; empty: single-turn generation. Its steps run in the reward "
        "pool's workers, under reward_timeout_s per step.")
    env_args: Dict[str, Any] = knob(factory=dict, doc="Keyword arguments of the environment's class.")
    gym_dataset: str = knob("basic_arithmetic", "name=reasoning_gym: the dataset's name.")
    gym_config: Dict[str, Any] = knob(factory=dict, doc="name=reasoning_gym: the dataset's config.")
    size: int = knob(1000, "name=reasoning_gym: training items.")
    seed: int = knob(0, "name=reasoning_gym: the training items' seed.")
    heldout_size: int = knob(0, "name=reasoning_gym: held-out items (0: no held-out split).")
    heldout_seed: int = knob(1_000_003, "name=reasoning_gym: a different seed, so held-out items are disjoint from "
                             "training.")

    @property
    def has_heldout(self) -> bool:
        return self.heldout_size >= 1 if self.name == "reasoning_gym" else bool(self.heldout_path)

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.name != "jsonl" or bool(self.path),
             "task.path is not set: give a local jsonl/json/parquet/csv file or a hub dataset name"),
            (self.reward_timeout_s > 0 and self.reward_workers >= 0,
             "task.reward_timeout_s must be > 0 and task.reward_workers >= 0"),
        ]
