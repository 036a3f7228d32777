"""Step metrics: reduced across ranks with two all_reduces, written by rank 0 only.

Trainer code calls `reduce_step_metrics` and `MetricLogger.log` on every rank; the logger
itself decides that only rank 0 writes, so no trainer code branches on the rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distflow.distributed import all_reduce


def reduce_step_metrics(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """Global sums and maxima of per-rank values; the same dict on every rank.

    Keys must be identical (and in the same order) on every rank.
    """
    out: dict[str, float] = {}
    if sums:
        total = all_reduce(list(sums.values()), "sum").tolist()
        out.update(zip(sums.keys(), total))
    if maxima:
        top = all_reduce(list(maxima.values()), "max").tolist()
        out.update(zip(maxima.keys(), top))
    return out


class MetricLogger:
    """metrics.jsonl (one JSON object per step) plus a tqdm progress bar, on rank 0."""

    def __init__(self, output_dir: str, is_main: bool, total_steps: int, progress_bar: bool = True):
        self.active = is_main
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.bar = None
        if not self.active:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="grpo", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(metrics, sort_keys=False) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                step_s=f"{metrics.get('timing/step_s', float('nan')):.1f}",
            )

    def info(self, message: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
