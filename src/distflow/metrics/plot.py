"""Training curves from a run folder: `python -m distflow plot <output_dir>`.

Reads <output_dir>/metrics.jsonl (and summary.json when present) and writes
<output_dir>/training.png with four panels:

  reward       reward/mean per step, val/pass@1 points, held-out pass@1 before/after training
  length       response_length/mean and response_length/max
  step time    stacked timing/* phases (generate, reward, logprob, update, sync, probe, other) of
               the slowest rank, and over them the time ranks spent waiting for each other in
               collectives (timing/wait_s, the rank that waited longest; wait_min_s, the least)
  throughput   throughput/tokens_per_s

Missing keys leave their panel (or line) empty; a single step is drawn as points/bars.
Rendering uses the Agg canvas directly, so no display and no global pyplot state are needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from distflow.run.rundir import RunDir

PHASES = ["generate_s", "reward_s", "logprob_s", "update_s", "sync_s", "probe_s"]


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; unreadable lines (e.g. a line cut by a crash) are skipped.

    Rows with the same step are merged, later values winning (a resumed run that re-logs a step,
    or validation logged as its own row); the result is sorted by step.
    """
    if not os.path.isfile(path):
        return []
    by_step: dict[float, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            step = _num(row.get("step"))
            if step is None:  # no usable step: count rows instead
                step = float(len(by_step) + 1)
                row["step"] = step
            by_step.setdefault(step, {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        x, y = _num(r.get("step")), _num(r.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _line(ax, xs, ys, label, **kw) -> bool:
    if not xs:
        return False
    ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 30 else None, markersize=3, **kw)
    return True


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _reward_panel(ax, rows, summary) -> None:
    drew = _line(ax, *_series(rows, "reward/mean"), "reward/mean")
    vx, vy = _series(rows, "val/pass@1")
    if vx:
        ax.scatter(vx, vy, marker="D", s=30, color="tab:green", zorder=3, label="val/pass@1")
        drew = True
    steps = [s for s in (_num(r.get("step")) for r in rows) if s is not None]
    first, last = (min(steps), max(steps)) if steps else (0.0, 1.0)
    for key, x, color, marker in (("heldout_pass1_before", 0.0 if first >= 1 else first, "tab:purple", "v"),
                                  ("heldout_pass1_after", last, "tab:red", "^")):
        y = _num(summary.get(key))
        if y is not None:
            ax.axhline(y, color=color, linestyle=":", linewidth=1)
            ax.scatter([x], [y], marker=marker, s=60, color=color, zorder=4, label=f"{key} = {y:.3f}")
            drew = True
    if not drew:
        _no_data(ax)
    ax.set_title("reward")
    ax.set_ylabel("reward / pass@1")


def _length_panel(ax, rows) -> None:
    a = _line(ax, *_series(rows, "response_length/mean"), "mean")
    b = _line(ax, *_series(rows, "response_length/max"), "max", linestyle="--")
    if not (a or b):
        _no_data(ax)
    ax.set_title("response length")
    ax.set_ylabel("tokens")


def _timing_panel(ax, rows) -> None:
    steps, layers = [], {p: [] for p in PHASES + ["other"]}
    for r in rows:
        x = _num(r.get("step"))
        vals = {p: _num(r.get(f"timing/{p}")) for p in PHASES}
        if x is None or (all(v is None for v in vals.values()) and _num(r.get("timing/step_s")) is None):
            continue
        steps.append(x)
        known = 0.0
        for p in PHASES:
            v = max(vals[p] or 0.0, 0.0)
            layers[p].append(v)
            known += v
        total = _num(r.get("timing/step_s"))
        layers["other"].append(max(total - known, 0.0) if total is not None else 0.0)
    present = [p for p in PHASES + ["other"] if any(v > 0 for v in layers[p])]
    if not steps or not present:
        _no_data(ax)
    elif len(steps) == 1:
        bottom = 0.0
        for p in present:
            ax.bar(steps, layers[p], bottom=bottom, width=0.6, label=p.removesuffix("_s"))
            bottom += layers[p][0]
    else:
        ax.stackplot(steps, *[layers[p] for p in present], labels=[p.removesuffix("_s") for p in present])
    # Waiting is part of the phases above (a rank blocks inside them): drawn over them, not stacked.
    _line(ax, *_series(rows, "timing/wait_s"), "wait (most)", color="black", linestyle="--")
    _line(ax, *_series(rows, "timing/wait_min_s"), "wait (least)", color="gray", linestyle=":")
    ax.set_title("step time")
    ax.set_ylabel("seconds")


def _throughput_panel(ax, rows) -> None:
    if not _line(ax, *_series(rows, "throughput/tokens_per_s"), "tokens/s", color="tab:orange"):
        _no_data(ax)
    ax.set_title("throughput")
    ax.set_ylabel("tokens / s")


def write_plots(run: RunDir) -> list[str]:
    """Write the run folder's training.png from metrics.jsonl; returns the written paths ([] if no rows)."""
    rows = read_metrics(str(run.metrics))
    if not rows:
        return []
    summary: dict[str, Any] = {}
    summary_path = run.summary
    if summary_path.is_file():
        try:
            with open(summary_path, encoding="utf-8") as f:
                loaded = json.load(f)
            summary = loaded if isinstance(loaded, dict) else {}
        except (OSError, json.JSONDecodeError):
            summary = {}

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    _reward_panel(axes[0, 0], rows, summary)
    _length_panel(axes[0, 1], rows)
    _timing_panel(axes[1, 0], rows)
    _throughput_panel(axes[1, 1], rows)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.suptitle(run.root.resolve().name)
    path = str(run.plot)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return [path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distflow plot", description=__doc__.splitlines()[0])
    ap.add_argument("output_dir", help="run folder holding metrics.jsonl")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.output_dir):
        print(f"distflow plot: error: {args.output_dir} is not a folder", file=sys.stderr)
        return 2
    run = RunDir(args.output_dir)
    paths = write_plots(run)
    if not paths:
        print(f"distflow plot: error: no metrics in {run.metrics}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0

