"""Load a prompt/answer dataset (a local file, a Hugging Face Hub dataset, or a procedural
reasoning-gym task) and render each prompt with the chat template (PromptEncoder: what a row
writes is text, never the template's control tokens)."""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass, field

import datasets

from distflow.config import ConfigError, TaskConfig

logger = logging.getLogger("distflow")

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_TEXT_FORMATS = (".jsonl", ".json", ".csv")
# A path ending in one of these names a file, never a hub dataset (so a typo says "not a file").
_FILE_EXTS = {*_BUILDERS, ".txt", ".tsv", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".jsonl.gz"}
# owner/name[:config][@split], e.g. "openai/gsm8k:main", "openai/gsm8k:main@test[:100]".
_HUB_NAME = re.compile(r"(?P<name>[A-Za-z0-9][\w.-]*/[\w.-]*\w)(?::(?P<config>[\w.-]+))?(?:@(?P<split>\S+))?")


@dataclass
class PromptItem:
    prompt_ids: list[int]  # chat-templated prompt, generation prompt included
    prompt_text: str  # the same prompt as rendered text
    answer: str  # reference answer, as a string
    fields: dict  # the raw row, for task-specific rewards
    messages: list = field(default_factory=list)  # the prompt as chat messages (reward models render their own)


def load_prompts(task: TaskConfig, tokenizer, max_prompt_tokens: int, split: str = "train", env=None) -> list[PromptItem]:
    """Read the task's `split` ("train" or "heldout") and return one PromptItem per usable row.

    File tasks read `task.path` (train) or `task.heldout_path`: a local jsonl/json/parquet/csv
    file or, when that is no existing path, a Hub dataset `owner/name[:config][@split]` (see
    `_read_hub`). Procedural tasks (`task.name=reasoning_gym`) generate their rows from seeds
    (distflow.tasks.gym).

    Bad rows, each kind counted and logged once, never silently:
    - a prompt that is missing, not a string, or blank: the row is skipped;
    - an answer that is missing, null (NaN) or blank: the row is skipped (a reward must never
      compare against the text "None");
    - a prompt longer than `max_prompt_tokens`: dropped, never truncated (a cut prompt is a
      different question);
    - a prompt that repeats an earlier one: kept (every row is a prompt; repeats weigh it more),
      with one warning giving the count and how many of them disagree on the answer.
    A missing/unreadable/empty file, a non-UTF-8 text file, a prompt or answer column that does
    not exist, or no usable row at all raises ConfigError.

    With an environment (distflow.tasks.envs) its `reset(row, messages)` gives each episode's first
    messages (the length limit applies to what it returns).
    """
    rows, source = _task_rows(task, split)
    columns = list(rows[0])
    for role, key in (("prompt_key", task.prompt_key), ("answer_key", task.answer_key)):
        if key not in columns:
            raise ConfigError(f"task.{role} {key!r} is not a column of {source}; columns: {columns}")

    encode = PromptEncoder(tokenizer)
    items, bad, no_answer, too_long = [], 0, 0, 0
    first_answer: dict[str, str] = {}
    repeats, conflicting = 0, 0
    for row in rows:
        messages = _as_messages(row.get(task.prompt_key))
        if messages is None:
            bad += 1
            continue
        answer = _answer_text(row.get(task.answer_key))
        if answer is None:
            no_answer += 1
            continue
        if task.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": task.system_prompt})
        if env is not None:
            messages = env.reset(row, messages)
        prompt = json.dumps(messages)  # identity of the prompt, for the repeat count
        ids, text = encode(messages)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        if prompt in first_answer:
            repeats += 1
            conflicting += first_answer[prompt] != answer
        else:
            first_answer[prompt] = answer
        items.append(PromptItem(ids, text, answer, row, messages))

    if bad:
        logger.warning("skipped %d of %d rows of %s whose %r is missing, empty, or neither a string nor chat messages",
                       bad, len(rows), source, task.prompt_key)
    if no_answer:
        logger.warning("skipped %d of %d rows of %s whose answer %r is missing, null or empty",
                       no_answer, len(rows), source, task.answer_key)
    if too_long:
        logger.warning("dropped %d of %d prompts of %s longer than rollout.max_prompt_tokens=%d",
                       too_long, len(rows), source, max_prompt_tokens)
    if repeats:
        logger.warning("%d of %d kept rows of %s repeat an earlier prompt (%d of them with a different answer); "
                       "kept: every row is a prompt, so repeated ones are sampled more often",
                       repeats, len(items), source, conflicting)
    if not items:
        raise ConfigError(f"no usable prompts in {source}: {bad} rows without a prompt string, "
                          f"{no_answer} without an answer, "
                          f"{too_long} longer than rollout.max_prompt_tokens={max_prompt_tokens}")
    return items


