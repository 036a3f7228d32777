"""Signal to exit: how long a run takes to stop cleanly after SIGTERM (what SLURM's grace must cover).

For each model, `launch/local.sh 2` trains; once `--signal-after` steps are logged, SIGTERM goes
to local.sh (which passes it to torchrun and on to every rank, as the SLURM templates do).
Reported, from the signal: the end of the step in flight, the checkpoint being complete (rank 0's
log line), and the exit of the launcher; plus the mean step time and the checkpoint's size.

    .venv/bin/python bench/preempt.py [--smoke] [--models tiny,smollm2_135m]
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from common import ROOT, bench_env, engine, fresh, loadavg, machine, models, parser, stats, table, work_dir, write_json

EXPERIMENT = {  # the smoke run, and the demo without its evaluations
    "tiny": ["experiment=smoke"],
    "smollm2_135m": ["experiment=demo", "validation.before_train=false", "validation.at_end=false"],
}


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _saved_at(out: Path) -> float:
    """Wall-clock time of rank 0's "stopped after step" line (written once the checkpoint is complete)."""
    line = next(x for x in (out / "logs" / "rank_0.log").read_text().splitlines() if "stopped after step" in x)
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def measure(model: str, work: Path, signal_after: int, engine: str) -> dict:
    out, log = work / f"{model}-run", work / f"{model}.log"
    fresh(out)
    args = [*EXPERIMENT[model], f"rollout={engine}", "run.steps=1000", f"run.output_dir={out}", "checkpoint.resume=never",
            "logging.progress_bar=false", "logging.plot_at_end=false"]
    env = bench_env(2, {"PYTHON": os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))})
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(ROOT / "launch" / "local.sh"), "2", *args], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
        metrics = out / "metrics.jsonl"
        while _rows(metrics) < signal_after:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before step {signal_after}; see {log}")
            time.sleep(0.05)
        rows_at_signal, t_signal, wall_signal = _rows(metrics), time.monotonic(), time.time()
        proc.send_signal(signal.SIGTERM)
        t_step_end = None
        while proc.poll() is None:
            if t_step_end is None and _rows(metrics) > rows_at_signal:
                t_step_end = time.monotonic()
            time.sleep(0.02)
        t_exit = time.monotonic()
    steps = [json.loads(x) for x in metrics.read_text().splitlines()]
    ckpt = next((out / "checkpoints").iterdir())
    return {
        "model": model, "processes": 2, "exit_status": proc.returncode, "stopped_after_step": len(steps),
        "step_s": stats([r["timing/step_s"] for r in steps]),
        "signal_to_step_end_s": (t_step_end - t_signal) if t_step_end else 0.0,
        "signal_to_saved_s": _saved_at(out) - wall_signal,
        "signal_to_exit_s": t_exit - t_signal,
        "checkpoint_mb": sum(p.stat().st_size for p in ckpt.iterdir()) / 2**20,
        "load_1m": loadavg(),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--signal-after", type=int, default=2, help="send SIGTERM once this many steps are logged")
    args = p.parse_args()
    work = work_dir(args, "preempt")
    records = [measure(m, work, args.signal_after, engine(args)) for m in models(args)]
    print(table(["model", "exit", "stop step", "step s", "to step end s", "to saved s", "to exit s", "ckpt MB"],
                [[r["model"], r["exit_status"], r["stopped_after_step"], r["step_s"]["median"],
                  r["signal_to_step_end_s"], r["signal_to_saved_s"], r["signal_to_exit_s"], r["checkpoint_mb"]]
                 for r in records]))
    write_json(args.results_dir, "preempt",
               {"machine": machine(), "records": records})


if __name__ == "__main__":
    main()
