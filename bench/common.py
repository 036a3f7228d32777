"""Shared helpers for the benchmark scripts: flags, launching torchrun, reading metrics, tables, JSON.

Every bench is one command (`.venv/bin/python bench/<name>.py [--smoke] [--results-dir DIR]`),
prints a table and writes `<results-dir>/<name>.json` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(ROOT / "src") not in sys.path:  # distflow's helpers, imported where used (importing is the cost)
    sys.path.insert(0, str(ROOT / "src"))
DEFAULT_RESULTS = BENCH / "results"
GRPO = ROOT / "recipes" / "grpo.py"
ARITH = ROOT / "recipes" / "data" / "arith.jsonl"
SYSTEM_PROMPT = "Answer with the final number after 'The answer is'."  # recipes/task/arith_jsonl.yaml
MODELS = ("tiny", "smollm2_135m")
CORES = os.cpu_count() or 1
_at_once = 1  # launches `each` runs together: they share the cores, so each process gets fewer threads


def run_grpo_recipe() -> None:
    """Run the unmodified recipes/grpo.py as __main__ in this process with this process's
    command-line overrides: the entries that install measuring hooks first end with this."""
    import runpy

    recipe = ROOT / "recipes" / "grpo.py"
    sys.argv[0] = str(recipe)
    sys.path.insert(0, str(recipe.parent))
    runpy.run_path(str(recipe), run_name="__main__")


def worker_args(ints: tuple[str, ...] = (), strings: tuple[str, ...] = ()) -> argparse.Namespace:
    """The arguments a benchmark passes the worker it launches (its own script with --worker):
    --overrides and --out, and the named int and str flags, all required."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    for flag in ("--overrides", "--out", *strings):
        ap.add_argument(flag, required=True)
    for flag in ints:
        ap.add_argument(flag, type=int, required=True)
    return ap.parse_args()


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny, fast configuration (used by the tests)")
    p.add_argument("--results-dir", default=str(DEFAULT_RESULTS), help="where <name>.json is written")
    p.add_argument("--work-dir", default=None, help="run folders and logs (default: a folder under /tmp)")
    p.add_argument("--models", default=None,
                   help="comma list of tiny,smollm2_135m (default: tiny plus smollm2_135m when it is "
                        "available; --smoke: tiny)")
    return p


def smollm2_available() -> bool:
    try:
        resolve_model("smollm2_135m")
        return True
    except Exception as e:  # noqa: BLE001 - not installed / not convertible: fall back to tiny
        print(f"smollm2_135m unavailable ({type(e).__name__}: {e}); tiny only")
        return False


def models(args) -> list[str]:
    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        bad = [m for m in names if m not in MODELS]
        if bad:
            raise SystemExit(f"unknown model(s) {bad}; choose from {MODELS}")
        return names
    return ["tiny"] + ([] if args.smoke or not smollm2_available() else ["smollm2_135m"])


