"""The GPU scripts' reading of a run: bench/gpu_node_check.py's sleep/wake lines, expectations and
verdict on a run folder as the trainer leaves it (rank log lines in vLLM 0.32's wording), and
bench/gpu_check.py's figures (update tokens/s, MFU, generate tokens/s) from metrics.jsonl rows."""

import json
import sys

import pytest

from launch_helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import gpu_node_check as node  # noqa: E402

# rank_0.log of a 2-step bf16 smoke run on one GPU, in setup_output's file format
RANK_LOG = """\
2026-11-30 10:00:01,000 vllm.v1.worker.gpu_model_runner INFO: Model loading took 0.12 GiB memory and 1.5 seconds
2026-11-30 10:00:04,000 vllm.v1.worker.gpu_worker INFO: Available KV cache memory: 47.31 GiB
2026-11-30 10:00:09,000 distflow INFO: step 1: generate
2026-11-30 10:00:09,100 vllm.v1.worker.gpu_worker INFO: Sleep mode freed 48.02 GiB memory, 1.93 GiB memory is still in use.
2026-11-30 10:00:09,100 vllm.v1.executor.abstract INFO: It took 0.412345 seconds to fall asleep.
2026-11-30 10:00:10,000 vllm.v1.executor.abstract INFO: It took 0.051000 seconds to wake up tags ['weights'].
2026-11-30 10:00:10,200 vllm.v1.executor.abstract INFO: It took 0.302000 seconds to wake up tags ['kv_cache'].
2026-11-30 10:00:11,100 vllm.v1.worker.gpu_worker INFO: Sleep mode freed 48.01 GiB memory, 1.94 GiB memory is still in use.
2026-11-30 10:00:11,100 vllm.v1.executor.abstract INFO: It took 0.398000 seconds to fall asleep.
2026-11-30 10:00:12,000 vllm.v1.executor.abstract INFO: It took 0.049000 seconds to wake up tags ['weights'].
2026-11-30 10:00:12,200 vllm.v1.executor.abstract INFO: It took 0.299000 seconds to wake up tags ['kv_cache'].
"""


def _row(step, probe=0.02, sync=0.5, **extra):
    return {"step": step, "sync/max_abs_logprob_diff": probe, "timing/sync_s": sync, "timing/generate_s": 0.3,
            "timing/update_s": 0.2, "timing/step_s": 1.0, "throughput/tokens_per_s": 2000.0,
            "response_length/mean": 16.0, "reward/mean": 0.0, "memory/device_used_gib": 3.5,
            "mismatch/abs_mean": 0.03, "mismatch/abs_p99": 0.3, "mismatch/abs_max": 0.9, "mismatch/kl": 0.001, **extra}


def _run_folder(tmp_path, rows, log_text):
    run = tmp_path / "vllm_1gpu"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank_0.log").write_text(log_text)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "memory").mkdir()
    (run / "memory" / "rank0.json").write_text(json.dumps({
        "peak_rss": {"startup:engine": 2**31}, "peak_cuda_allocated": {"startup:engine": 3 * 2**30, "update": 2**30}}))
    return run


def test_node_check_reads_sleep_wake_and_memory_from_a_run_folder_and_passes_it(tmp_path):
    rows, log, phases = node.read_run(_run_folder(tmp_path, [_row(1), _row(2)], RANK_LOG))
    assert log["sleep_s"] == [0.412345, 0.398] and log["wake_weights_s"] == [0.051, 0.049]
    assert log["wake_kv_cache_s"] == [0.302, 0.299]
    assert log["sleep_freed_gib"] == [48.02, 48.01] and log["sleep_in_use_gib"] == [1.93, 1.94]
    assert log["engine_weights_gib"] == [0.12] and log["engine_kv_cache_gib"] == [47.31]
    assert phases == {"kind": "peak_cuda_allocated", "startup:engine": 3.0, "update": 1.0}
    res = {"rc": 0, **node.summarize(rows, log)}
    assert res["reload_s"] == pytest.approx([0.5 - 0.051 - 0.302, 0.5 - 0.049 - 0.299])
    assert node.problems("vllm_1gpu", res, 2, sleeps=True, dtype="bfloat16") == []
    line = node.verdict({"vllm_1gpu": res}, [])
    assert line == "gpu_node_check: PASS (vllm_1gpu): probe max 0.02, mismatch mean max 0.03, wake max 0.302 s"


@pytest.mark.parametrize("case, expected", [
    ("no_sleep_lines", "vllm_1gpu sleep/wake lines {'sleep_s': 0, 'wake_weights_s': 0, 'wake_kv_cache_s': 0}, "
                       "expected 2 each"),
    ("one_wake_missing", "vllm_1gpu sleep/wake lines {'sleep_s': 2, 'wake_weights_s': 2, 'wake_kv_cache_s': 1}, "
                         "expected 2 each"),
    ("probe_nan", "vllm_1gpu probe [0.02, nan] not all <= 3.0"),
    ("short_run", "vllm_1gpu ran 1 of 2 steps"),
])
def test_node_check_fails_a_run_that_misses_an_expectation(tmp_path, case, expected):
    log_text = {"no_sleep_lines": "", "one_wake_missing": RANK_LOG.rsplit("\n", 2)[0] + "\n"}.get(case, RANK_LOG)
    rows = [_row(1), _row(2, probe=float("nan"))] if case == "probe_nan" else \
        [_row(1)] if case == "short_run" else [_row(1), _row(2)]
    rows, log, _ = node.read_run(_run_folder(tmp_path, rows, log_text))
    res = {"rc": 0, **node.summarize(rows, log)}
    found = node.problems("vllm_1gpu", res, 2, sleeps=True, dtype="bfloat16")
    assert expected in found, found
    assert node.verdict({"vllm_1gpu": res}, found).startswith("gpu_node_check: FAIL: " + found[0])


def test_node_check_expects_no_sleep_from_the_adapter_run_and_names_a_crash():
    log = node.parse_rank_log(RANK_LOG)
    res = {"rc": 0, **node.summarize([_row(1), _row(2)], log)}
    assert node.problems("lora_adapter", res, 2, sleeps=False, dtype="bfloat16") == [
        "lora_adapter sleep/wake lines {'sleep_s': 2, 'wake_weights_s': 2, 'wake_kv_cache_s': 2}, expected 0 each"]
    assert node.problems("vllm_tp2", {"rc": 1}, 2, sleeps=True, dtype="bfloat16") == ["vllm_tp2 exited 1"]


def test_gpu_check_figures_skip_the_warm_up_step_and_name_mfu_against_the_peak():
    rows = [_row(1, **{"timing/update_s": 5.0}), _row(2), _row(3, **{"timing/update_s": 0.4})]
    res = gpu_check.summarize(rows, sequences=64, params=135_000_000, peak_tflops=989.0)
    # step tokens = 2000 tok/s x 1 s; update medians over steps 2-3: 2000/0.2 and 2000/0.4
    assert res["update_tokens_per_s"] == pytest.approx(7500.0)
    assert res["mfu"] == pytest.approx(6 * 135e6 * 7500 / 989e12)
    assert res["generate_tokens_per_s"] == pytest.approx(16 * 64 / 0.3)
    assert res["mismatch"] == {"abs_mean": 0.03, "abs_p99": 0.3, "abs_max": 0.9, "kl": 0.001}
    assert res["device_used_gib_max"] == 3.5 and res["steps"] == 3
    assert gpu_check.summarize([], 8, None, 989.0) == {"steps": 0}
