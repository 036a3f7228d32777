"""Prompt loading (jsonl/parquet/csv, bad inputs) and the per-rank sampler."""

from __future__ import annotations

import logging
import multiprocessing as mp

import pytest

from distflow.config import ConfigError, TaskConfig
from distflow.tasks import PromptItem, ShardedSampler, load_prompts
from data_helpers import make_tokenizer, write_jsonl

@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


ROWS = [
    {"question": "what is one plus one", "label": 2, "id": 0},
    {"question": "what is two plus two", "label": 4, "id": 1},
    {"question": "what is one plus two", "label": 3, "id": 2},
]


def task(path, **kw) -> TaskConfig:
    return TaskConfig(path=str(path), prompt_key="question", answer_key="label", **kw)


def check_rows(items):
    assert [type(i) for i in items] == [PromptItem] * 3
    assert [i.answer for i in items] == ["2", "4", "3"]
    assert [i.fields["id"] for i in items] == [0, 1, 2]
    # [user]=2 what=4 is=5 one=6 plus=7 one=6 [assistant]=3
    assert items[0].prompt_ids == [2, 4, 5, 6, 7, 6, 3]
    assert all(type(t) is int for i in items for t in i.prompt_ids)
    assert items[0].prompt_text == "[user] what is one plus one [assistant]"


def test_load_jsonl(tmp_path, tokenizer):
    check_rows(load_prompts(task(write_jsonl(tmp_path / "d.jsonl", ROWS)), tokenizer, 64))


def test_load_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    check_rows(load_prompts(task(tmp_path / "d.parquet"), tokenizer, 64))


def test_load_csv(tmp_path, tokenizer):
    lines = ["question,label,id"] + [f"{r['question']},{r['label']},{r['id']}" for r in ROWS]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    check_rows(load_prompts(task(tmp_path / "d.csv"), tokenizer, 64))


def test_system_prompt(tmp_path, tokenizer):
    items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", ROWS), system_prompt="be brief"), tokenizer, 64)
    assert items[0].prompt_ids == [1, 9, 10, 2, 4, 5, 6, 7, 6, 3]
    assert items[0].prompt_text.startswith("[system] be brief [user] what")


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="nope.jsonl"):
        load_prompts(task(tmp_path / "nope.jsonl"), tokenizer, 64)
    with pytest.raises(ConfigError, match="not a file"):
        load_prompts(task(tmp_path), tokenizer, 64)  # a folder


def test_unknown_extension(tmp_path, tokenizer):
    (tmp_path / "d.txt").write_text("what is one\n")
    with pytest.raises(ConfigError, match="unknown extension '.txt'"):
        load_prompts(task(tmp_path / "d.txt"), tokenizer, 64)


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("blank.jsonl", "\n\n"), ("e.csv", ""),
                                          ("header.csv", "question,label\n")])
def test_empty_file(tmp_path, tokenizer, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match="has no rows"):
        load_prompts(task(tmp_path / name), tokenizer, 64)


def test_unparseable_file(tmp_path, tokenizer):
    (tmp_path / "bad.parquet").write_text("this is not parquet")
    with pytest.raises(ConfigError, match="could not read dataset"):
        load_prompts(task(tmp_path / "bad.parquet"), tokenizer, 64)


def test_missing_prompt_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"'problem'.*columns: \['question', 'label', 'id'\]"):
        load_prompts(TaskConfig(path=path, prompt_key="problem", answer_key="label"), tokenizer, 64)


def test_missing_answer_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"answer_key 'answer'.*columns"):
        load_prompts(TaskConfig(path=path, prompt_key="question"), tokenizer, 64)


def test_bad_prompts_skipped(tmp_path, tokenizer, caplog):
    rows = ROWS + [{"question": "", "label": 1, "id": 3}, {"question": "   ", "label": 1, "id": 4},
                   {"question": None, "label": 1, "id": 5}]
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)
    assert [i.fields["id"] for i in items] == [0, 1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 3 of 6 rows" in warnings[0]


def test_non_string_prompts_skipped(tmp_path, tokenizer, caplog):
    rows = [{"question": "what is one", "label": 1}, {"question": 7, "label": 7}, {"question": 8, "label": 8}]
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 64)
    assert [i.answer for i in items] == ["1"]
    assert "skipped 2 of 3 rows" in caplog.text


def test_long_prompts_dropped_and_logged_once(tmp_path, tokenizer, caplog):
    rows = [{"question": " ".join(["one"] * n), "label": n} for n in (8, 9, 3, 20)]  # n + 2 tokens
    with caplog.at_level(logging.WARNING, logger="distflow"):
        items = load_prompts(task(write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer, 10)
    assert [i.answer for i in items] == ["8", "3"]  # kept whole, never truncated
    assert len(items[0].prompt_ids) == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped 2 of 4 prompts" in warnings[0]


def test_all_prompts_too_long(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)  # 7 tokens each
    with pytest.raises(ConfigError, match="no usable prompts.*3 longer than rollout.max_prompt_tokens=6"):
        load_prompts(task(path), tokenizer, 6)


def _load_in_child(path, queue):
    items = load_prompts(task(path), make_tokenizer(), 64)
    queue.put([i.prompt_ids for i in items])


def test_concurrent_loads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS * 50)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(path, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] and len(results[0]) == 150