def work_dir(args, name: str) -> Path:
    d = Path(args.work_dir) if args.work_dir else Path("/tmp") / f"distflow-bench-{os.getuid()}" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def fresh(*paths: Path) -> None:
    """Remove leftovers of an earlier run: metrics.jsonl is appended to, so a reused output folder
    would mix runs."""
    for path in paths:
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(nproc: int, extra: dict | None = None) -> dict:
    """Offline, one equal share of the cores per process, huge pages for torch's large CPU tensors
    as distflow's entry point asks for them (the same for every framework)."""
    from distflow.run.hostmem import prefer_huge_pages

    threads = max(1, CORES // (nproc * _at_once))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), str(BENCH), os.environ.get("PYTHONPATH", "")] if p)
    prefer_huge_pages(env)
    env.update(extra or {})
    return env


def torchrun(script: Path | str, args: list[str], nproc: int, log: Path, timeout: float = 1800,
             extra_env: dict | None = None) -> float:
    """`torchrun --standalone --nproc_per_node N script args` (gloo on CPU); output to `log`.
    Returns the wall time; raises with the log tail on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    return run(cmd, log, timeout, bench_env(nproc, extra_env))


def each(fn, items: list, together: bool = False) -> list:
    """[fn(x) for x in items], each call typically one launch. `together` (--smoke runs, whose
    times nobody reads) makes the calls at once, in threads, so independent launches overlap
    their start-ups on the machine's cores; results keep the order of `items` either way. Their
    processes split the cores' OpenMP threads (bench_env): more threads than cores would spin
    against each other."""
    global _at_once
    if not together or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    _at_once = len(items)
    try:
        with ThreadPoolExecutor(len(items)) as pool:
            return list(pool.map(fn, items))
    finally:
        _at_once = 1


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> float:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=env or bench_env(1), stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(open(log, errors="replace").readlines()[-40:])
        raise RuntimeError(f"command failed (rc={proc.returncode}): {' '.join(map(str, cmd))}\n--- {log} ---\n{tail}")
    return wall


def engine(args) -> str:
    """The rollout engine a benchmark's recipe runs use: vLLM, as in training; --smoke runs (the
    tests' check that the script works) use transformers generate, which starts in a fraction of
    vLLM's time, wherever the engine is not what the benchmark measures."""
    return "hf" if args.smoke else "vllm"


def distflow_overrides(model: str, out_dir: Path, steps: int, prompts_per_rank: int, group_size: int,
                       max_new_tokens: int, lr: float, engine: str = "vllm", extra: list[str] | None = None) -> list[str]:
    """recipes/grpo.py overrides for a benchmark run: one optimizer step per rollout, one forward
    per rank (micro batch = the rank's whole batch, as TRL does), beta = 0, fresh output folder."""
    return [
        f"model={model}", "task=arith_jsonl", f"rollout={engine}",
        f"run.steps={steps}", f"run.output_dir={out_dir}", "checkpoint.resume=never",
        "logging.plot_at_end=false", "logging.progress_bar=false", "checkpoint.every=0",
        f"data.prompts_per_rank={prompts_per_rank}", f"algorithm.group_size={group_size}",
        "algorithm.kl_coef=0.0", f"rollout.max_new_tokens={max_new_tokens}", "rollout.max_prompt_tokens=128",
        f"optim.lr={lr}", f"optim.micro_batch_size={prompts_per_rank * group_size}", "optim.mini_batches=1",
        *(extra or []),
    ]


def read_metrics(out_dir: Path) -> list[dict]:
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def step_tokens(m: dict) -> float:
    """prompt+response tokens of all ranks in a distflow step (throughput × step time)."""
    return m["throughput/tokens_per_s"] * m["timing/step_s"]


def stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def resolve_model(name: str) -> str:
    from distflow.models.tiny import resolve_model_path

    return resolve_model_path(name)


def recipe_shard_ranks(model: str) -> int:
    """The `model.shard_ranks` the trainer resolves for a built-in model name (they replicate: 1),
    so a worker that builds the policy itself shards it as the trainer would."""
    from distflow.config import ModelConfig
    from distflow.distributed.devices import shard_ranks

    return shard_ranks(ModelConfig(path=model))


def count_params(model_path: str) -> int:
    """Unique parameters (a tied head counted once), from the config, without loading weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def machine() -> dict:
    """Where the numbers were taken. torch's version comes from its installed metadata, the same
    string as torch.__version__, without importing torch (seconds, in a process that launches others)."""
    from importlib.metadata import version

    return {"cpu_count": CORES, "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": version("torch"), "python": platform.python_version()}


def cpu_bf16_support() -> dict:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16, AMX tiles): without them torch
    emulates bf16 matmuls and bf16 runs need not be faster than fp32 ones."""
    import torch

    cpu = torch.cpu
    return {"avx512_bf16": bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()),
            "amx_tile": bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())}


def loadavg() -> float:
    """1-minute load average: other users' jobs on a shared machine show up here."""
    return os.getloadavg()[0]


def previous_records(results_dir: str, name: str, smoke: bool) -> list[dict]:
    path = Path(results_dir) / f"{name}.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return old.get("records", []) if old.get("smoke") == smoke else []


def merge_records(previous: list[dict], new: list[dict], keys=("model", "processes")) -> list[dict]:
    """`new` plus the `previous` records whose keys were not measured again."""
    seen = {tuple(r[k] for k in keys) for r in new}
    merged = [r for r in previous if tuple(r.get(k) for k in keys) not in seen] + new
    order = {m: i for i, m in enumerate(MODELS)}
    return sorted(merged, key=lambda r: (order.get(r["model"], 99), r["processes"]))


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def write_json(results_dir: str, name: str, obj: dict) -> Path:
    """Write the result, with the command that made it and the 1-minute load average when written."""
    obj = {**obj, "command": obj.get("command") or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
           "loadavg_1m_at_write": loadavg()}
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    print(f"wrote {path}")
    return path
