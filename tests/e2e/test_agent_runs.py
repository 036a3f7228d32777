"""Harness episodes end to end: the docs' `experiment=agent_smoke` command on 2 ranks with vLLM in
float32, where a ReAct harness (tests/support/agents_for_tests.py:react_two_choices: the add tool
offered by function calling, two choices of the first answer) talks to each rank's endpoint through
the `openai` client. Every row the update trained is, id for id, what the endpoint answered: its
prompt and response are an answer's prompt and token ids, and its trained tokens are the answers'
ids on its trajectory after its prompt, each sampled token in exactly one row (the second choice
trains as a row of its own). The engine's logprob of every trained token matches the trainer's to
float32 rounding, the probe is exact, and each rank served its own endpoint. (The bad requests and
a bit-exact resume run in-process: unit/test_agent_endpoint.py, distributed/test_trainer_loop.py.)"""

import json
import re

import pytest

from docs_helpers import doc_command, run_doc_command
from launch_helpers import read_metrics

COMMAND = doc_command(".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=agent_smoke")


@pytest.mark.slow
def test_harness_episodes_train_on_vllm_with_the_tokens_the_engine_sampled(tmp_path, monkeypatch):
    out = tmp_path / "run"
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("AGENT_RECORD_DIR", str(record))
    extra = ["task.agent=agents_for_tests:react_two_choices", "task.reward=rewards_for_tests:digit_fraction",
             "model.dtype=float32", "run.steps=2", f"run.output_dir={out}"]
    proc = run_doc_command(COMMAND, extra, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agent/requests_mean"] == 2 and r["turns/mean"] == 2, r
        assert r["agent/restarts"] == r["agent/failed"] == r["agent/cut"] == 0, r
        assert r["agent/branches"] == r["agent/requests"] / 2, r  # n=2 first: the second choice trains too
        assert r["response_length/generated_mean"] < r["response_length/mean"], r  # the messages between turns
        assert r["mismatch/abs_max"] < 1e-5 and r["sync/max_abs_logprob_diff"] < 1e-5, r
        assert r["grad_norm"] > 0, r
    urls = [re.search(r"agent endpoint on (http://127\.0\.0\.1:\d+)", (out / "logs" / f"rank_{k}.log").read_text())
            for k in (0, 1)]
    assert all(urls) and urls[0].group(1) != urls[1].group(1)
    trained = {p.name.split(".")[1]: _lines(p) for p in record.glob("rows.*.jsonl")}
    answered = {p.name.split(".")[1]: _lines(p) for p in record.glob("answers.*.jsonl")}
    assert len(trained) == 2 and set(trained) <= set(answered)  # each rank's rows and its own endpoint's answers
    for pid, rows in trained.items():
        assert len(rows) == 2 * 2 * 4 * 2  # steps x prompts per rank x group size x (the first choice, the second)
        for row in rows:
            _check_row(row, answered[pid])


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_row(row, answers):
    """The row is an answer's context and ids; its trained tokens are the answers' ids after its prompt."""
    whole = row["prompt"] + row["response"]
    assert any(a["prompt"] + a["ids"] == whole for a in answers)
    inside = {len(a["prompt"]): a["ids"] for a in answers if len(a["prompt"]) >= len(row["prompt"])
              and whole[:len(a["prompt"]) + len(a["ids"])] == a["prompt"] + a["ids"]}  # (one per turn)
    assert [t for t, m in zip(row["response"], row["mask"]) if m] == [t for k in sorted(inside) for t in inside[k]]
