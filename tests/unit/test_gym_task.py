"""The reasoning-gym arithmetic task: deterministic splits, disjoint held-out items, a strict reward.

Expected answers are written by hand or computed here from the question text with Python's own
arithmetic, never with the scorer under test.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from distflow.config import ConfigError, TaskConfig
from distflow.tasks.gym import ANSWER_INSTRUCTION, INSTRUCTION, final_answer, gym_reward, gym_rows

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "task" / "gym_arith.yaml"
EXPR = re.compile(r"\d+(?: [-+] \d+)+")  # the expression inside "Calculate 5 + 33." / "... 15 - 43 ="


def _recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def _task(**overrides) -> TaskConfig:
    cfg = {**_recipe(), "size": 200, "heldout_size": 64}
    cfg.update(overrides)
    return TaskConfig(**cfg)


def _chain_sum(**overrides) -> TaskConfig:
    return _task(gym_dataset="chain_sum", **{
        "gym_config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}, **overrides})


def _expr(question: str) -> str:
    (expr,) = EXPR.findall(question)
    return expr


def _evaluate(question: str) -> int:
    """Left-to-right + and - over the one expression in the question (no negative operands)."""
    tokens = _expr(question).split()
    total = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        total = total + int(num) if op == "+" else total - int(num)
    return total


def test_recipe_is_a_valid_task_config():
    task = TaskConfig(**_recipe())  # every key is a TaskConfig field
    assert task.name == "reasoning_gym" and task.reward == "distflow.tasks.gym:gym_reward"
    assert task.heldout_size >= 64 and task.heldout_seed != task.seed
    train, held = gym_rows(task, "train"), gym_rows(task, "heldout")
    assert len(train) == task.size and len(held) == task.heldout_size
    assert not {r["question"] for r in train} & {r["question"] for r in held}


# Hand-computed: the first items of the recipe's splits (seed 0 and heldout_seed 1000003).
HAND_TRAIN = [("Calculate 5 + 33.", "38"), ("Calculate 32 + 15.", "47"), ("Calculate 10 + 46.", "56")]
HAND_HELDOUT = [("Calculate 65 + 22.", "87"), ("Calculate 19 + 45.", "64")]


def test_hand_checked_items():
    task = TaskConfig(**_recipe())
    assert [(r["question"], r["answer"]) for r in gym_rows(task, "train")[:3]] == HAND_TRAIN
    assert [(r["question"], r["answer"]) for r in gym_rows(task, "heldout")[:2]] == HAND_HELDOUT


@pytest.mark.parametrize("make", [_task, _chain_sum])
def test_rows_shape_and_answers(make):
    rows = gym_rows(make(size=50), "train")
    assert len(rows) == 50
    for row in rows:
        json.dumps(row)  # no tuples/sets/objects
        assert row["prompt"] == f"{row['question']}\n{INSTRUCTION}"
        assert row["gym_entry"]["answer"] == row["answer"]
        assert row["gym_entry"]["question"] == row["question"]
        assert row["gym_dataset"] == row["gym_entry"]["metadata"]["source_dataset"]
        assert row["answer"] == str(_evaluate(row["question"]))


def test_deterministic_per_seed():
    a, b = gym_rows(_task(), "train"), gym_rows(_task(), "train")
    assert a == b
    other = gym_rows(_task(seed=7), "train")
    assert [r["question"] for r in a] != [r["question"] for r in other]
    assert gym_rows(_task(), "heldout") == gym_rows(_task(), "heldout")
    assert gym_rows(_task(), "heldout") != gym_rows(_task(heldout_seed=5), "heldout")
    # the train split does not depend on the held-out settings
    assert gym_rows(_task(heldout_size=80, heldout_seed=5), "train") == a


@pytest.mark.parametrize("make", [_task, _chain_sum])
def test_heldout_disjoint_from_train_even_with_overlapping_seeds(make):
    # reasoning-gym seeds item i with seed + i: heldout_seed=100 would replay train items 100..
    task = make(size=300, seed=0, heldout_seed=100, heldout_size=64)
    train, held = gym_rows(task, "train"), gym_rows(task, "heldout")
    train_q = {r["question"] for r in train}
    train_e = {_expr(r["question"]) for r in train}
    held_q = [r["question"] for r in held]
    assert len(held) == 64 and len(set(held_q)) == 64
    assert not train_q.intersection(held_q)
    assert not train_e.intersection(_expr(q) for q in held_q)
    # ...as the naive split (train items of seed 100) does
    naive = gym_rows(make(size=64, seed=100), "train")
    assert len(train_q.intersection(r["question"] for r in naive)) > 30


def test_heldout_too_small_problem_space_is_a_config_error():
    tiny = _chain_sum(gym_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                      size=2000, heldout_size=64)  # only 200 distinct 1-digit pairs exist
    with pytest.raises(ConfigError, match="heldout_size"):
        gym_rows(tiny, "heldout")


@pytest.mark.parametrize("bad, match", [
    (dict(gym_dataset="no_such_dataset"), "not a reasoning-gym dataset"),
    (dict(gym_config={"min_terms": 2, "bogus": 1}), "gym_config"),
    (dict(gym_config={"seed": 3}), "must not set 'seed'"),
    (dict(gym_config={"min_terms": 0}), "gym_config"),
    (dict(size=0), "task.size"),
])
def test_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        gym_rows(_task(**bad), "train")


def test_no_heldout_split_and_unknown_split():
    with pytest.raises(ConfigError, match="no held-out split"):
        gym_rows(_task(heldout_size=0), "heldout")
    with pytest.raises(ConfigError, match="split"):
        gym_rows(_task(), "validation")


def _rows(n=40):
    return gym_rows(_task(), "train")[:n] + gym_rows(_task(), "heldout")[:n] + gym_rows(_chain_sum(), "train")[:n]


def test_reward_accepts_right_answer_in_prescribed_format():
    for row in _rows():
        want, expr = _evaluate(row["question"]), _expr(row["question"])
        for completion in (f"{expr} = {want}\nThe answer is {want}", f"{expr} = {want}. The answer is {want}.",
                           f"The answer is {want}.", f"{expr} = {want}", f"{expr} = {want}.\n",
                           f"The answer is: **{want}**", f"\\boxed{{{want}}}"):
            assert gym_reward(row["prompt"], completion, [], row) == 1.0, (row["question"], completion)


def test_reward_rejects_wrong_answers():
    rows = [r for r in _rows(60) if _evaluate(r["question"]) != 0]
    assert len(rows) > 100
    for row in rows:
        want, expr = _evaluate(row["question"]), _expr(row["question"])
        for completion in (f"The answer is {want + 1}.", f"{expr} = {want - 10}",
                           f"The answer is {want}{abs(want)}.",  # reasoning-gym would give substring credit
                           f"The answer is {want}0.", f"The answer is {-want}.",
                           f"{expr} = {want + 1}\nThe answer is {want + 1}",
                           f"{expr} = {want}\nThe answer is {want + 1}",  # the stated answer counts
                           "The answer is", "The answer is N.", "", "I don't know.", expr, f"{expr} =",
                           f"{want} = {expr}", f"{expr} = {want} + 0 = "):
            assert gym_reward(row["prompt"], completion, [], row) == 0.0, (row["question"], completion)


def test_echoing_the_question_states_no_answer():
    # "Calculate 5 + 0." -> "5 + 0" contains the right number but states nothing
    assert final_answer("5 + 0") is None
    assert final_answer("To calculate 5 + 0 we add 5 and 0.") is None
    assert final_answer("95 + 76 = 16*2 = ") is None
    assert final_answer("26 + 28 = 54") == "54"
    assert final_answer("The answer is 54. Check: 54 - 28 = 26") == "54"
    assert final_answer("The answer is 1,234, I think") == "1,234"
    assert final_answer(" 54.\n") == "54" and final_answer("**-3**") == "-3"
    assert final_answer("54 apples") is None and final_answer("5 + 0") is None


def test_reward_survives_odd_items_and_text():
    row = gym_rows(_task(), "train")[0]
    want = row["answer"]
    assert gym_reward("", f"The answer is {want}", [], {**row, "gym_entry": json.dumps(row["gym_entry"])}) == 1.0
    assert gym_reward("", f"The answer is {want}", [], {"answer": want, "gym_dataset": "basic_arithmetic"}) == 1.0
    assert gym_reward("", None, [], row) == 0.0
    assert gym_reward("", "The answer is 3", [], {"gym_dataset": "no_such"}) == 0.0
    assert gym_reward("", "The answer is " + "9" * 5000, [], row) == 0.0


def test_instruction_per_dataset():
    gcd = _task(gym_dataset="gcd", gym_config={"min_numbers": 2, "max_numbers": 2, "max_value": 99}, size=5)
    row = gym_rows(gcd, "train")[0]
    assert row["prompt"] == f"{row['question']}\n{ANSWER_INSTRUCTION}"
    a, b = map(int, re.search(r"numbers: (\d+), (\d+)", row["question"]).groups())
    want = __import__("math").gcd(a, b)
    assert gym_reward(row["prompt"], f"The answer is {want}.", [], row) == 1.0
    assert gym_reward(row["prompt"], f"The answer is {want + 1}.", [], row) == 0.0
    assert gym_reward(row["prompt"], f"{want}", [], row) == 1.0  # "Give only the GCD": a bare number
    # countdown's questions carry their own format rules: nothing is appended
    cd = _task(gym_dataset="countdown", gym_config={"min_numbers": 3, "max_numbers": 3, "min_value": 1,
                                                     "max_value": 9, "min_target": 10, "max_target": 30}, size=3)
    row = gym_rows(cd, "train")[0]
    assert row["prompt"] == row["question"]
    assert final_answer("so <answer>(3 + 4) * 2</answer>") == "(3 + 4) * 2"


def test_reward_is_importable_by_spec():
    from distflow.tasks.rewards.registry import load_reward

    assert load_reward(_recipe()["reward"]) is gym_reward
