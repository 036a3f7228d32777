"""One command that checks the CUDA path on one GPU, within a deadline, and writes one JSON file.

    bench/gpu_check.sh                      # or `make gpu-check`; PYTHON=... picks the interpreter
    bench/gpu_check.sh --wheels .whl        # missing packages from wheels (bench/gpu_check_wheels.sh)
    bench/gpu_check.sh --dry-run            # the same set-up and one run on the CPU (gloo)

For a machine with one GPU and no network whose python already has a CUDA torch, transformers,
tokenizers and the usual scientific stack, but not Hydra or datasets: nothing is installed over
its packages. The wheels in `--wheels DIR` (default `.whl` when it exists) go into
`OUT/site` with `pip install --no-index --no-deps --target`, which is put on PYTHONPATH before
this source tree's `src`; torch must still be the machine's torch afterwards (same version, CUDA
and file), else the check stops with one line before any run. A pre-flight then imports what
`recipes/grpo.py` with `rollout=hf` imports, so a missing package is one line, not a failed run.

No weights file is carried: the models are random weights of real shapes, written into
`OUT/models` at the start (the tokenizer is the built-in tiny model's, built offline; token ids
beyond its vocabulary decode to nothing, which changes no timing).

Runs (each `torchrun --standalone --nproc_per_node=1 bench/memory_entry.py rollout=hf`, nccl,
the post-resync probe every step, per-phase peak memory from bench/memory_hooks.py), in this
order while the deadline (`--deadline`, default 420 s, all runs together) leaves time:
  smoke_float32         the smoke experiment in fp32 (tiny model): probe <= 1e-5
  smollm2_shape_bf16    SmolLM2-135M's shape (Llama, 576 hidden, 30 layers, 9/3 heads, 49152 vocab)
                        in bf16: update tokens/s and MFU, generate tokens/s, resync time,
                        engine-vs-policy mismatch, peak memory per phase
  carryover_qwen05_bf16 bench/carryover.py with the HF engine at Qwen2.5-0.5B's shape in bf16: sync
                        against carry-over eta 1 and 3 on a seeded long tail (goals: eta 3's
                        generate <= 0.70x and step <= 0.80x sync; reported, not checked)
  publish_qwen05_bf16   bench/publish_rate.py on the same weights in bf16: a split run's publish packing
                        and pipeline.staging=host's copies (to pinned host memory and back), s/GiB;
                        the broadcast itself needs a second GPU
  lora_bf16             the smoke experiment with LoRA adapters on a bf16 frozen base
  qwen05_shape_bf16     Qwen2.5-0.5B's shape (Qwen2, 896 hidden, 24 layers, 14/2 heads, 151936
                        vocab) in bf16, the same figures
MFU = 6 x parameters (a tied head once) x trained tokens / update time / the H200's bf16 dense
peak (989 TFLOP/s, NVIDIA's H200 SXM figure; `--peak-tflops` for another GPU). `--dry-run` runs
the first shaped run (one step), the carry-over bench and the publish figures on the CPU with a small
Llama config. Exit status 0 when every check passes, 1 when one fails, 2 when the set-up stops.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gpu_check_benches

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0
PEAK_SOURCE = "NVIDIA H200 SXM, bf16 dense tensor core (the 1979 TFLOP/s figure is with sparsity)"
PROBE_FP32 = 1e-5  # tests/e2e's bound for the fp32 smoke run
MIN_RUN_S = 60  # a run is not started with less of the deadline left
PHASES = ["generate", "reward", "logprob", "update", "sync", "probe", "step"]
# What recipes/grpo.py with rollout=hf imports beside the machine's own packages.
PREFLIGHT = ["hydra", "omegaconf", "datasets", "distflow.trainer", "distflow.rollout.hf_engine",
             "distflow.tasks.prompts", "distflow.tasks.rewards.numeric"]
ENV_INFO = """
import importlib, importlib.util, json, sys
import torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "file": torch.__file__}), flush=True)
tops = dict.fromkeys(name.partition(".")[0] for name in sys.argv[1:])
missing = [f"{t} (No module named {t!r})" for t in tops if importlib.util.find_spec(t) is None]
for name in [] if missing else sys.argv[1:]:  # the deep imports only when every package is there
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import is the pre-flight's answer
        missing.append(f"{name} ({type(e).__name__}: {e})" if not isinstance(e, ImportError) else f"{name} ({e})")
