"""Inputs the policy controls (its tool calls) and numbers a reward returns: each ends as an error
the model reads or a counted invalid reward, never as a crashed step or an inf in the advantages."""

from __future__ import annotations

import pytest
import torch

from data_helpers import make_tokenizer
from distflow.tasks.prompts import PromptItem
from distflow.tasks.envs import ToolEnv
from distflow.tasks.envs.calculator import Calculator
from distflow.tasks.envs.parsers import ToolCallError, hermes_tool_calls
from distflow.tasks.rewards.pool import RewardPool
from distflow.rollout.scoring import score_groups
from distflow.sample import Sample

LONG = "1" * 5000  # past Python's int-string conversion limit (4300 digits): json.loads raises ValueError


@pytest.mark.parametrize("call", [
    f'{{"name": "calculator", "arguments": {{"expression": "1", "n": {LONG}}}}}',
    f'{{"name": "calculator", "arguments": "{{\\"n\\": {LONG}}}"}}',  # arguments as a JSON string
    f'{{"name": "calculator", "arguments": {{}}, "id": -{LONG}}}',
])
def test_an_integer_too_long_to_read_is_an_error_observation(call):
    text = f"I will compute. <tool_call>{call}</tool_call>"
    with pytest.raises(ToolCallError, match="a number too long to read: Exceeds the limit"):
        hermes_tool_calls(text)
    step = ToolEnv(tools=["calculator"]).step({}, [{"role": "assistant", "content": text}])
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 1, 1)
    assert step.messages[0]["role"] == "tool" and step.messages[0]["content"].startswith("error: ")
    assert len(step.messages[0]["content"]) < 300


@pytest.mark.parametrize("expression,reason", [
    ("10**5000", "exponent 5000 is too large"),
    (LONG, "longer than 2000 characters"),  # a literal the parser could not even convert
    ("9" * 1500, "more than 1000 digits"),
    ("10**999 * 10**999", "more than 1000 digits"),
    ("1e400", "not a finite number"),
    ("10**308 * 1.0 * 10**308", "not a finite number"),
    ("(" * 500 + "1" + ")" * 500, "nested parentheses"),
])
def test_the_calculator_refuses_numbers_it_cannot_print(expression, reason):
    result = Calculator()({"expression": expression})
    assert result.error and result.output.startswith("error: ") and reason in result.output


def test_a_reward_past_float32_is_counted_invalid_and_scored_zero():
    """1e300 is finite in float64 and inf in float32: it is an invalid reward, not an inf advantage."""
    tok = make_tokenizer()
    items = [PromptItem([1], "p", "1", {"mode": "ok"})]
    # misbehave returns float(len(completion)); the weight scales it past float32's range, except for ""
    samples = [Sample([1], ids, [0.0] * len(ids), False) for ids in ([4, 5], [], [4])]
    with RewardPool({"rewards_for_tests:misbehave": 1e300}, workers=0, timeout_s=5) as pool:
        rewards, counts = score_groups(pool, tok, items, samples, group_size=3)
    assert rewards.dtype == torch.float32 and torch.isfinite(rewards).all()
    assert rewards.tolist() == [[0.0, 0.0, 0.0]] and counts["invalid"] == 2
    with RewardPool({"rewards_for_tests:misbehave": 1e30}, workers=0, timeout_s=5) as pool:
        rewards, counts = score_groups(pool, tok, items, samples, group_size=3)
    assert counts["invalid"] == 0  # within float32's range: kept as it is
    assert rewards.tolist() == torch.tensor([[1e30 * len("what is"), 0.0, 1e30 * len("what")]]).tolist()
