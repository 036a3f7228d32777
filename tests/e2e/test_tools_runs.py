"""Multi-turn tool episodes end to end: the docs' `experiment=tools_smoke` command on 2 ranks with
vLLM, where a scripted environment makes every episode a real calculator round trip
(tests/support/envs_for_tests.py), and a bit-exact resume mid-run. (An environment that does not
import stops every rank before any model loads: distributed/test_trainer_loop.py.)"""

import shutil

import pytest

from docs_helpers import doc_command, run_doc_command
from launch_helpers import read_metrics, stable_metrics

COMMAND = doc_command(".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=tools_smoke")
TOOLS = ["task.env=envs_for_tests:ScriptedToolEnv", "task.reward=rewards_for_tests:digit_fraction", "run.steps=4"]


def _run(out, *extra):
    """The docs' tools_smoke command, with a scripted environment that makes every episode a real round trip."""
    proc = run_doc_command(COMMAND, [*TOOLS, f"run.output_dir={out}", *extra], out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_tool_episodes_train_and_resume_bit_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, "checkpoint.every=2")
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 < r["turns/mean"] <= 2.0, r  # most episodes: a turn, the tool's answer, a turn
        assert r["tool/calls"] > 0 and r["tool/errors"] == 0 and r["tool/timeouts"] == 0, r
        # observation tokens are in the sequences but not generated
        assert r["response_length/generated_mean"] < r["response_length/mean"], r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5 and r["grad_norm"] > 0, r
    shutil.copytree(straight / "checkpoints" / "step_000002", tmp_path / "step2")
    proc = _run(resumed, f"checkpoint.resume={tmp_path / 'step2'}")
    assert "resumed from step 2" in proc.stdout
    again = read_metrics(resumed)  # a new folder: its metrics start where the checkpoint left off
    assert [r["step"] for r in again] == [3, 4]
    assert [stable_metrics(r) for r in again] == [stable_metrics(r) for r in rows[2:]]
