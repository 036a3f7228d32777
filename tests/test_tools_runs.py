"""Multi-turn tool episodes end to end: `experiment=tools_smoke` on 2 ranks with vLLM, where a
scripted environment makes every episode a real calculator round trip (tests/envs_for_tests.py);
a bit-exact resume mid-run; an environment that does not import stops every rank before any
model loads."""

import shutil

import pytest

from launch_helpers import read_metrics, stable_metrics, torchrun

TOOLS = ["experiment=tools_smoke", "task.env=envs_for_tests:ScriptedToolEnv",
         "task.reward=rewards_for_tests:digit_fraction", "trainer.steps=4"]


def _run(out, *extra):
    proc = torchrun([*TOOLS, f"trainer.output_dir={out}", *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_tool_episodes_train_and_resume_bit_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, "trainer.checkpoint_every=2")
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 < r["turns/mean"] <= 2.0, r  # most episodes: a turn, the tool's answer, a turn
        assert r["tool/calls"] > 0 and r["tool/errors"] == 0 and r["tool/timeouts"] == 0, r
        # observation tokens are in the sequences but not generated
        assert r["response_length/generated_mean"] < r["response_length/mean"], r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5 and r["grad_norm"] > 0, r
    shutil.copytree(straight / "checkpoints" / "step_000002", tmp_path / "step2")
    proc = _run(resumed, f"trainer.resume={tmp_path / 'step2'}")
    assert "resumed from step 2" in proc.stdout
    assert [stable_metrics(r) for r in read_metrics(resumed)[2:]] == [stable_metrics(r) for r in rows[2:]]


def test_environment_that_does_not_import_fails_before_loading(tmp_path):
    proc = torchrun(["experiment=tools_smoke", "task.env=no_such_module:Env", f"trainer.output_dir={tmp_path}"],
                    timeout=180, torchrun_args=["--monitor-interval=15"])
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("distflow: error:")]
    assert len(errors) == 2 and all("no_such_module" in e for e in errors), errors
    assert "Loading weights" not in proc.stderr
