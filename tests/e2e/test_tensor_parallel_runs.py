"""A tensor-parallel engine group end to end: 2 torchrun ranks driving one vLLM engine train with
carry-over rollouts (the ranks step the engine in lockstep), validate and resume bit-exactly with
groups carried (the in-process checks of the group are distributed/test_tensor_parallel.py)."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from launch_helpers import read_metrics, stable_metrics, torchrun

needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]


@pytest.mark.slow
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_vllm)])
def test_smoke_run_and_resume_with_a_tensor_parallel_engine(tmp_path, _):
    """Two ranks, one engine, carry-over at eta = 1: the resync probe holds every step, validation
    runs with a rank that has no held-out item, and a run resumed from step 2 with groups carried
    continues bit-exactly (metrics, weights)."""
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n')  # one item: rank 1 asks for none
    base = ["experiment=smoke", "rollout.tensor_parallel_size=2", "task.reward=rewards_for_tests:digit_fraction",
            "pipeline=carryover", "run.steps=4", "checkpoint.every=2", "checkpoint.export_at_end=true", "validation.at_end=true",
            "validation.pass_k=2", "validation.save_samples=true", f"task.heldout_path={heldout}",
            "logging.progress_bar=false", "logging.plot_at_end=false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, extra in ((straight, []), (resumed, [f"checkpoint.resume={straight / 'checkpoints' / 'step_000002'}"])):
        proc = torchrun([*base, f"run.output_dir={out}", *extra], timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resumed from step 2" in proc.stdout
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b][-2:] == [3, 4]
    assert all(0 <= r["sync/max_abs_logprob_diff"] <= 1e-5 for r in a + b), [r["sync/max_abs_logprob_diff"] for r in a + b]
    assert a[-1]["val/items"] == 1 and a[-1]["val/k"] == 2
    # the greedy answers, each rank its own items: rank 1 has none
    (row,) = [json.loads(line) for line in (straight / "validation" / "after.rank0.jsonl").read_text().splitlines()]
    assert row["item"] == 0 and "2 + 3" in row["prompt"] and row["reward"] == a[-1]["val/pass@1"], row
    assert (straight / "validation" / "after.rank1.jsonl").read_text() == ""
    assert a[1]["partial/carried_groups"] > 0 and all(r["staleness/max"] <= 1 for r in a), a
    assert [stable_metrics(r) for r in a[2:]] == [stable_metrics(r) for r in b[-2:]]
    wa, wb = (load_file(out / "hf_model" / "model.safetensors") for out in (straight, resumed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