class PromptEncoder:
    """Chat messages from data (a dataset row, task.system_prompt, an environment's reset) as the
    prompt's token ids and rendered text: the one place where data text becomes token ids.

    Why not apply_chat_template(tokenize=True): it encodes the rendered text as a whole, so
    special-token text written inside a message (`<|im_end|>`, `<|eot_id|>`) became the control
    token, and a row could close its turn and open others. Here the template's own markers stay
    control tokens and every message's content is text (split_special_tokens, as the rollout
    encodes observations).

    Contents without special-token text are encoded exactly as before: the rendered text in one
    tokenizer call, which is all apply_chat_template(tokenize=True) does. Otherwise the special-token
    text in the contents is held out (a placeholder) while the template renders, the template's
    control tokens are located in that rendering by the tokenizer itself (its own matching and
    whitespace-strip rules), and each stretch between two of them, the held text put back, is
    encoded with split_special_tokens: the tokenizer's own splits, less those inside content.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.specials: dict[int, str] = {i: t.content for i, t in added.items() if t.special and t.content}
        for text in tokenizer.all_special_tokens:
            self.specials.setdefault(tokenizer.convert_tokens_to_ids(text), text)
        texts = sorted(set(self.specials.values()), key=len, reverse=True)
        self.ids = {text: i for i, text in self.specials.items()}
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], str]:
        """(token ids, rendered text) of `messages` with the generation prompt (and the `tools` offered,
        in the template's own way of listing them)."""
        if self.pattern is None or not any(self.pattern.search(m["content"]) for m in messages):
            text = _render(self.tokenizer, messages, tools)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text
        used = "".join(m["content"] for m in messages) + str(getattr(self.tokenizer, "chat_template", ""))
        mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)  # private use: not in this text
        held: list[str] = []

        def hold(m: re.Match) -> str:
            held.append(m.group())
            return f"{mark}{len(held) - 1}{mark}"

        shown = _render(self.tokenizer, [{**m, "content": self.pattern.sub(hold, m["content"])} for m in messages],
                        tools)
        held_back = re.compile(f"{mark}(\\d+){mark}")

        def restore(part: str) -> str:
            return held_back.sub(lambda m: held[int(m.group(1))], part)

        ids: list[int] = []
        start = 0
        for a, b, token in self._control_tokens(shown):
            ids += self._as_text(restore(shown[start:a])) + [token]
            start = b
        return ids + self._as_text(restore(shown[start:])), restore(shown)

    def _control_tokens(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, id) of each special token the tokenizer matches in `text`, the whitespace
        it strips included; a tokenizer without offsets (a slow one): each special token's text,
        widened by its lstrip/rstrip."""
        if not getattr(self.tokenizer, "is_fast", False):
            return self._matched(text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [(a, b, i) for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                if i in self.specials and text[a:b].strip() == self.specials[i].strip()]

    def _matched(self, text: str) -> list[tuple[int, int, int]]:
        """_control_tokens without the tokenizer's offsets: each special token's text, widened over
        the whitespace its lstrip/rstrip takes."""
        found, added = [], getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        for m in self.pattern.finditer(text):
            a, b, token = m.start(), m.end(), self.ids[m.group()]
            flags = added.get(token)
            while getattr(flags, "lstrip", False) and a > (found[-1][1] if found else 0) and text[a - 1].isspace():
                a -= 1
            while getattr(flags, "rstrip", False) and b < len(text) and text[b].isspace():
                b += 1
            found.append((a, b, token))
        return found

    def _as_text(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template applied to a prompt, as text; a template that refuses it (Gemma's refuses a
    system turn, some refuse roles out of order) is a one-line ConfigError naming the role and the model."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja raises its own types (TemplateError from raise_exception)
        model = getattr(tokenizer, "name_or_path", "") or "the model"
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        roles = [m["role"] for m in messages]
        # the role whose messages, left out, let the rest render
        refused = next((r for r in dict.fromkeys(roles)
                        if _renders(tokenizer, [m for m in messages if m["role"] != r])), None)
        what = f"the {refused!r} role" if refused else f"these prompt messages (roles {roles})"
        where = ("task.system_prompt, the dataset's messages or the environment (task.env)" if refused == "system"
                 else "the dataset's messages or the environment (task.env)")
        raise ConfigError(f"the chat template of {model} refuses {what} ({reason}); it came from {where}") from None


def _renders(tokenizer, messages: list[dict]) -> bool:
    if not messages:
        return False
    try:
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - as in _render
        return False
    return True


def _answer_text(answer) -> str | None:
    """The reference answer as a string; None when there is none (missing, null, NaN, blank).
    A float with no fractional part is written as an integer ("3", not "3.0"): a CSV column of
    integers with one empty cell is read as floats, and a string reward should still see "3"."""
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return None
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = answer if isinstance(answer, str) else str(answer)
    return text if text.strip() else None


def _as_messages(prompt) -> list[dict] | None:
    """A prompt column holds either a non-empty string (one user turn) or a chat `messages`
    list of {"role", "content"} dicts (used as given). Anything else is None (a bad row)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt.strip() else None
    if (isinstance(prompt, list) and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt)
            and any(m["content"].strip() for m in prompt)):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return None


