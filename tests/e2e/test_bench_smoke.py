"""Each benchmark's --smoke mode runs end to end and writes the documented JSON keys.

Results go to a temporary folder (--results-dir), never bench/results. No wall-clock time or
ratio is asserted: these only keep the benchmark scripts from rotting. bench/carryover.py runs at
its --smoke sizes inside the GPU check's dry run (e2e/test_gpu_check.py), which checks its figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_bench(name: str, tmp_path: Path, *extra: str) -> dict:
    results, work = tmp_path / "results", tmp_path / "work"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke", "--results-dir", str(results),
                           "--work-dir", str(work), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bench/{name}.py --smoke failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    path = results / f"{name}.json"
    assert path.is_file(), proc.stdout[-2000:]
    return json.loads(path.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install 'trl==1.16.*')")
def test_vs_trl_smoke(tmp_path):
    # bf16, the path with the most to check; float32 differs only in the two flags
    out = run_bench("vs_trl", tmp_path, "--dtype", "bfloat16")
    assert out["records"]
    for rec in out["records"]:
        for key in ("model", "processes", "dtype", "distflow_tokens_per_s", "trl_tokens_per_s", "ratio_median",
                    "ratio_min", "ratio_max", "config"):
            assert key in rec, key
        assert _positive(rec["distflow_tokens_per_s"]) and _positive(rec["trl_tokens_per_s"])
        assert rec["ratio_min"] <= rec["ratio_median"] <= rec["ratio_max"]
        for key in ("distflow_command", "trl_command", "trl_grpo_config", "group_size", "prompts_per_step",
                    "max_new_tokens", "lr"):
            assert key in rec["config"], key
        assert rec["config"]["trl_grpo_config"]["beta"] == 0.0
        # both train in bf16: distflow's compute dtype, TRL's autocast over fp32 weights
        assert rec["dtype"] == "bfloat16" and "model.dtype=bfloat16" in rec["config"]["distflow_command"]
        assert rec["config"]["trl_grpo_config"]["bf16"] is True
        assert rec["config"]["trl_precision"] == {"param_dtype": "float32", "mixed_precision": "bf16", "autocast": True}


def test_sync_smoke(tmp_path):
    out = run_bench("sync", tmp_path, "--dtype", "float32")  # the probes below are float32's exactness
    assert _positive(out["ratio_median"])
    assert {r["engine"] for r in out["records"]} == {"vllm", "hf"}
    for rec in out["records"]:
        for key in ("sync_s_median", "copy_s_median", "ratio_median", "bytes"):
            assert _positive(rec[key]), key
    lora = {r["resync"]: r for r in out["lora_records"]}
    assert set(lora) == {"adapter", "merged"} and lora["adapter"]["bytes"] < lora["merged"]["bytes"]
    for rec in lora.values():  # either way the engine serves the policy
        assert rec["dtype"] == "float32"
        assert rec["probe_max_abs_diff"] <= 1e-5 and _positive(rec["generate_tokens_per_s_median"]), rec


def test_comm_smoke(tmp_path):
    out = run_bench("comm", tmp_path)
    per_step = out["bytes_per_rank_per_step"]
    assert set(per_step) == {"1", "2"}
    assert per_step["1"] == 0  # world size 1 calls no collective
    assert per_step["2"] > 0
    assert out["helper_payload_bytes_per_rank_per_step"]["1"] > 0
    assert "fsdp_sync_bytes_per_rank_per_step" in out
    assert isinstance(out["flat"], bool)


def test_flops_smoke(tmp_path):
    out = run_bench("flops", tmp_path)  # one run (model.dtype=auto), both peaks measured inside it
    assert _positive(out["train_flops_fraction_of_peak"])
    rec = out["records"][0]
    for key in ("params", "train_flops_per_s", "matmul_peak_flops_per_s", "trained_tokens_per_step",
                "update_s_per_step", "model_gemm_flops_per_s", "train_flops_fraction_of_model_gemms"):
        assert _positive(rec[key]), key
    assert rec["requested_dtype"] == "auto" and rec["dtype"] in ("float32", "bfloat16")  # as config.json resolved it
    assert out["headline"]["dtype"] == rec["dtype"] and set(out["by_dtype"]) == {rec["dtype"]}
    assert rec["matmul_peak_flops_per_s"] == rec["matmul_peaks_flops_per_s"][rec["dtype"]]
    for dtype in ("float32", "bfloat16"):
        assert _positive(rec["matmul_peaks_flops_per_s"][dtype]), dtype
        assert _positive(rec["model_gemm_flops_per_s_by_dtype"][dtype]), dtype
        peaks = rec["peak_measurements"]["before"][dtype]
        assert set(peaks["square"]) == {"256", "512"} and set(peaks["gemms"]) == set(rec["peak_measurements"]["gemms"])
    layers = {n for g in rec["peak_measurements"]["gemms"].values() for n in g["layers"]}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


def test_flops_dtype_ratios(monkeypatch):
    """bf16 / fp32 of the runs of one layout in both dtypes (the table --dtypes float32,bfloat16 prints)."""
    monkeypatch.syspath_prepend(str(ROOT / "src"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import flops

    def rec(dtype, update_s, flops_per_s, peaks):
        return {"model": "tiny", "processes": 1, "dtype": dtype, "update_s_per_step": update_s,
                "train_flops_per_s": flops_per_s, "matmul_peaks_flops_per_s": dict(zip(("float32", "bfloat16"), peaks))}

    ratios = flops.dtype_ratios([rec("float32", 2.0, 10.0, (100, 400)), rec("bfloat16", 1.0, 20.0, (90, 500))])
    assert ratios == [{"model": "tiny", "processes": 1, "update_s_bf16_over_fp32": 0.5,
                       "train_flops_bf16_over_fp32": 2.0, "matmul_peak_bf16_over_fp32": 5.0}]
    assert flops.dtype_ratios([rec("bfloat16", 1.0, 20.0, (90, 500))]) == []


def test_engines_smoke(tmp_path):
    out = run_bench("engines", tmp_path)
    rec = out["records"][0]
    assert rec["model"] == "tiny"
    for key in ("vllm_tokens_per_s", "hf_tokens_per_s", "ratio_median"):
        assert _positive(rec[key]), key
    assert set(rec["batch_shape"]) >= {"prompts_per_rank", "group_size", "max_new_tokens"}


def test_balance_smoke(tmp_path):
    out = run_bench("balance", tmp_path)
    rec = out["records"][0]
    for name in ("off", "on"):
        for key in ("update_max_s_median", "update_min_s_median", "update_max_over_min", "tokens_per_s"):
            assert _positive(rec[name][key]), (name, key)
    # the task is skewed by construction, and the balancer evens it out
    assert rec["tokens_spread_before"] > 1.5 and rec["tokens_spread_after"] < rec["tokens_spread_before"]


def test_update_smoke(tmp_path):
    # groups of 4 sharing a prompt, padded and packed side by side in the same launch, with memory
    out = run_bench("update", tmp_path, "--profile", "5", "--shared-prefix", "off,on", "--group-size", "4", "--memory")
    profile = (tmp_path / "work" / "tiny-n2-float32-profile.txt").read_text()
    assert "Self CPU" in profile and len(profile.splitlines()) >= 5, profile
    rows = profile.split("<- nearest caller\n")[1].splitlines()  # the by-caller table, after its header
    callers = [line.split("  <- ")[1] for line in rows if "  <- " in line]
    assert len(callers) == 5 and any(c != "?" for c in callers), profile  # the ops are attributed to code
    rec = out["records"][0]
    assert rec["processes"] == 2 and rec["seqs_per_rank"] > rec["micro_batch_size"]  # several micro-batches
    assert out["shared_prefix"] == ["off", "on"] and rec["shape"]["group_size"] == 4
    for variant in out["variants"]:
        for key in ("backward_s", "optimizer_s", "update_s"):
            assert _positive(rec["median_s"][variant][key]), (variant, key)
            assert _positive(rec["by_shared_prefix"]["on"]["median_s"][variant][key]), (variant, key)
        assert _positive(rec["speedup_shared_prefix"][variant])
        assert rec["median_s"][variant]["minor_faults"] >= 0 and rec["median_s"][variant]["system_s"] >= 0
    assert _positive(rec["speedup_fused"]) and _positive(rec["speedup_default"]) and _positive(rec["speedup_bucketed"])
    off, on = rec["by_shared_prefix"]["off"], rec["by_shared_prefix"]["on"]
    # padded rows carry each prompt once per sample plus padding; packed rows once per group
    assert off["fed_tokens"] < off["padded_tokens"] and on["fed_tokens"] == on["padded_tokens"] < off["fed_tokens"]
    assert rec["fed_tokens_on_over_off"] == on["fed_tokens"] / off["fed_tokens"]
    for mode in ("off", "on"):
        m = rec["memory"][mode]
        assert _positive(m["before_mib"]) and m["peak_mib"] >= m["before_mib"] and _positive(m["seconds"]), mode


def test_update_memory_smoke(tmp_path):
    out = run_bench("update_memory", tmp_path)
    rec = out["records"][0]
    assert set(rec["variants"]) == set(out["variants"]) == {"plain", "chunked", "checkpointed", "both"}
    for variant, r in rec["variants"].items():
        assert _positive(r["before_mib"]) and r["peak_mib"] >= r["before_mib"] and _positive(r["seconds"]), variant


def test_preempt_smoke(tmp_path):
    rec = run_bench("preempt", tmp_path)["records"][0]
    assert rec["exit_status"] == 75 and rec["stopped_after_step"] >= 2 and _positive(rec["checkpoint_mb"])
    assert 0 < rec["signal_to_saved_s"] <= rec["signal_to_exit_s"]


def test_startup_smoke(tmp_path):
    out = run_bench("startup", tmp_path)
    assert [(r["shard_ranks"], r["meta_device_init"]) for r in out["records"]] == [(-1, False), (-1, True)]
    for rec in out["records"]:
        assert rec["processes"] == 2 and len(rec["ranks"]) == 2
        for stages in rec["ranks"]:
            assert list(stages) == ["policy", "reference", "critic"]
            for s in stages.values():
                assert _positive(s["before_mib"]) and s["peak_mib"] >= s["before_mib"] and _positive(s["seconds"])


def test_memory_smoke(tmp_path):
    out = run_bench("memory", tmp_path)
    assert out["variants"] == {"default": []} and out["experiment"] == "smoke"
    rec = out["records"][0]
    assert rec["processes"] == 2 and len(rec["per_rank"]) == 2 and rec["method"] in ("clear_refs", "sampling")
    for phase in ("startup", "generate", "logprob", "update", "sync", "probe"):
        assert _positive(rec["peak_rss_gib"][phase]), phase
    assert rec["peak_rss_gib_max"] == max(rec["peak_rss_gib"].values())
    for rank in rec["per_rank"]:
        # the engine and the policy are measured inside start-up; steps call each phase once
        assert {"imports", "startup:engine", "startup:policy"} <= set(rank["peak_rss"])
        assert rank["calls"]["update"] == rank["calls"]["sync"] == 2
        after = rank["end_of_phase"]["startup"]
        assert 0 < after["anon"] <= after["rss"] and _positive(after["pss"])


def test_bf16_fidelity_smoke(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from distflow.models.tiny import resolve_model_path

    # two finished runs' folders: the update of one is far above a bf16 ulp, the other's far below
    start = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float32)
    runs = []
    for name, scale in (("large", 1e-1), ("small", 1e-7)):
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float32)
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start.parameters()):
                p.copy_(p0 + scale * p0.abs().clamp(min=1e-3) * torch.randn_like(p0))
        model.save_pretrained(tmp_path / name / "hf_model")
        (tmp_path / name / "config.json").write_text(json.dumps({"model": {"path": "tiny"}}))
        runs.append(str(tmp_path / name))
    out = run_bench("bf16_fidelity", tmp_path, "--runs", *runs)
    grads = out["gradients"]
    assert set(grads) == {"float32 at bf16-rounded weights", "bf16 compute, float32 head", "bf16 compute, bf16 head"}
    for name, g in grads.items():
        # bf16 changes a gradient by rounding, not in direction; NaN or a broken bf16 path fails these
        assert 0.9 < g["cosine"] <= 1 + 1e-9 and 0.5 < g["norm_ratio"] < 2, (name, g)
        assert 0.5 < g["sign_agreement"] <= 1 and -1 <= g["adam_step1_cosine"] <= 1, (name, g)
    large, small = out["runs"]
    assert large["visible"] > 0.9 and abs(large["kept"] - 1) < 0.05, large
    assert small["visible"] < 0.05, small  # most updates below half an ulp leave the bf16 value as it was


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install 'trl==1.16.*')")
def test_demo_seeds_smoke(tmp_path):
    # TRL's side only: distflow's side is the recipe itself, run as every test here runs it
    out = run_bench("demo_seeds", tmp_path, "--frameworks", "trl")
    assert set(out["results"]) == {"trl"} and out["steps"] == 2 and out["heldout_items"] == 8
    for framework, per_seed in out["results"].items():
        r = per_seed["0"]
        assert 0 <= r["after"] <= 1 and 0 <= r["signal_steps"] <= 2 and 0 <= r["reward_mean"] <= 1, (framework, r)
    # TRL trains with the settings the demo's own config resolved to, on the demo task's rows
    trl = out["results"]["trl"]["0"]["command"]
    for flag in ("--reward gym", "--temperature 0.7", "--lr 2e-05", "--warmup-steps 2", "--steps 2",
                 "--num-generations 4", "--prompts-per-step 4"):
        assert flag in trl, (flag, trl)
    rows = [json.loads(line) for line in (tmp_path / "work" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 1000 and all(r["gym_entry"]["answer"] == r["answer"] for r in rows)


def test_precision_smoke(tmp_path):
    out = run_bench("precision", tmp_path)
    rows = {(r["precision"], r["bypass"]): r for r in out["rows"]}
    assert set(rows) == {("float32", True), ("bf16, fp32 heads", False)}
    exact = rows[("float32", True)]
    # float32: engine and trainer agree to rounding, so the PPO ratio against the engine clips nothing
    assert exact["abs_max"] < 1e-5 and exact["clip_step1"] == 0.0, exact
    for r in rows.values():
        assert 0 <= r["abs_mean"] <= r["abs_max"] and _positive(r["generate_s"]) and _positive(r["update_s"]), r
    assert rows[("bf16, fp32 heads", False)]["abs_max"] > 0  # bf16 weights: the two sides' sums differ


def test_distill_smoke(tmp_path):
    # the student's seed is the teacher's: two launches (the teacher's GRPO run is the GRPO row)
    out = run_bench("distill", tmp_path, "--seed", "0")
    teacher, student = out["teacher"], out["student"]
    assert out["grpo"] == teacher and 0 <= out["base"] <= 1 and 0 <= student["after"] <= 1
    assert len(student["reverse_kl"]) == len(student["teacher_s"]) == 2 and not teacher["reverse_kl"]
    assert "algorithm=distill" in student["command"] and str(tmp_path / "work" / "teacher" / "hf_model") in \
        student["command"]
    assert (tmp_path / "work" / "teacher" / "hf_model" / "config.json").is_file()


def test_agent_smoke(tmp_path):
    out = run_bench("agent", tmp_path)
    (rec,) = out["records"]
    assert set(rec["variants"]) == {"wave", "free", "padded", "n4", "n4_padded"}
    for name, v in rec["variants"].items():
        for key in ("episodes_per_s_median", "generated_tokens_per_s_median", "generate_s_median", "update_s_median",
                    "step_s_median", "forward_tokens_median"):
            assert _positive(v[key]), key
        assert v["requests_mean_median"] == rec["turns"] == 2 and "task.agent=agent_harness:run" in v["commands"][0]
        assert v["rows_per_episode_median"] == (4 if name.startswith("n4") else 1), (name, v)
    # the group's prompt is fed once packed, once per episode padded (and padding on top); the n choices'
    # shared prompt once per request packed, once per row padded
    assert rec["padded_over_packed_forward_tokens"] > 1 and _positive(rec["free_over_wave_episodes_per_s"])
    assert rec["n4_padded_over_packed_forward_tokens"] > rec["padded_over_packed_forward_tokens"]


def test_env_wait_smoke(tmp_path):
    out = run_bench("env_wait", tmp_path)
    assert out["world"] == 2 and set(out["variants"]) == {"wave", "free"}
    for name, v in out["variants"].items():
        for key in ("step_s_mean", "tokens_per_s", "samples_per_s"):
            assert _positive(v[key]), (name, key)
        assert v["steps"] == 1 and v["turns_mean_mean"] == out["turns"] == 3, (name, v)  # every episode answered twice
        assert f"pipeline.env_wait={name}" in v["commands"][0] and "pipeline.apply=inflight" in v["commands"][0]
        assert 0 <= v["rollout_idle_ratio_mean"] <= 1 and 0 <= v["recv_wait_s_mean"] <= v["step_s_mean"], (name, v)
    assert _positive(out["free_over_wave_samples_per_s"])
