"""Bad inputs: each has one defined behaviour, tested here or in the file named (unit/ unless a
folder is given).

Datasets (distflow.tasks.prompts.load_prompts):
  file not found / a folder          ConfigError "... is not a file"       test_data.py::test_missing_file
  path not set                       ConfigError "task.path is not set"    here
  unknown format (extension)         ConfigError "unknown extension"       test_data.py::test_unknown_extension
  empty file (or header only)        ConfigError "has no rows"             test_data.py::test_empty_file,
                                                                           every rank: distributed/test_trainer_loop.py
  unparseable file                   ConfigError naming the first line that is not JSON  test_data.py::test_unparseable_file, here (jsonl)
  non-UTF-8 bytes (jsonl/json/csv)   ConfigError naming file, byte, offset and line                     here
  prompt column absent               ConfigError listing the columns       test_data.py::test_missing_prompt_key,
                                                                           every rank: distributed/test_trainer_loop.py
  answer column absent               ConfigError listing the columns       test_data.py::test_missing_answer_key
  a row without the prompt key       row skipped, counted, one warning     here
  non-string prompt                  row skipped, counted, one warning     test_data.py::test_non_string_prompts_skipped
  empty / blank / null prompt        row skipped, counted, one warning     test_data.py::test_bad_prompts_skipped
  prompt over max_prompt_tokens      dropped whole (never truncated), counted, one warning
                                                                           test_data.py::test_long_prompts_dropped_and_logged_once
  every row unusable                 ConfigError "no usable prompts"       test_data.py::test_all_prompts_too_long, here
  answer missing/null/NaN/blank      row skipped, counted, one warning (never scored against "None")   here
  duplicate rows                     kept (every row is a prompt), one warning with the count          here
  hub dataset name while offline     ConfigError naming the dataset: needs network or a local file     here
  a chat template refusing a role    ConfigError naming the role, the model and where the role came from  here
Rewards (distflow.tasks.rewards.pool.RewardPool):
  a reward that raises               0.0, counted as reward/errors, logged once
                                                      test_reward_pool.py::test_raise_scores_zero_counts_and_logs_once
  a reward that never returns        0.0 after task.reward_timeout_s, reward/timeouts, worker replaced
                                                      test_reward_pool.py::test_hang_is_bounded_and_others_proceed,
                                                      ::test_timeout_is_per_call_not_per_batch; in a run:
                                                      distributed/test_trainer_loop.py
  a reward returning a string etc.   0.0, counted as reward/invalid       test_reward_pool.py::test_invalid_returns
  a reward beyond float32 (1e300)    0.0, counted as reward/invalid       test_hostile_inputs.py
  a reward that kills its worker     0.0, counted as an error, worker replaced
                                                      test_reward_pool.py::test_crashed_workers_are_replaced
  a reward spec that does not import ConfigError before any worker starts
                                                      test_reward_pool.py::test_bad_spec_fails_before_spawning;
                                                      end to end ("distflow: error:" on every rank):
                                                      e2e/test_failures.py
"""

from __future__ import annotations

import logging

import pytest

from distflow.config import ConfigError, TaskConfig
from distflow.tasks import load_prompts
from distflow.tasks import prompts as prompts_module
from data_helpers import CHAT_TEMPLATE, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()  # one token per word: "what is one" -> 5 ids with the chat markers


def task(path, **kw) -> TaskConfig:
    return TaskConfig(path=str(path), prompt_key="question", answer_key="label", **kw)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "distflow"]


GOOD = [{"question": "what is one plus one", "label": 2}, {"question": "what is two plus two", "label": 4}]


# ----------------------------------------------------------------------------- rows
def test_path_not_set(tokenizer):
    with pytest.raises(ConfigError, match="task.path is not set"):
        load_prompts(TaskConfig(prompt_key="question", answer_key="label"), tokenizer, 64)


def test_row_without_prompt_key_is_skipped(tmp_path, tokenizer, caplog):
    rows = GOOD + [{"label": 3}, {"prompt": "what is one", "label": 1}]
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)
    assert [i.answer for i in items] == ["2", "4"]
    (warning,) = warnings_of(caplog)
    assert "skipped 2 of 4 rows" in warning and "'question' is missing" in warning


def test_missing_answers_are_skipped_never_scored_as_none(tmp_path, tokenizer, caplog):
    rows = GOOD + [{"question": "what is one", "label": None}, {"question": "what is two"},
                   {"question": "what is one plus two", "label": ""}, {"question": "be brief", "label": "  "},
                   {"question": "what is two plus one", "label": 0}]  # 0 is an answer
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)
    assert [i.answer for i in items] == ["2", "4", "0"]
    (warning,) = warnings_of(caplog)
    assert "skipped 4 of 7 rows" in warning and "answer 'label' is missing, null or empty" in warning


def test_missing_answers_in_csv_and_parquet(tmp_path, tokenizer, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.csv").write_text("question,label\nwhat is one,1\nwhat is two,\nwhat is one plus two,3\n")
    pq.write_table(pa.Table.from_pylist([{"question": "what is one", "label": 1.5},
                                         {"question": "what is two", "label": None}]), tmp_path / "d.parquet")
    with caplog.at_level(logging.WARNING, logger="distflow"):
        csv_items = load_prompts(task(tmp_path / "d.csv"), tokenizer, 64)  # read as floats 1.0, NaN, 3.0
        parquet_items = load_prompts(task(tmp_path / "d.parquet"), tokenizer, 64)
    assert [i.answer for i in csv_items] == ["1", "3"]
    assert [i.answer for i in parquet_items] == ["1.5"]
    assert [w.split(" rows")[0] for w in warnings_of(caplog)] == ["skipped 1 of 3", "skipped 1 of 2"]


def test_no_answers_at_all(tmp_path, tokenizer):
    rows = [{"question": "what is one", "label": None}, {"question": "what is two", "label": None}]
    with pytest.raises(ConfigError, match="no usable prompts.*2 without an answer"):
        load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)


def test_duplicates_are_kept_and_counted_once(tmp_path, tokenizer, caplog):
    rows = GOOD + GOOD + [{"question": "what is one plus one", "label": 3}, {"question": "what is one", "label": 1}]
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)
    assert [i.answer for i in items] == ["2", "4", "2", "4", "3", "1"]  # all kept, in order
    (warning,) = warnings_of(caplog)
    assert warning.startswith("3 of 6 kept rows") and "(1 of them with a different answer)" in warning


def test_no_warnings_for_clean_data(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="distflow"):
        load_prompts(task(write_jsonl(tmp_path / "d.jsonl", GOOD)), tokenizer, 64)
    assert warnings_of(caplog) == []


# ----------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("name,lines,bad_line", [
    ("d.jsonl", [b'{"question": "what is one", "label": 1}', b'{"question": "what is two", "label": 2}',
                 b'{"question": "caf\xe9 one", "label": 3}'], 3),  # latin-1 e-acute
    ("d.json", [b'[{"question": "what is one", "label": 1},', b' {"question": "\xff", "label": 2}]'], 2),
    ("d.csv", [b"question,label", b"what is one,1", b"what is \x80two,2"], 3),
])
def test_non_utf8_names_file_offset_and_line(tmp_path, tokenizer, name, lines, bad_line):
    data = b"\n".join(lines) + b"\n"
    (tmp_path / name).write_bytes(data)
    offset = next(i for i, b in enumerate(data) if b >= 0x80)
    with pytest.raises(ConfigError) as e:
        load_prompts(task(tmp_path / name), tokenizer, 64)
    msg = str(e.value)
    assert str(tmp_path / name) in msg and "not valid UTF-8" in msg, msg
    assert f"byte 0x{data[offset]:02x} at offset {offset} (line {bad_line})" in msg, msg
    assert "\n" not in msg and "Traceback" not in msg


