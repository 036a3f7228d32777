"""Step metrics: reduced across ranks with two all_reduces, written by rank 0 only.

Trainer code calls `reduce_step_metrics` and `MetricLogger.log` on every rank; the logger
itself decides that only rank 0 writes, so no trainer code branches on the rank.

Loggers are chosen by name (`logging.loggers`), several at once:

  console      tqdm bar on rank 0 (step/total, reward, step time, ETA) when its console is a
               terminal; into a file or a pipe, or with progress_bar=False, plain lines instead
               (first and last step, and at most one per progress_every_s between them)
  jsonl        <output_dir>/metrics.jsonl, one JSON object per step; a resumed run keeps the rows
               up to its checkpoint's step (steps logged after the last checkpoint by the run that
               died are dropped, so each step appears once), then appends
  wandb        Weights & Biases run under <output_dir>/wandb, initialised with the run config;
               honours WANDB_MODE (offline works with no network). The run id is kept in
               <output_dir>/wandb_run_id, so a resumed run continues the same W&B run.
  tensorboard  torch.utils.tensorboard SummaryWriter into <output_dir>/tb

A logger whose file cannot be written (a full disk) is noted (distflow.run.output.note_write_failure)
and dropped, not raised: the step's end stops every rank together with that line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from distflow.config import LoggingConfig
from distflow.distributed import all_reduce
from distflow.run.output import note_write_failure, write_failure_line, write_line
from distflow.errors import RunAborted
from distflow.run.rundir import RunDir

log = logging.getLogger("distflow")



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


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


# ----------------------------------------------------------------------------- backends
class _Console:
    """A tqdm bar when rank 0's console is a terminal; otherwise plain lines, throttled.

    A bar written into a file (a batch log, nohup, CI) leaves every redraw there, carriage
    returns and all, and the next log line glued behind the last one: without a terminal a line
    is printed for the first and the last step and for at most one step per `every_s` seconds
    between them, each with the bar's figures."""

    def __init__(self, total_steps: int, progress_bar: bool, every_s: float = 0.0):
        self.total, self.every_s = total_steps, every_s
        self.bar = None
        self.t0 = time.perf_counter()
        self.first_step: int | None = None
        self.last_line = -math.inf
        if progress_bar and _is_terminal(sys.stderr):  # where tqdm draws
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

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
        now = time.perf_counter()
        edge = step == self.first_step or step >= self.total
        if not edge and now - self.last_line < self.every_s:
            return
        self.last_line = now
        done = step - self.first_step + 1
        left = max(self.total - step, 0)
        eta = time.strftime("%H:%M:%S", time.gmtime((now - self.t0) / done * left)) if done > 0 else "?"
        write_line(f"step {step}/{self.total} | reward {postfix['reward']} | step {postfix['step_s']}s | eta {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class _Jsonl:
    def __init__(self, path: Path, resumed_step: int):
        """resumed_step: the checkpoint's step a resumed run continues from (0: a fresh start). The
        kept rows are written to a new file that replaces the old one, so a full disk loses none."""
        self.path = path
        if not (resumed_step and path.is_file()):
            self.file = open(path, "w", encoding="utf-8")
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if (row := _row(line)) is not None and row.get("step", 0) <= resumed_step]
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        self.file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.file.write(json.dumps(metrics, sort_keys=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _row(line: str) -> dict | None:
    """A metrics row; None for a blank line or one cut short (a full disk, a kill mid-write)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class _Wandb:
    def __init__(self, run: RunDir, project: str, run_config: dict):
        import wandb

        if run.wandb_run_id.is_file():
            run_id = run.wandb_run_id.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids: short, lowercase alphanumeric
            run.wandb_run_id.write_text(run_id + "\n", encoding="utf-8")
        self.path = run.wandb
        root = run.root.resolve()  # W&B writes under <dir>/wandb: the run folder's wandb/
        self.run = wandb.init(project=project, dir=str(root), config=run_config, name=root.name, id=run_id,
                              resume="allow")
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
    def __init__(self, run: RunDir):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run.tensorboard
        self.writer = SummaryWriter(log_dir=str(run.tensorboard))

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
    the rank. The logger names were checked with the rest of the config, before anything loaded.
    """

    def __init__(self, run: RunDir, is_main: bool, total_steps: int, cfg: LoggingConfig, run_config: dict,
                 resumed_step: int = 0):
        self.run, self.active = run, is_main
        self.backends: list[Any] = []
        self._count = 0
        self._closed = False
        if not self.active:
            return
        run.root.mkdir(parents=True, exist_ok=True)
        build = {"console": lambda: _Console(total_steps, cfg.progress_bar, cfg.progress_every_s),
                 "jsonl": lambda: _Jsonl(run.metrics, resumed_step),
                 "wandb": lambda: _Wandb(run, cfg.wandb_project, run_config),
                 "tensorboard": lambda: _TensorBoard(run)}
        files = {"jsonl": run.metrics, "wandb": run.wandb, "tensorboard": run.tensorboard}
        try:
            for name in dict.fromkeys(cfg.loggers):  # in the given order, each once
                try:
                    self.backends.append(build[name]())
                except OSError as e:
                    if name not in files:
                        raise
                    note_write_failure(files[name], e)
        except BaseException:
            self.close()
            raise

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        self._count += 1
        step = metrics.get("step", self._count)
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else self._count
        for backend in list(self.backends):
            try:
                backend.log(metrics, step)
            except OSError as e:
                if not hasattr(backend, "path"):  # the console
                    raise
                note_write_failure(backend.path, e)
                self.backends.remove(backend)
                _close_quietly(backend)

    def finish(self, summary: dict, plots: bool = True) -> None:
        """End of run: summary.json and the plots (rank 0 writes), and the headline numbers."""
        if not self.active:
            return
        try:
            self.run.summary.write_text(json.dumps(summary, indent=2), encoding="utf-8")
            if plots:
                from distflow.metrics.plot import write_plots

                for plot in write_plots(self.run):
                    log.info(f"plot: {plot}")
        except OSError as e:  # after the last step: rank 0 alone stops, the others are done
            raise RunAborted(f"{write_failure_line(e.filename or self.run.summary, e)}; the training itself "
                             "finished") from None
        for when in ("before", "after"):
            if f"heldout_pass1_{when}" in summary:
                log.info(f"held-out pass@1 {when} training: {summary[f'heldout_pass1_{when}']:.3f} "
                         f"({summary['heldout_items']} items)")
        if "heldout_pass1_delta" in summary:
            log.info(f"held-out pass@1 change: {summary['heldout_pass1_delta']:+.3f}")
        log.info(f"summary: {self.run.summary}")

    def close(self) -> None:
        if not self.active or self._closed:
            return
        self._closed = True
        for backend in reversed(self.backends):
            if hasattr(backend, "path"):
                _close_quietly(backend)
            else:
                backend.close()


def _close_quietly(backend) -> None:
    """Close a file logger; the unwritten end of a write that failed was noted already."""
    try:
        backend.close()
    except OSError:
        pass