def _task_rows(task: TaskConfig, split: str) -> tuple[list[dict], str]:
    if task.name == "reasoning_gym":
        from distflow.tasks.gym import gym_rows

        return gym_rows(task, split), f"reasoning_gym:{task.gym_dataset}:{split}"
    if task.name != "jsonl":
        raise ConfigError(f"unknown task.name {task.name!r}: expected 'jsonl' (a local file or hub dataset) "
                          f"or 'reasoning_gym'")
    if split == "train":
        return _read_rows(task.path, task.split, "task.path"), task.path
    if not task.heldout_path:
        raise ConfigError("validation needs a held-out split: set task.heldout_path")
    return _read_rows(task.heldout_path, task.split, "task.heldout_path", hub_split="test"), task.heldout_path


def _read_rows(path: str, hf_split: str, key: str, hub_split: str | None = None) -> list[dict]:
    """Rows of a local file; if `path` is no existing path but looks like a hub dataset name,
    rows of that hub dataset (split: its "@split" suffix, else `hub_split` or `hf_split`)."""
    if not path:
        raise ConfigError(f"{key} is not set: give a local jsonl/json/parquet/csv file or a hub dataset name")
    if not os.path.isfile(path):
        hub = _hub_spec(path)
        if hub is not None:
            name, config, split = hub
            return _read_hub(path, name, config, split or hub_split or hf_split, key)
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
    except Exception as e:  # noqa: BLE001 - pyarrow/pandas parse errors come in many types
        if ext in _TEXT_FORMATS and (problem := _utf8_problem(path)):
            raise ConfigError(problem) from e
        if ext == ".jsonl" and (problem := _jsonl_problem(path)):
            raise ConfigError(problem) from e
        if isinstance(e, ValueError) and "corresponds to no data" in str(e):  # e.g. a CSV with only a header
            raise ConfigError(f"dataset {path} has no rows") from e
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"could not read dataset {path}: {detail}") from e
    if not rows:
        raise ConfigError(f"dataset {path} has no rows")
    return rows


def _hub_spec(path: str) -> tuple[str, str | None, str | None] | None:
    """(name, config, split) if `path` looks like a hub dataset `owner/name[:config][@split]`
    and is no existing path; None otherwise (a missing local file, an absolute path, ...)."""
    m = _HUB_NAME.fullmatch(path)
    if m is None or os.path.exists(path):
        return None
    name = m.group("name")
    lower = name.lower()
    if any(lower.endswith(ext) for ext in _FILE_EXTS):
        return None
    return name, m.group("config"), m.group("split")


def _read_hub(path: str, name: str, config: str | None, split: str, key: str) -> list[dict]:
    """A hub dataset through the datasets library and its usual cache (offline: only if cached)."""
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")]
    where = f"{name!r}" + (f" (config {config!r})" if config else "") + f", split {split!r}"
    try:
        rows = datasets.load_dataset(name, config, split=split).to_list()
    except Exception as e:  # noqa: BLE001 - network, auth, missing config/split: all the user's to fix
        need = (f"{' and '.join(offline)} {'is' if len(offline) == 1 else 'are'} set, so only an already cached "
                f"copy can be used: " if offline else "")
        raise ConfigError(
            f"{key} {path!r} is not a local file, and loading it as a Hugging Face Hub dataset {where} failed "
            f"({type(e).__name__}: {str(e)[:300]}). {need}a hub dataset needs network access; otherwise save it "
            f"as a local jsonl/parquet file and point {key} at that file") from e
    if not rows:
        raise ConfigError(f"hub dataset {where} has no rows")
    return rows


def _jsonl_problem(path: str) -> str | None:
    """A message naming the first line of a (UTF-8) jsonl file that is not one JSON object; the
    datasets library says only that generating the dataset failed."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except ValueError as e:
                reason = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                return f"dataset {path}: line {number} is not JSON ({reason}): {line.strip()[:60]!r}"
            if not isinstance(row, dict):
                return f"dataset {path}: line {number} is a JSON {type(row).__name__}, not an object of columns"
    return None


def _utf8_problem(path: str) -> str | None:
    """A message naming the first byte of `path` that is not UTF-8 (offset and line); None if it all is."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, newlines = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a sequence split across chunks
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                pos = offset - pending + e.start
                line = newlines + chunk[: max(0, pos - offset)].count(b"\n") + 1
                byte = (e.object[e.start:e.start + 1] or b"?").hex()
                return (f"dataset {path} is not valid UTF-8: byte 0x{byte} at offset {pos} (line {line}); "
                        f"re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
            if not chunk:
                return None
            offset += len(chunk)
            newlines += chunk.count(b"\n")
