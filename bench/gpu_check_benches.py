"""The GPU check's runs that are bench scripts of their own (bench/carryover.py, bench/publish_rate.py), on
the same device and packages as its recipe runs: each a subprocess within the check's deadline, its JSON
read back into the check's result with the figures the check reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(bench: str, args: list[str], result: Path, overrides: list[str], env: dict, timeout: float) -> dict:
    """`python bench/<bench>.py args`: its exit status, wall time and JSON (`result`), or its output's tail."""
    cmd = [sys.executable, str(ROOT / "bench" / f"{bench}.py"), *args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}"
    res = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "bench": bench, "overrides": overrides}
    if rc == 0 and result.exists():
        res["result"] = json.loads(result.read_text())
    else:
        res["output_tail"] = text[-4000:]
    return res


def carryover(name: str, args: list[str], overrides: list[str], out: Path, env: dict, timeout: float) -> dict:
    """bench/carryover.py with the HF engine and these recipe overrides; its summary per mode and
    eta 3's ratios against the goals (generate <= 0.70x, step <= 0.80x sync)."""
    folder = out / name
    res = _script("carryover", ["--engine", "hf", *args, "--results-dir", str(folder), "--work-dir",
                                str(folder / "work"), *[x for o in overrides for x in ("--set", o)]],
                  folder / "carryover.json", overrides, env, timeout)
    if "result" in res:
        summary = res.pop("result")["summary"]
        eta3 = next(s for s in summary if s["eta"] == 3)
        res.update(summary=summary, eta3_generate_ratio=eta3["generate_ratio"], eta3_step_ratio=eta3["step_ratio"],
                   goals_met=eta3["generate_ratio"] <= 0.70 and eta3["step_ratio"] <= 0.80)
    return res


def publish(name: str, model_dir: Path, device: str, out: Path, env: dict, timeout: float) -> dict:
    """bench/publish_rate.py on the model's weights in bf16: a split run's publish packing and host
    staging, seconds per GiB; on the CPU (the dry run) also the whole publish to a second rank over gloo,
    which one GPU cannot run."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    res = _script("publish_rate", ["--model", str(model_dir), "--dtype", "bfloat16", "--device", device,
                                   "--ranks", "2" if device == "cpu" else "1", "--out", str(folder / "publish.json")],
                  folder / "publish.json", [], env, timeout)
    if "result" in res:
        res["publish"] = res.pop("result")
    return res


def row(r: dict, f) -> str:
    """The table's line for a bench run: its headline figures."""
    if r["bench"] == "carryover":
        return f"eta 3: generate {f(r.get('eta3_generate_ratio'))}x, step {f(r.get('eta3_step_ratio'))}x sync"
    p = r.get("publish", {})
    return (f"s/GiB: pack {f(p.get('pack_s_per_gib'))}, stage to host {f(p.get('stage_to_host_s_per_gib'))}, "
            f"back to device {f(p.get('host_to_device_s_per_gib'))}, publish {f(p.get('publish_s_per_gib'))} "
            f"({f(p.get('bytes', 0) / 2**30)} GiB)")
