"""Launch recipes/grpo.py under torchrun as a user would, for end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dist_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent  # on the ranks' PYTHONPATH: rewards_for_tests, envs_for_tests
# What rank 0 logs before the engine and the policy read their weights: a run that stops before it
# has loaded nothing.
LOADING = "distflow: loading weights:"
# Runs compare against float32 references (engine vs policy to 1e-5, a resume bit for bit), so
# they pin float32 unless a test names another dtype: model.dtype=auto picks bf16 on CPUs with bf16
# matrix instructions.
FLOAT32 = "model.dtype=float32"


def pinned(overrides: list[str]) -> list[str]:
    """`overrides`, with model.dtype=float32 first unless they name a dtype themselves."""
    return overrides if any(o.lstrip("+").startswith("model.dtype=") for o in overrides) else [FLOAT32, *overrides]


def launch_env(extra_env: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    return env


def python_json(code: str, *args: str, extra_env: dict | None = None) -> dict:
    """Run `code` in a fresh interpreter with distflow's src on its path, and return the JSON object
    it prints last: for what a process sets up once, when it starts (malloc, torch's allocator)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def torchrun_command(overrides: list[str], nproc: int = 2, torchrun_args: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", *(torchrun_args or []),
            str(ROOT / "recipes" / "grpo.py"), *pinned(overrides)]


def torchrun(overrides: list[str], nproc: int = 2, timeout: float = 600, extra_env: dict | None = None,
             torchrun_args: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(overrides, nproc, torchrun_args), cwd=ROOT, env=launch_env(extra_env),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(output_dir) -> list[dict]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


VOLATILE = ("timing/", "throughput/", "rollout/idle_ratio")  # wall-clock dependent; everything else bitwise


def stable_metrics(row: dict) -> dict:
    """A metrics row without its wall-clock keys: what a bit-exact resume must reproduce."""
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def fail_run(overrides: list[str], tmp_path) -> subprocess.CompletedProcess:
    """The smoke experiment with `overrides` that must stop it, under bare torchrun. torchrun
    stops the other ranks within its 1 s monitor interval of the first one's exit, so a slower
    rank may be gone before it reaches the error itself: every rank saying it is checked
    in-process (distributed/test_trainer_loop.py)."""
    return torchrun(["experiment=smoke", f"run.output_dir={tmp_path}", *overrides], timeout=180,
                    torchrun_args=["--monitor-interval=1"])


def assert_clean_failure(proc: subprocess.CompletedProcess, needle: str, before_loading: bool = True) -> None:
    """The run failed, a rank's line starts with `needle`, torchrun's failure summary names it (the
    rank's error file), and (before_loading) no weights were loaded."""
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert any(line.startswith(needle) for line in text.splitlines()), text[-5000:]
    assert f"traceback : {needle}" in proc.stderr, text[-5000:]
    assert not before_loading or LOADING not in text, text[-3000:]


def children() -> set[int]:
    """The pids of this process's live children (every thread's), from /proc."""
    pids = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids
