"""Task (distflow.tasks.task): one object owns a task's rows, reward, environment and workers.

It must give exactly what load_prompts gives, build the environment once in this process and hand
it to its workers, fail on a bad reward or environment before any row loads, and stop its workers
on close()."""

from __future__ import annotations


import pytest

import distflow.tasks.task as task_module
from data_helpers import make_tokenizer, write_jsonl
from launch_helpers import children
from distflow.config import ConfigError, TaskConfig
from distflow.tasks import Task, load_prompts
from distflow.tasks.envs import BUILTIN_ENVS, Step, ToolEnv, build_env
from distflow.tasks.rewards import RewardPool, TaskWorkers

TRAIN = [
    {"question": "what is one plus one", "label": 2},
    {"question": "what is two plus two", "label": 4},
    {"question": "what is one plus two", "label": 3},
]
HELDOUT = [{"question": "what is two plus one", "label": 3}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def config(tmp_path):
    def make(**kw) -> TaskConfig:
        kw = {"path": write_jsonl(tmp_path / "train.jsonl", TRAIN), "heldout_path":
              write_jsonl(tmp_path / "heldout.jsonl", HELDOUT), "prompt_key": "question", "answer_key": "label",
              "reward_workers": 0, **kw}
        return TaskConfig(**kw)
    return make


def test_rows_are_load_prompts_rows(config, tokenizer):
    cfg = config(system_prompt="be brief")
    with Task.from_config(cfg, tokenizer, 64, splits=("train", "heldout")) as task:
        assert task.rows("train") == load_prompts(cfg, tokenizer, 64)
        assert task.rows("heldout") == load_prompts(cfg, tokenizer, 64, split="heldout")
        assert [i.answer for i in task.rows("train")] == ["2", "4", "3"]
        assert task.env is None and not task.multi_turn and task.workers.env is None
        assert task.reward.components == [("numeric", 1.0)] == task.workers.components


def test_rows_load_once_and_heldout_only_when_asked(config, tokenizer, monkeypatch):
    loads = []
    real = task_module.load_prompts
    monkeypatch.setattr(task_module, "load_prompts", lambda *a, **kw: loads.append(kw["split"]) or real(*a, **kw))
    with Task.from_config(config(heldout_path=""), tokenizer, 64) as task:
        assert loads == ["train"]
        assert task.rows("train") is task.rows("train") and loads == ["train"]
        with pytest.raises(ConfigError, match="set task.heldout_path"):  # asked for, and there is none
            task.rows("heldout")
        with pytest.raises(ValueError, match="split"):
            task.rows("test")


def test_env_built_once_and_handed_to_workers(config, tokenizer, monkeypatch):
    built = []

    class CountedToolEnv(ToolEnv):
        def __init__(self, **kw):
            built.append(self)
            super().__init__(**kw)

    monkeypatch.setitem(BUILTIN_ENVS, "tools", CountedToolEnv)  # this process only: workers build the real one
    cfg = config(env="tools", env_args={"tools": ["calculator"]}, reward_workers=1)
    with Task.from_config(cfg, tokenizer, 512, splits=("train", "heldout")) as task:
        assert built == [task.env] and task.workers.env is task.env and task.multi_turn
        reference = build_env("tools", {"tools": ["calculator"]})  # rendered as load_prompts renders them
        assert task.rows("train") == load_prompts(cfg, tokenizer, 512, env=reference)
        assert task.rows("heldout") == load_prompts(cfg, tokenizer, 512, split="heldout", env=reference)
        assert "calculator" in task.rows("train")[0].prompt_text
        assert len(built) == 2  # only the reference above: the task built no second one
        workers = task.workers.wait_ready()
        assert isinstance(workers, TaskWorkers) and isinstance(workers, RewardPool)
        first = task.rows("train")[0]
        item = {**first.fields, "answer": first.answer}  # as distflow.rollout.scoring gives it
        rewards, stats = workers.score([("p", "The answer is 2", [], item), ("p", "The answer is 5", [], item)])
        assert rewards == [1.0, 0.0] and stats["errors"] == 0
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        [(kind, step)], _ = workers.steps([(item, [{"role": "assistant", "content": call}])])
        assert kind == "ok" and isinstance(step, Step) and step.messages[0]["content"].strip() == "2"


@pytest.mark.parametrize("overrides, match", [
    ({"reward": "no_such_module_xyz:fn"}, "cannot be imported"),
    ({"rewards": {"numeric": 1.0, "not_a_builtin": 0.5}}, "neither a built-in"),
    ({"env": "no_such_module_xyz:Env"}, "cannot be imported"),
    ({"env": "tools", "env_args": {"tools": ["abacus"]}}, "unknown tool"),
])
def test_bad_reward_or_env_fails_before_rows_load(config, tokenizer, monkeypatch, overrides, match):
    monkeypatch.setattr(task_module, "load_prompts", lambda *a, **kw: pytest.fail("rows loaded"))
    before = children()
    with pytest.raises(ConfigError, match=match):
        Task.from_config(config(reward_workers=2, **overrides), tokenizer, 64, splits=("train", "heldout"))
    assert children() == before  # and no worker started


def test_bad_dataset_keeps_its_message_and_closes_workers(config, tokenizer, tmp_path):
    cfg = config(path=write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "label": 1}]), reward_workers=1)
    with pytest.raises(ConfigError) as expected:
        load_prompts(cfg, tokenizer, 64)
    before = children()
    with pytest.raises(ConfigError) as got:
        Task.from_config(cfg, tokenizer, 64)
    assert str(got.value) == str(expected.value) and "not a column" in str(got.value)
    assert children() == before


def test_close_stops_the_workers(config, tokenizer):
    task = Task.from_config(config(reward_workers=2), tokenizer, 64)
    procs = [w.proc for w in task.workers.wait_ready()._workers]
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    task.close()
    assert all(p.poll() is not None for p in procs)
    task.close()  # twice is harmless


@pytest.mark.parametrize("old,new", [
    ("distflow.rewards.numeric:numeric_match", "distflow.tasks.rewards.numeric:numeric_match"),
    ("distflow.rewards.builtin:gsm8k_reward", "distflow.tasks.rewards.builtin:gsm8k_reward"),
])
def test_a_reward_spelled_with_its_old_module_still_resolves(old, new):
    from distflow.tasks.rewards import load_reward

    assert load_reward(old) is load_reward(new)


def test_an_environment_spelled_with_its_old_module_still_builds():
    from distflow.tasks.envs import load_env_class

    assert load_env_class("distflow.envs:ToolEnv") is ToolEnv
