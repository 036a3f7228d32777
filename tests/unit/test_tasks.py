"""Every task recipe (recipes/task/*.yaml) composes with the primary config, loads its prompts
with the tiny model's tokenizer, and its rewards tell a correct completion from a wrong one.

The correct answers are computed here independently of distflow's rewards: by hand for the
shipped samples, with Python arithmetic for procedural items (a brute-force solver for countdown).
A new task recipe needs an entry in `_solve` (the test says so).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from config_helpers import compose
from distflow.config import DistflowConfig
from distflow.tasks.prompts import PromptItem, load_prompts
from distflow.tasks.envs import build_env
from distflow.tasks.rewards import BUILTIN
from distflow.tasks.rewards.pool import RewardPool

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TASKS = sorted(p.stem for p in (RECIPES / "task").glob("*.yaml"))
ARITH = RECIPES / "data" / "arith.jsonl"


def compose_task(name: str, *overrides: str) -> DistflowConfig:
    raw = yaml.safe_load((RECIPES / "task" / f"{name}.yaml").read_text())
    if raw.get("path") == "???":  # a template (task=jsonl): the user must give the file
        overrides = (f"task.path={ARITH}", *overrides)
    return compose([f"task={name}", *overrides]).validate()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


_LOADED: dict[str, tuple] = {}
# The tiny model's 512-entry BPE splits English into ~2 characters per token, about twice what a
# real tokenizer needs: countdown's reasoning-gym prompt is ~300 tiny tokens but 166 SmolLM2 ones.
# So prompts are loaded with this limit, and a recipe must drop none of them.
TINY_TOKENIZER_LIMIT = "rollout.max_prompt_tokens=512"
# Procedural tasks generate their first 200 items only (item i depends on seed + i alone, so these
# are the recipe's own first items): reasoning-gym's countdown takes ~10 ms an item here.
GYM_SIZE = 200


@pytest.fixture
def loaded(tokenizer, caplog):
    """name -> (config, train items, heldout items or None, warnings logged while loading); cached."""
    def load(name: str):
        if name not in _LOADED:
            raw = yaml.safe_load((RECIPES / "task" / f"{name}.yaml").read_text())
            smaller = [f"task.size={min(GYM_SIZE, raw.get('size', GYM_SIZE))}"] if raw["name"] == "reasoning_gym" else []
            cfg = compose_task(name, TINY_TOKENIZER_LIMIT, *smaller)
            limit = cfg.rollout.max_prompt_tokens
            # prompts as the trainer builds them (tool instructions included)
            env = build_env(cfg.task.env, dict(cfg.task.env_args)) if cfg.task.env else None
            with caplog.at_level(logging.WARNING, logger="distflow"):
                train = load_prompts(cfg.task, tokenizer, limit, env=env)
                t = cfg.task
                has_heldout = bool(t.heldout_path) if t.name == "jsonl" else t.heldout_size > 0
                heldout = load_prompts(t, tokenizer, limit, split="heldout", env=env) if has_heldout else None
            _LOADED[name] = (cfg, train, heldout, [r.getMessage() for r in caplog.records])
        return _LOADED[name]
    return load


# ----------------------------------------------------------------------------- loading
def test_task_recipes_found():
    assert {"arith_jsonl", "jsonl", "gsm8k", "math", "countdown"} <= set(TASKS), TASKS
    assert any(t.startswith("gym_") for t in TASKS), TASKS


@pytest.mark.parametrize("name", TASKS)
def test_task_composes_and_loads(name, loaded):
    cfg, train, heldout, warnings = loaded(name)
    raw = yaml.safe_load((RECIPES / "task" / f"{name}.yaml").read_text())
    assert cfg.task.name == raw["name"]
    assert train and all(isinstance(i, PromptItem) for i in train)
    # nothing dropped for length, no bad rows
    assert not [w for w in warnings if "dropped" in w or "skipped" in w], warnings
    for item in train + (heldout or []):
        assert item.prompt_ids and item.answer.strip() and item.answer != "None"
        assert len(item.prompt_ids) <= cfg.rollout.max_prompt_tokens
        if cfg.task.system_prompt:
            assert cfg.task.system_prompt in item.prompt_text
    if cfg.task.name == "reasoning_gym":
        assert len(train) == cfg.task.size
    if heldout is not None:
        assert heldout, name
        overlap = {i.prompt_text for i in train} & {i.prompt_text for i in heldout}
        assert not overlap, f"{name}: held-out prompts also in training: {sorted(overlap)[:3]}"
    # the configured reward(s) resolve
    RewardPool(dict(cfg.task.rewards) or cfg.task.reward, 0, cfg.task.reward_timeout_s).close()


def test_shipped_samples_have_heldout_splits(loaded):
    for name in ("gsm8k", "math"):
        _, train, heldout, _ = loaded(name)
        assert len(train) >= 20 and len(heldout) >= 8


def test_countdown_rows_carry_numbers_and_target(loaded):
    """The built-in countdown reward reads item["numbers"] and item["target"]."""
    _, train, heldout, _ = loaded("countdown")
    for item in train[:50] + heldout[:10]:
        numbers, target = item.fields["numbers"], item.fields["target"]
        assert all(type(n) is int for n in numbers) and 3 <= len(numbers) <= 4 and type(target) is int
        assert str(target) in item.prompt_text and all(str(n) in item.prompt_text for n in numbers)


# ----------------------------------------------------------------------------- rewards
def _countdown_solution(numbers: list[int], target: int) -> str | None:
    """An expression using every number exactly once with value `target` (exact arithmetic)."""
    def search(terms):
        if len(terms) == 1:
            return terms[0][1] if terms[0][0] == target else None
        for i, j in itertools.permutations(range(len(terms)), 2):
            (a, ea), (b, eb) = terms[i], terms[j]
            rest = [t for k, t in enumerate(terms) if k not in (i, j)]
            options = [(a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"), (a * b, f"{ea} * {eb}")]
            if b != 0:
                options.append((a / b, f"{ea} / ({eb})"))
            for option in options:
                if found := search(rest + [option]):
                    return found
        return None
    return search([(Fraction(n), str(n)) for n in numbers])


def _arith(prompt: str) -> int:
    a, op, b = re.search(r"What is (\d+) ([-+]) (\d+)\?", prompt).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def _chain_sum(question: str) -> int:  # "... 12 - 5 + 30 =" evaluated left to right
    expr = re.search(r"(-?\d+(?:\s*[-+]\s*-?\d+)+)\s*=\s*$", question.strip()).group(1)
    tokens = re.findall(r"\d+|[-+]", expr)
    total, sign = int(tokens[0]), 1
    for tok in tokens[1:]:
        if tok in "+-":
            sign = 1 if tok == "+" else -1
        else:
            total += sign * int(tok)
    return total


# What each kind of task's rewards are checked with: the built-ins that apply to its answers.
APPLICABLE = {
    "number": ["numeric", "gsm8k", "math", "format", "length_penalty"],
    "latex": ["math", "numeric", "format", "length_penalty"],
    "countdown": ["countdown", "format", "length_penalty"],
}
EPISODE_REWARDS = ["tool_use"]  # read the transcript: checked on the tasks with an environment


def _solve(cfg: DistflowConfig, items: list[PromptItem]) -> tuple[str, PromptItem, str, str]:
    """(kind, item, correct completion, wrong completion) for one item of the task."""
    t = cfg.task
    if t.name == "reasoning_gym":
        item = items[0]
        q = item.fields["question"]
        if t.gym_dataset == "countdown":
            numbers, target = item.fields["numbers"], item.fields["target"]
            expr = _countdown_solution(numbers, target)
            assert expr, (numbers, target)
            wrong = " + ".join(map(str, numbers)) if sum(numbers) != target else " * ".join(map(str, numbers))
            return "countdown", item, f"Let me try.\n<answer>{expr}</answer>", f"Let me try.\n<answer>{wrong}</answer>"
        if t.gym_dataset == "gcd":
            value = math.gcd(*map(int, re.search(r"numbers: ([\d, ]+)", q).group(1).split(", ")))
        elif t.gym_dataset == "products":
            value = math.prod(map(int, re.search(r"multiplication: ([\d *]+?)\.", q).group(1).split(" * ")))
        elif t.gym_dataset == "chain_sum":
            value = _chain_sum(q)
        elif t.gym_dataset == "basic_arithmetic":
            a, b = map(int, re.search(r"Calculate (\d+) \+ (\d+)\.", q).groups())
            value = a + b
        else:
            pytest.fail(f"no independent solver for reasoning_gym {t.gym_dataset!r}: add one to _solve")
        return "number", item, *_boxed(value, value + 1)
    source = os.path.basename(t.path)
    if source == "arith.jsonl":
        item = items[0]
        value = _arith(item.fields["prompt"])
        return "number", item, *_boxed(value, value + 1)
    if source == "gsm8k_sample.jsonl":
        (item,) = [i for i in items if i.fields["question"].startswith("Mia buys 3 packs of pencils")]
        return "number", item, "She buys 3 * 12 = 36 pencils and gives away 7.\n#### 29", "36 + 7 = 43.\n#### 43"
    if source == "math_sample.jsonl":
        (item,) = [i for i in items if i.fields["problem"] == "Simplify $\\frac{18}{24}$."]
        return "latex", item, *_boxed("\\dfrac{3}{4}", "\\frac{2}{3}")
    pytest.fail(f"no independent solution for task file {source!r}: add one to _solve")


def _boxed(right, wrong) -> tuple[str, str]:
    return (f"Working it out step by step.\nThe answer is $\\boxed{{{right}}}$.",
            f"Working it out step by step.\nThe answer is $\\boxed{{{wrong}}}$.")


def _score(spec, item: PromptItem, completion: str, tokenizer, transcript: list | None = None) -> float:
    """One call exactly as distflow.rollout.scoring builds it (row fields plus "answer"; an episode's
    also its "transcript")."""
    ids = tokenizer(completion)["input_ids"]
    fields = {**item.fields, "answer": item.answer, **({"transcript": transcript} if transcript else {})}
    with RewardPool(spec, 0, 10.0) as pool:
        (reward,), stats = pool.score([(item.prompt_text, completion, ids, fields)])
    assert not any(stats.values()), f"reward {spec!r} failed on {completion!r}: {stats}"
    return reward


@pytest.mark.parametrize("name", TASKS)
def test_rewards_score_correct_and_wrong(name, loaded, tokenizer):
    cfg, train, _, _ = loaded(name)
    kind, item, right, wrong = _solve(cfg, train)
    # the task's own reward (or weighted combination)
    spec = dict(cfg.task.rewards) or cfg.task.reward
    good, bad = _score(spec, item, right, tokenizer), _score(spec, item, wrong, tokenizer)
    assert good > bad, (spec, good, bad)
    if isinstance(spec, str):
        assert (good, bad) == (1.0, 0.0), (spec, right, wrong)
    # every built-in reward that applies to this kind of answer
    for reward in APPLICABLE[kind]:
        if reward == "format":  # form, not correctness: a stated answer vs. none
            assert _score(reward, item, right, tokenizer) == 1.0
            assert _score(reward, item, "Hmm, I am not sure what to do here.", tokenizer) == 0.0
        elif reward == "length_penalty":  # shorter is better
            padded = right + "\n" + "Let me double-check that once more. " * 8
            assert _score(reward, item, right, tokenizer) > _score(reward, item, padded, tokenizer)
        else:
            assert _score(reward, item, right, tokenizer) == 1.0, (reward, item.answer, right)
            assert _score(reward, item, wrong, tokenizer) == 0.0, (reward, item.answer, wrong)
    if cfg.task.env:  # an episode's rewards also see its transcript: a tool result, or only an error
        call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
        used = [call, {"role": "tool", "content": str(item.answer)}, {"role": "assistant", "content": right}]
        failed = [call, {"role": "tool", "content": "error: unknown tool 'x'"}, {"role": "assistant", "content": right}]
        for reward in EPISODE_REWARDS:
            assert _score(reward, item, right, tokenizer, transcript=used) == 1.0, reward
            assert _score(reward, item, right, tokenizer, transcript=failed) == 0.0, reward
        if not isinstance(spec, str):
            assert _score(spec, item, right, tokenizer, transcript=used) > good  # the shaping term counts


def test_every_builtin_is_checked_on_some_task():
    assert set(BUILTIN) <= {r for rewards in APPLICABLE.values() for r in rewards} | set(EPISODE_REWARDS)
    assert any(compose_task(name).task.env for name in TASKS)  # ... and the episode rewards on a task with an env
