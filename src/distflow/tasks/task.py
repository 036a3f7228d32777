"""A task is one object: the rows of each split rendered with the chat template (the environment's
`reset` included), the reward that scores completions, the environment that answers a multi-turn
episode's turns, and the worker processes that run this user code (rewards and environment steps)
under deadlines.

Why one object: a task used to be assembled by the trainer from three places (the reward pool
built the environment, the trainer took it back out to render the prompts, then handed the pool to
scoring, episodes and evaluation). Owning all of it here, any process builds a task from its
TaskConfig and a tokenizer alone: a rollout rank needs no trainer to get its prompts, the reward
that scores them and the environment that answers them.

    task = Task.from_config(cfg.task, tokenizer, cfg.rollout.max_prompt_tokens, splits=("train", "heldout"))
    items = task.rows("train")                 # list[PromptItem], loaded once
    rewards, stats = task.workers.score(calls)  # task.workers.steps(calls) for an environment's turns
    task.close()                               # or `with Task.from_config(...) as task:`

`from_config` keeps the start-up order: the reward specs resolve and the environment is built
first, so a bad reward or task.env is a ConfigError before any row loads (and before the caller
loads a model); then the workers start, and the rows load while they do (a caller's model loading
overlaps them too; `task.workers.wait_ready()` waits for them). A bad dataset is a ConfigError
from load_prompts, after which the workers are closed.
"""

from __future__ import annotations

from collections.abc import Iterable

from distflow.config import TaskConfig
from distflow.config.specs import resolve
from distflow.tasks.envs import build_env
from distflow.tasks.prompts import PromptItem, load_prompts
from distflow.tasks.rewards.pool import TaskWorkers
from distflow.tasks.rewards.registry import RewardSpec

SPLITS = ("train", "heldout")


class Task:
    """A task's rows, reward, environment and workers (see the module docstring).

    `config`, `tokenizer`, `max_prompt_tokens`: what the rows are read and rendered with.
    `reward`: the resolved RewardSpec. `env`: the environment (None: single-turn), the one instance
    of this process; the workers build their own copies from task.env / task.env_args.
    `workers`: the TaskWorkers (RewardPool) that score completions and step the environment.
    `harness`, `exclude`: task.agent's and task.agent_exclude's functions (distflow.rollout.agents), or None.
    """

    def __init__(self, config: TaskConfig, tokenizer, max_prompt_tokens: int, reward: RewardSpec, env,
                 workers: TaskWorkers, harness=None, exclude=None):
        self.config = config
        self.harness, self.exclude = harness, exclude
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.reward = reward
        self.env = env
        self.workers = workers
        self._rows: dict[str, list[PromptItem]] = {}

    @classmethod
    def from_config(cls, config: TaskConfig, tokenizer, max_prompt_tokens: int,
                    splits: Iterable[str] = ("train",)) -> "Task":
        """Resolve the reward, build the environment, start the workers, then load `splits` (in
        order; "heldout" only when asked: a task may have none). Any split not loaded here loads on
        its first `rows()`."""
        splits = tuple(splits)
        for split in splits:
            _check_split(split)
        reward = RewardSpec.from_task(config)
        env = build_env(config.env, dict(config.env_args)) if config.env else None
        harness = resolve(config.agent, {}, "task.agent") if config.agent else None
        exclude = resolve(config.agent_exclude, {}, "task.agent_exclude") if config.agent_exclude else None
        workers = TaskWorkers.from_task(config, rewards=reward, env_instance=env)
        task = cls(config, tokenizer, max_prompt_tokens, reward, env, workers, harness, exclude)
        try:
            for split in splits:
                task.rows(split)
        except BaseException:
            task.close()
            raise
        return task

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes (an environment answers the turns) or single responses."""
        return self.env is not None

    def rows(self, split: str = "train") -> list[PromptItem]:
        """The split's items (see load_prompts), rendered with the environment's reset; loaded on the
        first call, the same list after."""
        _check_split(split)
        if split not in self._rows:
            self._rows[split] = load_prompts(self.config, self.tokenizer, self.max_prompt_tokens, split=split,
                                             env=self.env)
        return self._rows[split]

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.workers.close()

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"a task's split is one of {SPLITS}, got {split!r}")
