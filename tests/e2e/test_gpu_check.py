"""bench/gpu_check.sh, the prepared one-GPU check: its CPU dry run end to end, and its refusal to
run without a usable GPU otherwise. (On a GPU machine it runs the same code on CUDA.)"""

import json
import os
import subprocess
import sys

import pytest

from launch_helpers import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _run(args, timeout):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_usable_gpu_it_refuses_and_points_to_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _run(["--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 2
    assert f"gpu_check: error: torch {torch.__version__} (CUDA None) sees no usable GPU; use --dry-run" in proc.stderr


@pytest.mark.slow
def test_dry_run_writes_the_json_with_every_run_and_check(tmp_path):
    proc = _run(["--dry-run", "--out", str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["ok"] is True, result["checks"]
    assert set(result["checks"]) == {"all_runs_finished", "fp32_probe_within_1e-5", "bf16_probe_below_warning"}
    assert set(result["runs"]) == {"smoke_float32", "smoke_bfloat16", "tiny_bfloat16", "lora_bfloat16"}
    for name, run in result["runs"].items():
        assert run["rc"] == 0 and run["steps"] == 1, (name, run.get("output_tail"))
        assert run["tokens_per_s_median"] > 0 and run["step_breakdown_s_median"]["step"] > 0
        assert "run.device=cpu" in run["command"] and f"model.dtype={name.split('_')[1]}" in run["command"]
    assert result["runs"]["smoke_float32"]["probe_max_abs_logprob_diff"] <= 1e-5
    assert result["machine"]["torch"] and "available" in result["machine"]
