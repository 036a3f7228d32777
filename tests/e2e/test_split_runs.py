"""A split run on vLLM-CPU engines under torchrun, as the docs launch it: 2 trainer ranks and 2 rollout
ranks that share one tensor-parallel engine, the staged schedule at eta = 1 with DAPO's dynamic
sampling. Its checkpoint at step 2 holds step 3's groups, generated already; the run resumed from it
continues bit for bit (the in-process checks of the schedule, signals and kills are
distributed/test_split_pipeline.py's, on the HF engine)."""

import importlib.util
import math

import pytest
import torch
from safetensors.torch import load_file

from docs_helpers import doc_command, run_doc_command
from launch_helpers import FLOAT32, read_metrics, stable_metrics

needs_vllm = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]

TP_LINE = ".venv/bin/torchrun --standalone --nproc_per_node=4 recipes/grpo.py experiment=smoke pipeline=split  pipeline.rollout_ranks=2 rollout.tensor_parallel_size=2"  # noqa: E501


@pytest.mark.slow
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_vllm)])
def test_split_run_with_a_tensor_parallel_rollout_group_resumes_bit_exactly(tmp_path, _):
    """4 steps straight vs resumed from step 2 with step 3's groups in the checkpoint: every metric but
    wall-clock ones and the probe, and the final weights, equal; the engine (a TP-2 group on the rollout
    ranks) matches the policy where the probe measured it (a trainer without sequences still sends the
    probe, so both ranks of the group join it), every trained token is one version old from step 2 on,
    and DAPO's filter ran on the rollout ranks."""
    base = [FLOAT32, "algorithm=dapo", "task.reward=rewards_for_tests:digit_fraction", "run.steps=4",
            "checkpoint.every=2", "checkpoint.export_at_end=true", "run.sync_probe_every=1",
            "logging.progress_bar=false", "logging.plot_at_end=false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    command = doc_command(TP_LINE)
    for out, extra in ((straight, []), (resumed, [f"checkpoint.resume={straight / 'checkpoints' / 'step_000002'}"])):
        proc = run_doc_command(command, [*base, f"run.output_dir={out}", *extra], tmp_path, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resumed from step 2" in proc.stdout + proc.stderr
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b][-2:] == [3, 4]
    # all but the engine probe: the resumed run's first versions were probed before the checkpoint
    probe = "sync/max_abs_logprob_diff"
    assert [{**stable_metrics(r), probe: None} for r in a[2:]] == [{**stable_metrics(r), probe: None} for r in b[-2:]]
    wa, wb = (load_file(out / "hf_model" / "model.safetensors") for out in (straight, resumed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    gaps = [r["sync/max_abs_logprob_diff"] for r in a if not math.isnan(r["sync/max_abs_logprob_diff"])]
    assert gaps and all(0 <= g <= 1e-5 for g in gaps), [r["sync/max_abs_logprob_diff"] for r in a]
    assert [r["staleness/max"] for r in a] == [0, 1, 1, 1], a
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["dynamic_sampling/generated_groups"]
               >= r["dynamic_sampling/kept_groups"] > 0 for r in a), a
