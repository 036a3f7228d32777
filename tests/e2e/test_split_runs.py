"""A split run on vLLM-CPU engines under torchrun, as the docs launch it: 2 trainer ranks and 2 rollout
ranks that share one tensor-parallel engine, the staged schedule at eta = 1 with DAPO's dynamic
sampling, and held-out validation on the trainers' own engines (a tensor-parallel group too). The
in-process checks of the schedule, resumes, signals and kills are distributed/test_split_pipeline.py's
(HF engine, and a vLLM rollout rank serving LoRA adapters); a tensor-parallel engine's resume is
e2e/test_tensor_parallel_runs.py's."""

import importlib.util
import math

import pytest

from docs_helpers import doc_command, run_doc_command
from launch_helpers import FLOAT32, read_metrics

needs_vllm = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]

TP_LINE = ".venv/bin/torchrun --standalone --nproc_per_node=4 recipes/grpo.py experiment=smoke pipeline=split  pipeline.rollout_ranks=2 rollout.tensor_parallel_size=2"  # noqa: E501


@pytest.mark.slow
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_vllm)])
def test_split_run_with_tensor_parallel_engines_trains_and_validates(tmp_path, _):
    """4 steps: the engine (a TP-2 group on the rollout ranks) matches the policy where the probe measured
    it (a trainer without sequences still sends the probe, so both ranks of the group join it), every
    trained token is one version old from step 2 on, DAPO's filter ran on the rollout ranks, and the
    trainers validated at the end on their own TP-2 engine, each its share of the held-out items."""
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(f'{{"prompt": "What is {a} + 3?", "answer": "{a + 3}"}}\n' for a in range(3)))
    out = tmp_path / "out"
    overrides = [FLOAT32, "algorithm=dapo", "task.reward=rewards_for_tests:digit_fraction", "run.steps=4",
                 "run.sync_probe_every=1", "validation.at_end=true", f"task.heldout_path={heldout}",
                 "logging.progress_bar=false", "logging.plot_at_end=false", f"run.output_dir={out}"]
    proc = run_doc_command(doc_command(TP_LINE), overrides, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    gaps = [r["sync/max_abs_logprob_diff"] for r in rows if not math.isnan(r["sync/max_abs_logprob_diff"])]
    assert gaps and all(0 <= g <= 1e-5 for g in gaps), [r["sync/max_abs_logprob_diff"] for r in rows]
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1], rows
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["dynamic_sampling/generated_groups"]
               >= r["dynamic_sampling/kept_groups"] > 0 for r in rows), rows
    assert rows[-1]["val/items"] == 3 and 0 <= rows[-1]["val/pass@1"] <= 1, rows[-1]
