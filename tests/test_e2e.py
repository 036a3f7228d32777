"""End to end: `torchrun --nproc_per_node=2 recipes/grpo.py experiment=smoke` as a user runs it."""

import importlib.util
import math
import re

import pytest

from launch_helpers import read_metrics, torchrun

REQUIRED_KEYS = [
    "step", "reward/mean", "response_length/mean", "timing/generate_s", "timing/reward_s",
    "timing/logprob_s", "timing/update_s", "timing/sync_s", "timing/step_s", "throughput/tokens_per_s",
    "sync/max_abs_logprob_diff", "loss/policy", "grad_norm", "lr",
]

ENGINES = [
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]),
    "hf",
]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_smoke_experiment_runs_and_logs_every_step(tmp_path, engine):
    out = tmp_path / "run"
    # The hf run also makes rank 1 a straggler from step 2 on (1.5 s late before each update).
    slow = ["trainer.fault_inject='1:2+:sleep=1.5'", "trainer.straggler_warn_steps=2"] if engine == "hf" else []
    proc = torchrun(["experiment=smoke", f"rollout={engine}", f"trainer.output_dir={out}",
                     "task.reward=rewards_for_tests:digit_fraction", *slow])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 <= r["timing/wait_min_s"] <= r["timing/wait_s"] < r["timing/step_s"], r
        assert r["timing/compute_min_s"] <= r["timing/compute_s"] <= r["timing/step_s"], r
        assert r["timing/update_min_s"] <= r["timing/update_s"] and r["timing/slowest_rank"] in (0, 1), r
    if slow:  # rank 0 waits for rank 1 at the update's first collective: the wait shows, and who
        # (bounds leave room for the ranks' own noise on a loaded machine: a rank that was 0.3 s
        # slower before the sleep waits 0.3 s less for it, and its peer 0.3 s more)
        for r in rows[1:]:
            assert r["timing/wait_s"] >= 1.0 and r["timing/wait_s"] - r["timing/wait_min_s"] >= 0.5, r
            assert r["timing/slowest_rank"] == 1 and r["timing/compute_s"] - r["timing/compute_min_s"] >= 0.5, r
        # step 1 may already have found rank 1 slower by chance, so the streak of 2 ends on step 2 or 3
        assert re.search(r"step [23]: rank 1 was the slowest for 2 consecutive steps", proc.stdout + proc.stderr)
    for r in rows:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in REQUIRED_KEYS), r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5, r
        assert r["timing/step_s"] > 0 and r["throughput/tokens_per_s"] > 0
    # the reward varies within groups, so the policy really moved every step
    assert all(r["grad_norm"] > 0 for r in rows), [r["grad_norm"] for r in rows]
    assert all(r["update/nonfinite_skipped"] == 0 for r in rows)
    # only rank 0 wrote Hydra's folder, and nothing timestamped appeared; each rank has its log
    assert (out / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [".hydra", "checkpoints", "logs"]
    assert (out / "summary.json").is_file() and (out / "training.png").stat().st_size > 0
    # the console is quiet: third-party INFO and the per-resync warnings stay in the log files
    logs = {r: (out / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)}
    assert "distflow: summary:" in proc.stdout
    if engine == "vllm":
        assert "non-default args" not in proc.stdout + proc.stderr
        assert (proc.stdout + proc.stderr).count("Failed to load weights") <= 1
        assert all("non-default args" in text and text.count("Failed to load weights") >= 3 for text in logs.values())


def _fail_run(overrides, tmp_path):
    # a slow monitor (15 s) lets every rank reach its own error before torchrun stops the group,
    # even on a loaded machine
    return torchrun(["experiment=smoke", f"trainer.output_dir={tmp_path}", *overrides], timeout=180,
                    torchrun_args=["--monitor-interval=15"])


def _assert_clean_failure(proc, needle: str, ranks: int = 2):
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert text.count(needle) >= ranks, f"expected {needle!r} from {ranks} ranks:\n{text[-5000:]}"


def test_unknown_config_key_fails_on_every_rank(tmp_path):
    proc = _fail_run(["trainer.no_such_key=1"], tmp_path)
    _assert_clean_failure(proc, "Key 'no_such_key' not in")


def test_appended_unknown_config_key_fails_on_every_rank(tmp_path):
    """Hydra's append syntax gets past its own schema check; distflow's does not."""
    proc = _fail_run(["+trainer.bogus_key=1"], tmp_path)
    _assert_clean_failure(proc, "distflow: error: unknown config key trainer.bogus_key")


def test_missing_model_folder_fails_on_every_rank(tmp_path):
    proc = _fail_run([f"model.path={tmp_path}/nope"], tmp_path)
    _assert_clean_failure(proc, f"distflow: error: model.path '{tmp_path}/nope' is not a folder")


def test_dataset_without_prompt_field_fails_on_every_rank(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    proc = _fail_run(["task=jsonl", f"task.path={data}"], tmp_path)
    _assert_clean_failure(proc, "distflow: error: task.prompt_key 'prompt' is not a column")


def test_empty_dataset_fails_on_every_rank(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = _fail_run(["task=jsonl", f"task.path={data}"], tmp_path)
    _assert_clean_failure(proc, "has no rows")


def test_shard_ranks_that_do_not_divide_the_world_fail_on_every_rank(tmp_path):
    proc = _fail_run(["model.shard_ranks=3"], tmp_path)
    _assert_clean_failure(proc, "distflow: error: model.shard_ranks=3 does not divide the world size 2")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
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
                     f"rollout.max_prompt_tokens={limit}", "rollout.max_new_tokens=8", "trainer.steps=2",
                     "trainer.sync_probe_every=1", "trainer.sync_probe_seqs=8", "trainer.plot_at_end=false",
                     f"trainer.output_dir={out}"], nproc=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response/truncated_frac"] > 0 for r in rows), rows  # some responses hit the limit
    assert all(r["sync/max_abs_logprob_diff"] <= 1e-5 for r in rows), rows
