"""Harness episodes end to end: the docs' `experiment=agent_smoke` command on 2 ranks with vLLM in
float32, where a two-request harness (tests/support/agents_for_tests.py:two_turns, two choices
first) talks to each rank's endpoint through the `openai` client. The engine's logprob of every
trained token (both choices' rows) matches
the trainer's to float32 rounding (a token the endpoint re-tokenized instead of keeping would
show here), the probe is exact, and each rank served its own endpoint. (Token-for-token checks
against the endpoint's answers, the bad requests and a bit-exact resume run in-process:
unit/test_agent_endpoint.py, distributed/test_trainer_loop.py.)"""

import re

import pytest

from docs_helpers import doc_command, run_doc_command
from launch_helpers import read_metrics

COMMAND = doc_command(".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=agent_smoke")


@pytest.mark.slow
def test_harness_episodes_train_on_vllm_with_the_tokens_the_engine_sampled(tmp_path):
    out = tmp_path / "run"
    extra = ["task.agent=agents_for_tests:two_turns", "task.reward=rewards_for_tests:digit_fraction",
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