print(json.dumps(missing))
"""
# Real shapes from the models' published configs (the weights are random).
SHAPES = {
    "smollm2_135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "qwen2_5_0_5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "dry_run": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=512,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def fail(msg: str) -> int:
    print(f"gpu_check: error: {msg}", file=sys.stderr, flush=True)
    return 2


def torch_info() -> dict:
    import torch

    available = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "file": torch.__file__, "available": available,
            "devices": torch.cuda.device_count() if available else 0,
            "device_name": torch.cuda.get_device_name(0) if available else None}


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Every wheel in `wheels` into `site`, without dependencies or an index: only what was brought."""
    files = sorted(glob.glob(str(wheels / "*.whl")))
    if files:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--upgrade", "--target", str(site), *files], check=True)
    return [Path(f).name for f in files]


def write_model(name: str, out: Path, tokenizer_dir: str) -> int:
    """A random-weight causal LM of the shape SHAPES[name] with the tokenizer of `tokenizer_dir`,
    saved (float32 safetensors) into `out`; returns its unique parameter count."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    shape = dict(SHAPES[name])
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if shape.pop("arch") == "llama" else \
        (Qwen2Config, Qwen2ForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = config_cls(**shape, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, dtype="float32")
    config.architectures = [model_cls.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=pad, pad_token_id=pad, eos_token_id=[eos, pad]).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def launch(name: str, overrides: list[str], out: Path, env: dict, timeout: float) -> tuple[int, str, float]:
    """One torchrun of the recipe with the memory hooks; the whole process group is killed on timeout."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "bench" / "memory_entry.py"), "rollout=hf", *overrides, f"run.output_dir={run_dir}",
           "checkpoint.resume=never", "logging.plot_at_end=false", "logging.progress_bar=false"]
    print(f"[gpu_check] {name} (at most {timeout:.0f} s): {' '.join(overrides)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "DISTFLOW_MEM_OUT": str(run_dir / "memory")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc, text = 124, f"{text}\nstopped after {timeout:.0f} s (the deadline)"
    return rc, text, time.perf_counter() - t0


def median(values: list[float]) -> float | None:
    values = [v for v in values if v == v]  # not NaN
    return statistics.median(values) if values else None


def summarize(rows: list[dict], sequences: int, params: int | None, peak_tflops: float) -> dict:
    """A run's figures from metrics.jsonl: medians skip the first (warm-up) step when there are more.
    Tokens of a step = prompt + response tokens (throughput x step time); generated tokens =
    mean response length x sequences."""
    if not rows:
        return {"steps": 0}
    timed = rows[1:] if len(rows) > 1 else rows
    step_tokens = [r["throughput/tokens_per_s"] * r["timing/step_s"] for r in timed]
    update_tps = median([t / max(r["timing/update_s"], 1e-9) for t, r in zip(step_tokens, timed)])
    probes = [r.get("sync/max_abs_logprob_diff", float("nan")) for r in rows]
    out = {
        "steps": len(rows),
        "sequences_per_step": sequences,
        "update_tokens_per_s": update_tps,
        "generate_tokens_per_s": median([r["response_length/mean"] * sequences / max(r["timing/generate_s"], 1e-9)
                                         for r in timed]),
        "resync_s": median([r["timing/sync_s"] for r in timed]),
        "tokens_per_s": median([r["throughput/tokens_per_s"] for r in timed]),
        "step_breakdown_s": {p: median([r.get(f"timing/{p}_s", 0.0) for r in timed]) for p in PHASES},
        "probe_max_abs_logprob_diff": max((p for p in probes if p == p), default=None),
        "probe_per_step": probes,
        "mismatch": {k: median([r[f"mismatch/{k}"] for r in rows if f"mismatch/{k}" in r])
                     for k in ("abs_mean", "abs_p99", "abs_max", "kl")},
        "mismatch_per_step": [{k.split("/")[1]: v for k, v in r.items() if k.startswith("mismatch/")} for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in rows),
    }
    if params:
        out["params"] = params
        out["update_tflops"] = 6 * params * update_tps / 1e12
        out["mfu"] = out["update_tflops"] / peak_tflops
    for key in ("memory/peak_allocated_gib", "memory/device_used_gib"):
        if any(key in r for r in rows):
            out[key.split("/")[1] + "_max"] = max(r.get(key, 0.0) for r in rows)
    return out


def phase_memory(run_dir: Path) -> dict:
    """Peak memory per phase from bench/memory_hooks.py (rank 0), in GiB: CUDA's allocated and
    reserved peaks where CUDA ran, the process's RSS high-water mark always."""
    path = run_dir / "memory" / "rank0.json"
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    gib = lambda d: {k: round(v / 2**30, 3) for k, v in d.items()}  # noqa: E731
    out = {"peak_rss_gib": gib(res["peak_rss"])}
    if res.get("peak_cuda_allocated"):
        out["peak_cuda_allocated_gib"] = gib(res["peak_cuda_allocated"])
        out["peak_cuda_reserved_gib"] = gib(res["peak_cuda_reserved"])
    return out


def plan(dry_run: bool, steps: int | None) -> list[dict]:
    """The runs in order: name, model shape (None: a built-in model), sequences per step, overrides."""
    probe = ["run.sync_probe_every=1", "run.sync_probe_seqs=4"]
    smoke = ["experiment=smoke", *probe]  # 2 prompts x group 4 on one rank
    shaped = ["task=arith_jsonl", "algorithm.group_size=4", "rollout.max_prompt_tokens=128", "optim.lr=1e-5", *probe]
    if dry_run:
        return [{"name": "dry_run_shape_bf16", "shape": "dry_run", "sequences": 8, "overrides": [
            *shaped, "model.dtype=bfloat16", f"run.steps={steps or 1}", "data.prompts_per_rank=2",
            "rollout.max_new_tokens=16", "optim.micro_batch_size=8"]},
                {"name": "carryover_dry_run_bf16", "shape": "dry_run", "bench": [
                    "--steps", "2", "--repeats", "1", "--max-new-tokens", "32", "--prompts-per-rank", "2"]},
                {"name": "publish_dry_run_bf16", "shape": "dry_run", "publish": True}]
    big = ["data.prompts_per_rank=16", "rollout.max_new_tokens=128", "optim.micro_batch_size=16"]  # 64 sequences
    return [
        {"name": "smoke_float32", "shape": None, "sequences": 8,
         "overrides": [*smoke, "model.dtype=float32", f"run.steps={steps or 3}"]},
        {"name": "smollm2_shape_bf16", "shape": "smollm2_135m", "sequences": 64,
         "overrides": [*shaped, *big, "model.dtype=bfloat16", f"run.steps={steps or 6}"]},
        {"name": "carryover_qwen05_bf16", "shape": "qwen2_5_0_5b", "bench": [
            "--steps", str(steps or 3), "--repeats", "2", "--max-new-tokens", "256", "--prompts-per-rank", "16"]},
        {"name": "publish_qwen05_bf16", "shape": "qwen2_5_0_5b", "publish": True},
        {"name": "lora_bf16", "shape": None, "sequences": 8,
         "overrides": [*smoke, "model.dtype=bfloat16", f"run.steps={steps or 3}", "model.lora.enabled=true",
                       "algorithm.kl_coef=0.05", "optim.lr=1e-3"]},
        {"name": "qwen05_shape_bf16", "shape": "qwen2_5_0_5b", "sequences": 64,
         "overrides": [*shaped, *big, "model.dtype=bfloat16", f"run.steps={steps or 4}"]},
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU (gloo), a small Llama config, one run of one step")
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="folder for the runs and the JSON")
    default_wheels = ROOT / ".whl"
    p.add_argument("--wheels", default=os.environ.get("DISTFLOW_WHEELS") or
                   (str(default_wheels) if default_wheels.is_dir() else None),
                   help="wheels of the missing packages (bench/gpu_check_wheels.sh); default .whl if present")
    p.add_argument("--deadline", type=float, default=420, help="seconds for the whole check, set-up included")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 3 smoke / 6 or 4 shaped; dry 1)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's bf16 dense peak, for MFU")
    a = p.parse_args()
    t_end = time.monotonic() + a.deadline
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "gpu_check.json"
    result_path.unlink(missing_ok=True)  # a JSON left from an earlier check must not pass for this one

    before = torch_info()
    if not a.dry_run and not before["available"]:
        return fail(f"torch {before['torch']} (CUDA {before['cuda']}) sees no usable GPU; "
                    "use --dry-run to check the CPU path")
    site = out / "site"
    carried = install_wheels(Path(a.wheels).resolve(), site) if a.wheels else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               DISTFLOW_CACHE=str(out / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site) if carried else None, str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH")])))
    pre = subprocess.run([sys.executable, "-c", ENV_INFO, *PREFLIGHT], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    lines, last_error = pre.stdout.strip().splitlines(), (pre.stderr.strip().splitlines() or ["?"])[-1]
    if not lines:
        return fail(f"the run environment cannot import torch: {last_error}")
    after = json.loads(lines[0])
    if [after[k] for k in ("torch", "cuda", "file")] != [before[k] for k in ("torch", "cuda", "file")]:
        return fail(f"after set-up torch is {after['torch']} (CUDA {after['cuda']}, {after['file']}), not the "
                    f"machine's {before['torch']} (CUDA {before['cuda']}, {before['file']}); remove torch's wheels "
                    f"from {a.wheels}")
    missing = json.loads(lines[1]) if len(lines) > 1 else [last_error]
    if missing:
        return fail(f"cannot import {'; '.join(missing)}; bring the wheels "
                    "(bench/gpu_check_wheels.sh DIR here, then --wheels DIR)")

    sys.path.insert(0, str(ROOT / "src"))
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the models' "Writing model shards" bars
    from distflow.models.tiny import build_tiny_model
    from distflow.probe import PROBE_LIMIT

    tokenizer_dir = build_tiny_model(str(out / "cache"))  # offline; also the smoke runs' model
    device = ["run.device=cpu", "run.backend=gloo"] if a.dry_run else ["run.device=cuda", "run.backend=nccl"]
    runs: dict[str, dict] = {}
    written: dict[str, int] = {}  # model shapes written: their parameter counts
    for spec in plan(a.dry_run, a.steps):
        name, left = spec["name"], t_end - time.monotonic()
        if left < MIN_RUN_S:
            runs[name] = {"skipped": f"{left:.0f} s of the deadline left"}
            print(f"[gpu_check] {name}: skipped, {left:.0f} s of the deadline left", flush=True)
            continue
        overrides, params = list(spec.get("overrides", [])), None
        if spec["shape"]:
            model_dir = out / "models" / spec["shape"]
            if spec["shape"] not in written:
                written[spec["shape"]] = write_model(spec["shape"], model_dir, tokenizer_dir)
            params = written[spec["shape"]]
            overrides.append(f"model.path={model_dir}")
        if "bench" in spec or "publish" in spec:  # a bench script of its own, on the same device
            left = t_end - time.monotonic()
            if "bench" in spec:
                overrides += [*device, "model.dtype=bfloat16"]
                runs[name] = gpu_check_benches.carryover(name, spec["bench"], overrides, out, env, left)
            else:
                runs[name] = gpu_check_benches.publish(name, model_dir, "cpu" if a.dry_run else "cuda", out, env, left)
            print(f"[gpu_check] {name}: rc={runs[name]['rc']}, {runs[name]['wall_s']:.0f} s", flush=True)
            continue
        rc, text, wall = launch(name, [*overrides, *device], out, env, t_end - time.monotonic())
        metrics = out / name / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        res = {"rc": rc, "wall_s": round(wall, 1), "overrides": overrides,
               **summarize(rows, spec["sequences"], params, a.peak_tflops), "memory_per_phase": phase_memory(out / name)}
        if rc != 0:
            res["output_tail"] = text[-4000:]
        runs[name] = res
        print(f"[gpu_check] {name}: rc={rc}, {wall:.0f} s, {res['steps']} step(s)", flush=True)

    done = {n: r for n, r in runs.items() if "skipped" not in r and "bench" not in r}
    bf16 = [r for n, r in done.items() if "bf16" in n]
    checks = {
        "all_started_runs_finished": bool(done) and all(r["rc"] == 0 and r["steps"] > 0 for r in done.values())
        and all(r["rc"] == 0 for r in runs.values() if "bench" in r),
        "bf16_probe_below_warning": all((r.get("probe_max_abs_logprob_diff") or 99.0) <= PROBE_LIMIT["bfloat16"]
                                        for r in bf16),
        "mismatch_reported": all(r.get("mismatch", {}).get("abs_mean") is not None for r in bf16),
    }
    if "smoke_float32" in done:
        checks["fp32_probe_within_1e-5"] = (done["smoke_float32"].get("probe_max_abs_logprob_diff") or 1.0) <= PROBE_FP32
    result = {"bench": "gpu_check", "dry_run": a.dry_run, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "deadline_s": a.deadline, "elapsed_s": round(a.deadline - (t_end - time.monotonic()), 1),
              "peak_bf16_tflops": a.peak_tflops, "peak_source": PEAK_SOURCE if a.peak_tflops == PEAK_TFLOPS else "--peak-tflops",
              "machine": {**before, "python": platform.python_version(), "platform": platform.platform(),
                          "cpu_count": os.cpu_count(), "python_executable": sys.executable},
              "carried_wheels": carried, "checks": checks, "ok": all(checks.values()), "runs": runs}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(runs))
    print(f"checks: {checks}\nwrote {result_path}")
    return 0 if result["ok"] else 1


