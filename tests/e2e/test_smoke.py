"""End to end with vLLM, as a user runs it: `torchrun --nproc_per_node=2 recipes/grpo.py experiment=smoke`.

One run straight through checks what a healthy run writes and shows; a second run, stopped at
step 2 (spelled with the old trainer.* keys) and continued to step 4, must equal it bit for bit,
and the checkpoint's CLI export must equal the end-of-run export.
"""

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from launch_helpers import ROOT, read_metrics, stable_metrics, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]

REQUIRED_KEYS = [
    "step", "reward/mean", "response_length/mean", "timing/generate_s", "timing/reward_s",
    "timing/logprob_s", "timing/update_s", "timing/sync_s", "timing/step_s", "throughput/tokens_per_s",
    "sync/max_abs_logprob_diff", "loss/policy", "grad_norm", "lr",
]
BASE = ["experiment=smoke", "task.reward=rewards_for_tests:digit_fraction", "checkpoint.every=2"]


def _run(*overrides):
    proc = torchrun([*BASE, *overrides])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    straight, split = tmp / "straight", tmp / "split"
    procs = {"straight": _run(f"run.output_dir={straight}", "run.steps=4", "checkpoint.export_at_end=true"),
             "first_half": _run(f"trainer.output_dir={split}", "trainer.steps=2"),  # the old spellings still work
             "continued": _run(f"run.output_dir={split}", "run.steps=4", "checkpoint.export_at_end=true",
                               "checkpoint.resume=force")}  # more steps than the checkpoint's run: asked for
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
    # the console is quiet: third-party INFO and the per-resync warnings stay in the log files
    logs = {r: (out / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)}
    console = proc.stdout + proc.stderr
    assert "distflow: summary:" in proc.stdout
    assert "non-default args" not in console and console.count("Failed to load weights") <= 1
    assert all("non-default args" in text and text.count("Failed to load weights") >= 3 for text in logs.values())
    assert "deprecated" not in console


def test_a_stopped_run_continues_bit_exact_and_exports_the_same_weights(runs, tmp_path):
    tmp, procs = runs
    straight, split = tmp / "straight", tmp / "split"
    old = procs["first_half"].stderr
    assert old.count("distflow: warning: trainer.output_dir is deprecated: use run.output_dir") == 1, old[-2000:]
    assert old.count("distflow: warning: trainer.steps is deprecated: use run.steps") == 1, old[-2000:]
    assert "resumed from step 2" in procs["continued"].stdout
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [stable_metrics(r) for r in a] == [stable_metrics(r) for r in b]
    wa, wb = load_file(straight / "hf_model" / "model.safetensors"), load_file(split / "hf_model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # keep_last=2: steps 2 and 4 remain, both complete
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # the CLI export of the final checkpoint equals the end-of-run export
    cli = tmp_path / "cli_export"
    subprocess.run([sys.executable, "-m", "distflow", "export", str(split / "checkpoints" / "step_000004"), str(cli)],
                   check=True, capture_output=True, cwd=ROOT)
    wc = load_file(cli / "model.safetensors")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (cli / "tokenizer.json").is_file() and (cli / "chat_template.jinja").is_file()


def test_full_length_prompt_and_truncated_response_pass_the_probe(tmp_path, tiny_model_dir):
    """A prompt of exactly rollout.max_prompt_tokens (kept), a response cut at max_new_tokens, and
    the probe on every step: the probe resubmits prompt + response to vLLM as one prompt."""
    from transformers import AutoTokenizer

    from distflow.config import TaskConfig
    from distflow.data.prompts import load_prompts

    data = tmp_path / "one.jsonl"
    data.write_text('{"prompt": "Add 12 and 30, then say the sum.", "answer": "42"}\n' * 4)
    items = load_prompts(TaskConfig(path=str(data)), AutoTokenizer.from_pretrained(tiny_model_dir), 10**6)
    limit = len(items[0].prompt_ids)
    out = tmp_path / "run"
    proc = torchrun(["experiment=smoke", "rollout=vllm", f"model.path={tiny_model_dir}", "task=jsonl",
                     f"task.path={data}", "task.reward=rewards_for_tests:digit_fraction",
                     f"rollout.max_prompt_tokens={limit}", "rollout.max_new_tokens=8", "run.steps=2",
                     "run.sync_probe_every=1", "run.sync_probe_seqs=8", "logging.plot_at_end=false",
                     f"run.output_dir={out}"], nproc=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response/truncated_frac"] > 0 for r in rows), rows  # some responses hit the limit
    assert all(r["sync/max_abs_logprob_diff"] <= 1e-5 for r in rows), rows
