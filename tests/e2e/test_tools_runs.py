"""Multi-turn tool episodes end to end: the docs' `experiment=tools_smoke` command on 2 ranks with
vLLM, where a scripted environment makes every episode a real calculator round trip
(tests/support/envs_for_tests.py), and a bit-exact resume mid-run. (An environment that does not
import stops every rank before any model loads: distributed/test_trainer_loop.py.)

It is also the suite's bf16 run: the engine computes in bf16 and so does FSDP2, over float32
master weights and AdamW moments (the checkpoint holds them), and the engine/trainer mismatch is
measured on every step's trained tokens. A bf16 CPU run is as deterministic as a float32 one, so
the resume still continues bit for bit."""

import json
import math
import shutil

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distflow.probe import PROBE_LIMIT

from docs_helpers import doc_command, run_doc_command
from launch_helpers import read_metrics, stable_metrics

COMMAND = doc_command(".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=tools_smoke")
TOOLS = ["task.env=envs_for_tests:ScriptedToolEnv", "task.reward=rewards_for_tests:digit_fraction", "run.steps=4",
         "model.dtype=bfloat16"]
MISMATCH = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/abs_max", "mismatch/kl")


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
        assert r["grad_norm"] > 0, r
        # bf16 engine and bf16 trainer: close, not equal
        assert math.isnan(r["sync/max_abs_logprob_diff"]) or r["sync/max_abs_logprob_diff"] < PROBE_LIMIT["bfloat16"]
        assert all(math.isfinite(r[k]) for k in MISMATCH), r
        assert 0 < r["mismatch/abs_mean"] <= r["mismatch/abs_p99"] and r["mismatch/abs_max"] < 1.0, r
        assert 0 <= r["mismatch/kl"] < 0.1, r
    config = json.loads((straight / "config.json").read_text())
    assert config["model"]["dtype"] == "bfloat16"
    logs = [(straight / "logs" / f"rank_{k}.log").read_text() for k in (0, 1)]
    assert all("dtype=torch.bfloat16" in text for text in logs)  # each rank's vLLM engine
    assert "model dtype bfloat16 (model.dtype=bfloat16)" in logs[0]
    # master weights and both AdamW moments stay float32 (the checkpoint saves what the run holds)
    meta = FileSystemReader(str(straight / "checkpoints" / "step_000002")).read_metadata().state_dict_metadata
    tensors = {k: m.properties.dtype for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    weights = [k for k in tensors if k.endswith(".weight") and ".state." not in k and "exp_avg" not in k]
    moments = [k for k in tensors if "exp_avg" in k]
    assert weights and moments and {str(tensors[k]) for k in weights + moments} == {"torch.float32"}, tensors
    shutil.copytree(straight / "checkpoints" / "step_000002", tmp_path / "step2")
    proc = _run(resumed, f"checkpoint.resume={tmp_path / 'step2'}")
    assert "resumed from step 2" in proc.stdout
    again = read_metrics(resumed)  # a new folder: its metrics start where the checkpoint left off
    assert [r["step"] for r in again] == [3, 4]
    assert [stable_metrics(r) for r in again] == [stable_metrics(r) for r in rows[2:]]
