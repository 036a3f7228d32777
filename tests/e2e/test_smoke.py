"""End to end with vLLM, as a user runs it: the README's smoke commands.

The docs' launch/local.sh line, run straight through with its output into a file, checks what a
healthy run writes and what its console shows, and that the CLI export of its last checkpoint
equals its end-of-run export. Carry-over (and split) at eta = 0 equal to the sync run bit for bit on
vLLM is checked in-process (distributed/test_split_pipeline.py). Padded rows taking the packed rows' step is checked in-process
(distributed/test_trainer_loop.py, test_shared_prefix.py); the old trainer.* spellings under
torchrun by e2e/test_failures.py. Resuming bit-exactly is checked by the other engine runs
(e2e/test_tensor_parallel_runs.py, test_tools_runs.py with LoRA, test_preemption_runs.py),
each of which stops and continues.
"""

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from docs_helpers import doc_command, run_doc_command
from launch_helpers import ROOT, read_metrics

from distflow.run.output import EXPECTED

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]

REQUIRED_KEYS = [
    "step", "reward/mean", "response_length/mean", "timing/generate_s", "timing/reward_s",
    "timing/logprob_s", "timing/update_s", "timing/sync_s", "timing/step_s", "throughput/tokens_per_s",
    "throughput/generate_tokens_per_s", "throughput/update_tokens_per_s", "sync/max_abs_logprob_diff", "loss/policy", "grad_norm", "lr",
]
LOCAL_SH = doc_command("launch/local.sh 2 experiment=smoke")
EXTRA = ["model.dtype=float32", "task.reward=rewards_for_tests:digit_fraction", "checkpoint.every=2"]


def _run(command, tmp, *overrides, log_file=None):
    proc = run_doc_command(command, [*EXTRA, *overrides], tmp, log_file=log_file)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    # the quiet launcher, its output into a file as `... > log 2>&1` (a batch log, nohup, CI) would have it
    procs = {"straight": _run(LOCAL_SH, tmp, f"run.output_dir={tmp / 'straight'}", "run.steps=4",
                              "checkpoint.export_at_end=true", log_file=tmp / "straight.log")}
    return tmp, procs


def test_a_healthy_run_logs_every_step_and_writes_its_folder(runs):
    tmp, procs = runs
    out, proc = tmp / "straight", procs["straight"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in REQUIRED_KEYS), r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5, r  # experiment=smoke probes every step
        assert r["mismatch/abs_max"] <= 1e-5 and r["mismatch/abs_p99"] <= 1e-5, r  # the same, on the trained tokens
        assert r["timing/step_s"] > 0 and r["throughput/tokens_per_s"] > 0
        assert 0 <= r["timing/wait_min_s"] <= r["timing/wait_s"] < r["timing/step_s"], r
    # the reward varies within groups, so the policy really moved every step
    assert all(r["grad_norm"] > 0 for r in rows), [r["grad_norm"] for r in rows]
    assert all(r["update/nonfinite_skipped"] == 0 for r in rows)
    # only rank 0 wrote Hydra's folder, and nothing timestamped appeared; each rank has its log
    assert (out / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [".hydra", "checkpoints", "hf_model", "logs"]
    assert (out / "summary.json").is_file() and (out / "training.png").stat().st_size > 0
    assert (out / ".distflow-run").is_file()
    # the console is quiet: third-party INFO and the expected warnings stay in the log files
    logs = {r: (out / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)}
    console = proc.stdout  # stdout and stderr, in one file
    assert "distflow: summary:" in console
    assert "non-default args" not in console and "Failed to load weights" not in console
    assert all("non-default args" in text and text.count("Failed to load weights") >= 3 for text in logs.values())
    assert "deprecated" not in console
    # ... and reads well in a file: no bar redraws, every line whole
    lines = console.splitlines()
    assert "\r" not in console
    assert [line for line in lines if "distflow: " in line and not line.startswith("distflow: ")] == []
    assert [line for line in lines if " | reward " in line and not line.startswith("step ")] == []
    assert [line for line in lines if "] WARNING: " in line and not line.startswith("[")] == []
    # before the first step: distflow's own lines and at most 3 others; the expected start-up
    # warnings are one line, and every one of them is in rank 0's log
    start_up = lines[:next(i for i, line in enumerate(lines) if line.startswith("step 1/4 |"))]
    assert len([line for line in start_up if not line.startswith("distflow: ")]) <= 3, start_up
    folded = [line for line in start_up if "expected start-up warnings from" in line]
    assert len(folded) == 1, start_up
    held = int(folded[0].split()[1])
    assert held >= 5 and sum(fragment in line for line in logs[0].splitlines() for _, fragment in EXPECTED) >= held


def test_the_last_checkpoint_exports_the_weights_the_run_exported(runs, tmp_path):
    tmp, _ = runs
    straight = tmp / "straight"
    # keep_last=2: steps 2 and 4 remain, both complete
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    cli = tmp_path / "cli_export"
    last = straight / "checkpoints" / "step_000004"
    subprocess.run([sys.executable, "-m", "distflow", "export", str(last), str(cli)], check=True, capture_output=True,
                   cwd=ROOT)
    wa, wc = load_file(straight / "hf_model" / "model.safetensors"), load_file(cli / "model.safetensors")
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (cli / "tokenizer.json").is_file() and (cli / "chat_template.jinja").is_file()
