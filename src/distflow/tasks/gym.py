"""Procedurally generated tasks from reasoning-gym (task.name = reasoning_gym).

`gym_rows(task, split)` turns a reasoning-gym dataset into plain rows:

    {"prompt": question + answer-format instruction (see `instruction_for`), "answer": "...",
     "question": "...", "gym_dataset": "chain_sum", "gym_index": 17,
     "gym_entry": {"question", "answer", "metadata"}}

Every value is JSON-serialisable (the entry's tuples become lists). Split "train" is items
0..size-1 of the dataset seeded with `task.seed`; split "heldout" is drawn with
`task.heldout_seed` and keeps only items whose question (and expression, where the dataset
records one) does not occur in the training split, and no repeats, until `heldout_size` are
collected. reasoning-gym seeds item i with `seed + i`, so nearby seeds share items; this
filter is what makes the held-out split disjoint, not the choice of seeds.

`gym_reward` scores a completion with the dataset's own `score_answer` on the answer the
completion states (see `final_answer`: <answer> tags, \\boxed{}, "The answer is N", else the
result after the last "="; no last-number fallback, so echoing the question earns nothing), and
counts only a full score: reasoning-gym gives substring partial credit (reference "19", answer
"1919" scores 0.5), which a policy could learn to farm.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from distflow.config import ConfigError, TaskConfig
from distflow.tasks.rewards.numeric import extract_answer

# Appended to the questions of the datasets listed here; other datasets' questions are used as
# written (many, e.g. countdown, carry their own answer-format rules; task.system_prompt can add
# one). For arithmetic, SmolLM2-135M-Instruct asked this way mostly answers
# "26 + 28 = 54. The answer is 54." (measurements: recipes/task/gym_arith.yaml).
INSTRUCTION = "Write the equation with its result, then 'The answer is' and the number."
ANSWER_INSTRUCTION = "Give the final answer after 'The answer is'."
INSTRUCTIONS = {
    "basic_arithmetic": INSTRUCTION, "chain_sum": INSTRUCTION, "products": INSTRUCTION,
    "gcd": ANSWER_INSTRUCTION, "lcm": ANSWER_INSTRUCTION,
}
SPLITS = ("train", "heldout")
_NUM = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?(?!\d|,\d)"
# The number right after "The answer is" / "Answer:" / "####" (markdown bold or $ allowed between).
_STATED = re.compile(r"(?:answer\s*(?:is\b|:)|####)\s*:?\s*[*$]*\s*(" + _NUM + ")", re.IGNORECASE)
# Every "=", with the number right after it when there is one that is not itself the start of
# another expression ("= 16*2 =" states nothing).
_EQUALS = re.compile(r"=\s*[*$]*\s*(" + _NUM + r"(?!\s*[-+*/x×]\s*\d))?")
_BARE = re.compile(r"[*$]*(" + _NUM + r")[*$]*\.?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_DRAWS_PER_ITEM = 50  # held-out draws tried per wanted item before giving up


def gym_rows(task: TaskConfig, split: str) -> list[dict]:
    """The rows of `split` ("train" or "heldout") of the reasoning-gym task `task`."""
    if split not in SPLITS:
        raise ConfigError(f"reasoning_gym split must be one of {SPLITS}, got {split!r}")
    if split == "train":
        if task.size < 1:
            raise ConfigError(f"task.size must be >= 1, got {task.size}")
        ds = _dataset(task, task.seed, task.size)
        return [_row(task, ds[i], i) for i in range(task.size)]

    if task.heldout_size < 1:
        raise ConfigError("task.heldout_size is 0: this task has no held-out split")
    train = _dataset(task, task.seed, task.size)
    seen = set()
    for i in range(task.size):
        seen.update(_keys(train[i]))
    # Most generators are a pure function of (seed + index), so drawing past `size` is fine;
    # one that pre-generates `size` items raises IndexError there and we stop.
    ds = _dataset(task, task.heldout_seed, 4 * task.heldout_size)
    rows, draws = [], task.heldout_size * _MAX_DRAWS_PER_ITEM
    for i in range(draws):
        try:
            entry = ds[i]
        except IndexError:
            draws = i
            break
        keys = _keys(entry)
        if seen.intersection(keys):
            continue
        seen.update(keys)  # also no repeats inside the held-out split
        rows.append(_row(task, entry, i))
        if len(rows) == task.heldout_size:
            return rows
    raise ConfigError(
        f"reasoning_gym {task.gym_dataset} {task.gym_config}: only {len(rows)} distinct items not in the "
        f"training split after {draws} draws, fewer than task.heldout_size={task.heldout_size}; "
        f"make the task harder (more terms/digits) or the splits smaller")


def gym_reward(prompt: str, completion: str, completion_ids: list, item: dict) -> float:
    """1.0 if the completion's final answer is what reasoning-gym's scorer counts as fully
    correct for this item, else 0.0 (never raises on unreadable text)."""
    try:
        answer = final_answer(completion)
        if answer is None:
            return 0.0
        entry = item.get("gym_entry") or {"answer": str(item["answer"]), "metadata": {}}
        if isinstance(entry, str):  # rows that went through a file may carry it as JSON text
            entry = json.loads(entry)
        score = _scorer(item.get("gym_dataset") or entry["metadata"]["source_dataset"])(answer, entry)
        return 1.0 if score is not None and float(score) >= 1.0 else 0.0
    except Exception:  # noqa: BLE001 - a reward must score arbitrary text, not crash the step
        return 0.0


def final_answer(text: str) -> str | None:
    """The answer a completion states, or None when it states none. In order: the content of
    its last <answer>...</answer> (reasoning-gym's own convention); of its last \\boxed{...};
    the number right after its last "The answer is" (or "Answer:", "####"); the number right
    after its last "=" (the prescribed "26 + 28 = 54" form); a reply that is just a number
    ("Give only the result" questions). There is no last-number fallback:
    echoing the question ("6 - 0 ...") or stopping mid-calculation ("95 + 76 = 16*2 =") states
    nothing."""
    if not isinstance(text, str):
        return None
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    if "\\boxed{" in text:
        return extract_answer(text)
    stated = list(_STATED.finditer(text))
    if stated:
        return stated[-1].group(1).replace(" ", "")
    equals = list(_EQUALS.finditer(text))
    if equals:
        return equals[-1].group(1).replace(" ", "") if equals[-1].group(1) else None
    bare = _BARE.fullmatch(text.strip())  # a reply that is nothing but a number states it
    return bare.group(1) if bare else None


def _dataset(task: TaskConfig, seed: int, size: int):
    import reasoning_gym

    cfg = dict(task.gym_config or {})
    for key in ("seed", "size"):
        if key in cfg:
            raise ConfigError(f"task.gym_config must not set {key!r}: use task.{key} / task.heldout_{key}")
    try:
        return reasoning_gym.create_dataset(task.gym_dataset, seed=seed, size=size, **cfg)
    except ValueError as e:
        if "not registered" in str(e):
            raise ConfigError(f"task.gym_dataset {task.gym_dataset!r} is not a reasoning-gym dataset") from e
        raise ConfigError(f"reasoning_gym {task.gym_dataset} with gym_config {cfg}: {e}") from e
    except (TypeError, AssertionError) as e:
        raise ConfigError(f"reasoning_gym {task.gym_dataset}: bad task.gym_config {cfg}: {e}") from e


def _keys(entry: dict) -> set:
    """What identifies an item across splits: its question text and, if recorded, its expression."""
    keys = {("q", entry["question"].strip())}
    expression = (entry.get("metadata") or {}).get("expression")
    if isinstance(expression, str):
        keys.add(("e", " ".join(expression.split())))
    return keys


def instruction_for(dataset: str) -> str | None:
    """The answer-format instruction appended to the questions of `dataset` (None: none)."""
    return INSTRUCTIONS.get(dataset)


def _row(task: TaskConfig, entry: dict, index: int) -> dict[str, Any]:
    entry = json.loads(json.dumps(entry, default=str))  # tuples -> lists; anything exotic -> str
    instruction = instruction_for(task.gym_dataset)
    answer = entry.get("answer")
    row = {
        "prompt": entry["question"] + (f"\n{instruction}" if instruction else ""),
        "answer": None if answer is None else str(answer),  # None: the loader skips and counts it
        "question": entry["question"],
        "gym_dataset": task.gym_dataset,
        "gym_index": index,
        "gym_entry": entry,
    }
    # the entry's metadata as top-level fields, which built-in rewards read from the row
    # (countdown: numbers, target); the row's own keys win
    metadata = entry.get("metadata")
    return {**metadata, **row} if isinstance(metadata, dict) else row


@lru_cache(maxsize=None)
def _scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)
