"""Load a prompt/answer dataset from a local file and render each prompt with the chat template."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import datasets

from distflow.config import ConfigError, TaskConfig

logger = logging.getLogger("distflow")

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class PromptItem:
    prompt_ids: list[int]  # chat-templated prompt, generation prompt included
    prompt_text: str  # the same prompt as rendered text
    answer: str  # reference answer, as a string
    fields: dict  # the raw row, for task-specific rewards


def load_prompts(task: TaskConfig, tokenizer, max_prompt_tokens: int, split: str = "train") -> list[PromptItem]:
    """Read the task's `split` ("train" or "heldout") and return one PromptItem per usable row.

    File tasks read `task.path` (train) or `task.heldout_path`; procedural tasks
    (`task.name=reasoning_gym`) generate their rows from seeds (distflow.tasks.gym).

    Rows whose prompt is not a non-empty string are skipped, and prompts longer than
    `max_prompt_tokens` are dropped (never truncated: a cut prompt is a different question);
    each kind is counted and logged once. Everything else that is wrong raises ConfigError.
    """
    rows, source = _task_rows(task, split)
    columns = list(rows[0])
    for role, key in (("prompt_key", task.prompt_key), ("answer_key", task.answer_key)):
        if key not in columns:
            raise ConfigError(f"task.{role} {key!r} is not a column of {source}; columns: {columns}")

    items, bad, too_long = [], 0, 0
    for row in rows:
        prompt = row[task.prompt_key]
        if not isinstance(prompt, str) or not prompt.strip():
            bad += 1
            continue
        messages = [{"role": "user", "content": prompt}]
        if task.system_prompt:
            messages.insert(0, {"role": "system", "content": task.system_prompt})
        ids = _as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        items.append(PromptItem(ids, text, str(row[task.answer_key]), row))

    if bad:
        logger.warning("skipped %d of %d rows of %s whose %r is not a non-empty string",
                       bad, len(rows), source, task.prompt_key)
    if too_long:
        logger.warning("dropped %d of %d prompts of %s longer than rollout.max_prompt_tokens=%d",
                       too_long, len(rows), source, max_prompt_tokens)
    if not items:
        raise ConfigError(f"no usable prompts in {source}: {bad} rows without a prompt string, "
                          f"{too_long} longer than rollout.max_prompt_tokens={max_prompt_tokens}")
    return items


def _task_rows(task: TaskConfig, split: str) -> tuple[list[dict], str]:
    if task.name == "reasoning_gym":
        from distflow.tasks.gym import gym_rows

        return gym_rows(task, split), f"reasoning_gym:{task.gym_dataset}:{split}"
    if task.name != "jsonl":
        raise ConfigError(f"unknown task.name {task.name!r}: expected 'jsonl' (any local file) or 'reasoning_gym'")
    if split == "train":
        return _read_rows(task.path, task.split, "task.path"), task.path
    if not task.heldout_path:
        raise ConfigError("validation needs a held-out split: set task.heldout_path")
    return _read_rows(task.heldout_path, task.split, "task.heldout_path"), task.heldout_path


def _read_rows(path: str, hf_split: str, key: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ConfigError(f"{key} {path!r} is not a file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _BUILDERS:
        raise ConfigError(f"{key} {path!r}: unknown extension {ext!r}, expected one of {sorted(_BUILDERS)}")
    if os.path.getsize(path) == 0:
        raise ConfigError(f"dataset {path} has no rows")
    # A private cache per call: ranks loading the same file at once share no cache files or locks,
    # and nothing is written under the user's home. keep_in_memory lets the folder go right away.
    try:
        with tempfile.TemporaryDirectory(prefix="distflow-data-") as cache_dir:
            ds = datasets.load_dataset(_BUILDERS[ext], data_files=path, split=hf_split,
                                       cache_dir=cache_dir, keep_in_memory=True)
            rows = ds.to_list()
    except ValueError as e:
        if "corresponds to no data" in str(e):  # e.g. a CSV with only a header
            raise ConfigError(f"dataset {path} has no rows") from e
        raise ConfigError(f"could not read dataset {path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - pyarrow/pandas parse errors come in many types
        raise ConfigError(f"could not read dataset {path}: {type(e).__name__}: {e}") from e
    if not rows:
        raise ConfigError(f"dataset {path} has no rows")
    return rows


def _as_id_list(out) -> list[int]:
    """apply_chat_template(tokenize=True) gives a BatchEncoding in transformers 5 (return_dict=True
    is the default there), a list in 4.x; either may be batched or a tensor. Return a flat list."""
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        (out,) = out
    return [int(i) for i in out]