def table(runs: dict[str, dict]) -> str:
    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec)

    lines = [f"{'run':>20} {'rc':>4} {'update tok/s':>12} {'MFU':>7} {'gen tok/s':>10} {'resync s':>9} "
             f"{'probe':>9} {'mm mean':>9} {'mm p99':>9} {'mm KL':>9}"]
    for name, r in runs.items():
        if "skipped" in r:
            lines.append(f"{name:>20} skipped: {r['skipped']}")
            continue
        if "bench" in r:
            lines.append(f"{name:>20} {r['rc']:>4} {gpu_check_benches.row(r, f)}")
            continue
        mm = r.get("mismatch", {})
        lines.append(f"{name:>20} {r['rc']:>4} {f(r.get('update_tokens_per_s'), '.0f'):>12} "
                     f"{f(r.get('mfu'), '.2%'):>7} {f(r.get('generate_tokens_per_s'), '.0f'):>10} "
                     f"{f(r.get('resync_s')):>9} {f(r.get('probe_max_abs_logprob_diff')):>9} {f(mm.get('abs_mean')):>9} "
                     f"{f(mm.get('abs_p99')):>9} {f(mm.get('kl')):>9}")
        for kind, by_phase in r.get("memory_per_phase", {}).items():
            lines.append(f"{'':>20} {kind}: " + ", ".join(f"{k} {v}" for k, v in by_phase.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