# ---------------------------------------------------------------- sampler


def one_epoch(n, world, seed=0, shuffle=True):
    return [ShardedSampler(n, r, world, seed, shuffle).next_indices(n // world) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_item_once_per_epoch_across_ranks(world):
    # 10 items is not a multiple of 3: ranks still deal out each epoch exactly once
    n, epochs = 10, 3
    steps = -(-epochs * n // world)  # enough steps for `epochs` whole epochs on every world size
    samplers = [ShardedSampler(n, r, world, seed=0) for r in range(world)]
    per_step = [[s.next_indices(1)[0] for s in samplers] for _ in range(steps)]
    stream = [i for step in per_step for i in step]  # global order: step by step, rank by rank
    assert len(stream) == steps * world >= epochs * n
    whole = [stream[e * n : (e + 1) * n] for e in range(epochs)]
    for e, epoch in enumerate(whole):
        assert len(epoch) == n
        assert sorted(epoch) == list(range(n)), (world, e, epoch)  # union = dataset, no duplicates
    # reshuffled per epoch: whole epochs of equal length, each a different order from the others
    assert all(whole[a] != whole[b] for a in range(epochs) for b in range(a + 1, epochs)), whole


def test_no_shuffle_is_strided():
    assert one_epoch(10, 3, shuffle=False) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_deterministic_and_seeded():
    assert one_epoch(10, 2, seed=5) == one_epoch(10, 2, seed=5)
    assert one_epoch(10, 2, seed=5) != one_epoch(10, 2, seed=6)


def test_epochs_reshuffle_and_cross_boundaries():
    s = ShardedSampler(10, 0, 1, seed=0)
    first = s.next_indices(10)
    assert s.epoch == 1
    second = s.next_indices(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second

    t = ShardedSampler(10, 0, 1, seed=0)
    assert t.next_indices(7) + t.next_indices(7) + t.next_indices(6) == first + second
    assert t.epoch == 2
    assert ShardedSampler(10, 0, 1, seed=0).next_indices(25)[:20] == first + second


def test_state_dict_resume():
    a = ShardedSampler(10, 1, 3, seed=7)
    a.next_indices(4)
    state = a.state_dict()
    b = ShardedSampler(10, 1, 3, seed=7)
    b.load_state_dict(state)
    assert b.epoch == a.epoch == 1
    assert b.next_indices(8) == a.next_indices(8)


def test_state_dict_mismatch():
    state = ShardedSampler(10, 0, 2, seed=0).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        ShardedSampler(10, 0, 2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_items"):
        ShardedSampler(11, 0, 2, seed=0).load_state_dict(state)


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2), (2, 3, 1), (3, 2)])
def test_resized_resume_deals_each_item_of_the_epoch_once(worlds):
    """Steps of k prompts per rank on one world size, then a save, then more steps on the next:
    the items seen (in stream order) are epoch after epoch of the whole dataset, no repeats."""
    n, k, seen, state = 11, 2, [], None
    for world in worlds:
        ranks = [ShardedSampler(n, r, world, seed=3) for r in range(world)]
        for r, s in enumerate(ranks):
            if state is not None:  # every rank resumes from rank 0's saved state, as a new rank does
                s.load_state_dict(state)
        for _ in range(3):
            per_rank = [s.next_indices(k) for s in ranks]
            seen += [per_rank[r][j] for j in range(k) for r in range(world)]  # stream order
        state = ranks[0].state_dict()
    straight = ShardedSampler(n, 0, 1, seed=3).next_indices(len(seen))
    assert seen == straight  # the same global stream as one rank would read
    epochs = [seen[i:i + n] for i in range(0, len(seen), n)]
    assert all(sorted(e) == list(range(n)) for e in epochs[:-1]) and len(set(epochs[-1])) == len(epochs[-1])


def test_too_few_items():
    with pytest.raises(ConfigError, match="no items"):
        ShardedSampler(0, 0, 3, seed=0)
    with pytest.raises(ValueError):
        ShardedSampler(10, 3, 3, seed=0)


def test_split_slicing(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert [i.answer for i in load_prompts(task(path, split="train[1:]"), tokenizer, 64)] == ["4", "3"]
    with pytest.raises(ConfigError, match="could not read dataset"):
        load_prompts(task(path, split="test"), tokenizer, 64)  # a local file has only "train"


def test_chat_messages_column(tmp_path, tokenizer, caplog):
    rows = [
        {"messages": [{"role": "system", "content": "one"}, {"role": "user", "content": "what is two"}], "label": 2},
        {"messages": [{"role": "user", "content": "what is one plus one"}], "label": 2},
        {"messages": [], "label": 1},  # no turns: a bad row
        {"messages": [{"role": "user"}], "label": 1},  # a turn without content: a bad row
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = TaskConfig(path=path, prompt_key="messages", answer_key="label", system_prompt="two")
    with caplog.at_level("WARNING", logger="distflow"):
        items = load_prompts(cfg, tokenizer, 64)
    # an existing system turn is kept as is; otherwise task.system_prompt is prepended
    assert [i.prompt_text for i in items] == ["[system] one [user] what is two [assistant]",
                                             "[system] two [user] what is one plus one [assistant]"]
    assert "skipped 2 of 4 rows" in caplog.text
