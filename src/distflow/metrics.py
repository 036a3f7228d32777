"""Step metrics: reduced across ranks with two all_reduces, written by rank 0 only.

Trainer code calls `reduce_step_metrics` and `MetricLogger.log` on every rank; the logger
itself decides that only rank 0 writes, so no trainer code branches on the rank.

Loggers are chosen by name (`trainer.loggers`), several at once:

  console      tqdm bar on rank 0 (step/total, reward, step time, ETA) and `info()` messages;
               with progress_bar=False one plain line per step instead (friendlier in batch logs)
  jsonl        <output_dir>/metrics.jsonl, one JSON object per step; a resumed run first rewrites
               it with the checkpoint's history (steps logged after the last checkpoint by the run
               that died are dropped, so each step appears once), then appends
  wandb        Weights & Biases run under <output_dir>/wandb, initialised with the run config;
               honours WANDB_MODE (offline works with no network). The run id is kept in
               <output_dir>/wandb_run_id, so a resumed run continues the same W&B run.
  tensorboard  torch.utils.tensorboard SummaryWriter into <output_dir>/tb
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import time
from typing import Any, Iterable

from distflow.config import ConfigError
from distflow.distributed import all_reduce

log = logging.getLogger("distflow")

LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
DEFAULT_LOGGERS = ("console", "jsonl")


def reduce_step_metrics(sums: dict[str, float], maxima: dict[str, float],
                        minima: dict[str, float] | None = None) -> dict[str, float]:
    """Global sums, maxima and minima of per-rank values; the same dict on every rank.

    Keys must be identical (and in the same order) on every rank. Minima ride in the maxima's
    all_reduce, negated, so they cost no extra collective.
    """
    out: dict[str, float] = {}
    if sums:
        total = all_reduce(list(sums.values()), "sum").tolist()
        out.update(zip(sums.keys(), total))
    minima = minima or {}
    if maxima or minima:
        top = all_reduce([*maxima.values(), *(-v for v in minima.values())], "max").tolist()
        out.update(zip(maxima.keys(), top))
        out.update(zip(minima.keys(), (-v for v in top[len(maxima):])))
    return out


def check_logger_names(loggers: Iterable[str] | str | None) -> list[str]:
    """Validated, de-duplicated logger names in the given order; ConfigError on an unknown one."""
    if loggers is None:
        return list(DEFAULT_LOGGERS)
    if isinstance(loggers, str):  # tolerate "console,wandb" from a command line
        loggers = [s for s in loggers.split(",") if s.strip()]
    names: list[str] = []
    for name in loggers:
        name = str(name).strip().lower()
        if name not in LOGGERS:
            raise ConfigError(f"trainer.loggers: unknown logger {name!r} (choose from {', '.join(LOGGERS)})")
        if name not in names:
            names.append(name)
    return names


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


# ----------------------------------------------------------------------------- backends
class _Console:
    def __init__(self, total_steps: int, progress_bar: bool):
        self.total = total_steps
        self.bar = None
        self.t0 = time.perf_counter()
        self.first_step: int | None = None
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.first_step is None:
            self.first_step = step
            if self.bar is not None and step > 1:  # resumed run: start the bar (and its ETA) there
                self.bar.reset(total=self.total)
                self.bar.initial = self.bar.n = step - 1
        postfix = {"reward": _fmt(metrics.get("reward/mean"), ".3f"),
                   "step_s": _fmt(metrics.get("timing/step_s"), ".1f")}
        if self.bar is not None:
            self.bar.update(max(step - self.bar.n, 0))
            self.bar.set_postfix(postfix)
            return
        done = step - self.first_step + 1
        elapsed = time.perf_counter() - self.t0
        left = max(self.total - step, 0)
        eta = time.strftime("%H:%M:%S", time.gmtime(elapsed / done * left)) if done > 0 else "?"
        print(f"step {step}/{self.total} | reward {postfix['reward']} | step {postfix['step_s']}s | eta {eta}",
              flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Jsonl:
    def __init__(self, output_dir: str, history: list[dict] | None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.file = open(self.path, "a" if history is None else "w", encoding="utf-8")
        self.file.writelines(json.dumps(m) + "\n" for m in history or [])
        self.file.flush()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.file.write(json.dumps(metrics, sort_keys=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _Wandb:
    def __init__(self, output_dir: str, project: str, run_config: dict | None):
        import wandb

        id_file = os.path.join(output_dir, "wandb_run_id")
        if os.path.isfile(id_file):
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids: short, lowercase alphanumeric
            with open(id_file, "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(project=project, dir=os.path.abspath(output_dir), config=run_config or {},
                              name=os.path.basename(os.path.abspath(output_dir)), id=run_id, resume="allow")
        self.last_step = -1

    def log(self, metrics: dict[str, Any], step: int) -> None:
        # W&B drops non-increasing steps (re-logged steps after a resume) with a warning; skip them quietly.
        if step <= self.last_step:
            return
        self.last_step = step
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _TensorBoard:
    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "tb"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in _scalars(metrics).items():
            if k != "step":
                self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------- the logger
class MetricLogger:
    """Fans each step's metrics out to the chosen loggers, on rank 0 only.

    On other ranks the object exists and every method is a no-op, so callers never branch on
    the rank. Logger names are validated on every rank (an unknown one raises ConfigError
    everywhere, before anything is written).
    """

    def __init__(self, output_dir: str, is_main: bool, total_steps: int, progress_bar: bool = True,
                 loggers: Iterable[str] | None = None, run_config: dict | Any | None = None,
                 project: str = "distflow", history: list[dict] | None = None):
        """history: a resumed run's logged steps (metrics.jsonl is rewritten to exactly these)."""
        self.names = check_logger_names(loggers)
        self.active = is_main
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.console: _Console | None = None
        self.backends: list[Any] = []
        self._count = 0
        self._closed = False
        if not self.active:
            return
        if run_config is not None and dataclasses.is_dataclass(run_config):
            run_config = dataclasses.asdict(run_config)
        os.makedirs(output_dir, exist_ok=True)
        try:
            for name in self.names:
                if name == "console":
                    self.console = _Console(total_steps, progress_bar)
                    self.backends.append(self.console)
                elif name == "jsonl":
                    self.backends.append(_Jsonl(output_dir, history))
                elif name == "wandb":
                    self.backends.append(_Wandb(output_dir, project, run_config))
                elif name == "tensorboard":
                    self.backends.append(_TensorBoard(output_dir))
        except BaseException:
            self.close()
            raise

    @property
    def bar(self):
        """The tqdm bar (rank 0, console logger with progress_bar=True), else None."""
        return self.console.bar if self.console is not None else None

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        self._count += 1
        step = metrics.get("step", self._count)
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else self._count
        for backend in self.backends:
            backend.log(metrics, step)

    def info(self, message: str) -> None:
        """A one-line message for the user, through the run's output channel (distflow.output)."""
        if self.active:
            log.info(message)

    def finish(self, summary: dict, plots: bool = True) -> str:
        """End of run: summary.json and the plots (rank 0 writes), and the headline numbers."""
        path = os.path.join(self.output_dir, "summary.json")
        if not self.active:
            return path
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        if plots:
            from distflow.plot import write_plots

            for plot in write_plots(self.output_dir):
                self.info(f"plot: {plot}")
        for when in ("before", "after"):
            if f"heldout_pass1_{when}" in summary:
                self.info(f"held-out pass@1 {when} training: {summary[f'heldout_pass1_{when}']:.3f} "
                          f"({summary['heldout_items']} items)")
        if "heldout_pass1_delta" in summary:
            self.info(f"held-out pass@1 change: {summary['heldout_pass1_delta']:+.3f}")
        self.info(f"summary: {path}")
        return path

    def close(self) -> None:
        if not self.active or self._closed:
            return
        self._closed = True
        for backend in reversed(self.backends):
            backend.close()