def test_utf8_check_across_chunks():
    """The check reads 1 MiB at a time: a character split between chunks is fine, a bad byte far
    into the file is located exactly, and a character cut off at the end of the file is reported."""
    import tempfile

    chunk = 1 << 20
    head = b"a" * (chunk - 1) + "é".encode() + b"\n"  # é's two bytes straddle the first chunk boundary
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(head + b"ok\n" * 1000)
        f.flush()
        assert prompts_module._utf8_problem(f.name) is None
        f.write(b"x\xc0y\n")
        f.flush()
        bad = len(head) + 3 * 1000 + 1
        assert f"byte 0xc0 at offset {bad} (line 1002)" in prompts_module._utf8_problem(f.name)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(b"ok\n" + "é".encode()[:1])
        f.flush()
        assert "byte 0xc3 at offset 3 (line 2)" in prompts_module._utf8_problem(f.name)


def test_malformed_json_is_not_called_an_encoding_problem(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text('{"question": "what is one", "label": 1}\n{"question": \n')
    with pytest.raises(ConfigError, match=r"d.jsonl: line 2 is not JSON \(Expecting value at column 14\)") as e:
        load_prompts(task(tmp_path / "d.jsonl"), tokenizer, 64)
    assert "UTF-8" not in str(e.value)


# ----------------------------------------------------------------------------- hub datasets
def test_hub_dataset_offline_is_a_clear_error(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = "distflow-tests/no-such-dataset:main"  # never in any cache
    with pytest.raises(ConfigError) as e:
        load_prompts(TaskConfig(path=path, prompt_key="question"), tokenizer, 64)
    msg = str(e.value)
    assert "task.path 'distflow-tests/no-such-dataset:main' is not a local file" in msg, msg
    assert "'distflow-tests/no-such-dataset' (config 'main'), split 'train'" in msg, msg
    assert "HF_HUB_OFFLINE" in msg and "needs network access" in msg and "local jsonl/parquet file" in msg, msg


def test_hub_names_and_splits(tokenizer, monkeypatch, tmp_path):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, **kw):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"question": "what is one", "answer": "1"}])

    monkeypatch.setattr(prompts_module.datasets, "load_dataset", fake_load_dataset)
    t = TaskConfig(path="openai/gsm8k:main", heldout_path="openai/gsm8k:main", prompt_key="question")
    assert [i.answer for i in load_prompts(t, tokenizer, 64)] == ["1"]
    load_prompts(t, tokenizer, 64, split="heldout")  # held-out defaults to the "test" split
    load_prompts(TaskConfig(path="owner/name.v2@validation[:10]", prompt_key="question"), tokenizer, 64)
    load_prompts(TaskConfig(path="owner/name", split="train[:5%]", prompt_key="question"), tokenizer, 64)
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test"),
                     ("owner/name.v2", None, "validation[:10]"), ("owner/name", None, "train[:5%]")]
    # Names of files are never taken for hub datasets; neither are absolute paths or folders.
    for path in ("data/missing.jsonl", "data/missing.parquet", str(tmp_path / "x/y"), "/abs/owner/name"):
        with pytest.raises(ConfigError, match="is not a file"):
            load_prompts(TaskConfig(path=path, prompt_key="question"), tokenizer, 64)
    (tmp_path / "owner" / "folder").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="is not a file"):
        load_prompts(TaskConfig(path="owner/folder", prompt_key="question"), tokenizer, 64)
    assert len(calls) == 4


@pytest.mark.parametrize("refusing,role,overrides", [
    # Gemma's template: no system turn
    ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
     "system", {"system_prompt": "be brief"}),
    # a template that knows only user and assistant turns, given a chat-messages prompt with another role
    ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
     "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}", "developer", {}),
])
def test_a_template_that_refuses_a_role_is_one_config_error(tmp_path, refusing, role, overrides):
    tok = make_tokenizer()
    tok.chat_template, tok.name_or_path = refusing + CHAT_TEMPLATE, "org/strict-model"
    rows = [{"question": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "what is one"}]
             if role == "developer" else "what is one", "label": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    if role == "system":
        assert len(load_prompts(task(path), tok, 64)) == 1  # without a system turn it renders
    with pytest.raises(ConfigError) as e:
        load_prompts(task(path, **overrides), tok, 64)
    line = str(e.value)
    assert line.startswith(f"the chat template of org/strict-model refuses the '{role}' role (")
    assert "\n" not in line and "it came from " in line
    assert ("task.system_prompt" in line) == (role == "system")
