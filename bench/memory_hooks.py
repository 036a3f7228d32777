"""Peak memory per rank and per trainer phase (used by bench/memory.py).

`install()` adds an observer of the trainer's phases (distflow.metrics.timer), so that each phase
opens a labelled interval:

  startup   the components' construction (task, engine, policy, reference, critic, resume)
  generate  the engine's rollouts   logprob   the forward passes before the update
  update    the optimizer steps     sync      the weight resync
  probe     the engine/policy probe validate  held-out evaluation
  reward, balance: scoring and balancing the trainer waits for
  other     everything in between (logging, checkpoints, export)

Start-up is split further into startup:engine (the engine), startup:policy (the policy and the
reference) and startup:critic; `imports` is the RSS when the Trainer starts (torch,
transformers, Hydra). Nested phases (these, or the resync inside a resume) count for the inner
one: a phase's peak is the max over it and its `phase:` parts. At every boundary the
interval's peak is read and the counter reset, so nothing between two samples is missed:

  CPU   the kernel's resident-set high-water mark (VmHWM in /proc/self/status), reset by writing
        5 to /proc/self/clear_refs; where that is refused, a 5 ms sampling thread of VmRSS
  CUDA  torch.cuda.max_memory_allocated / max_memory_reserved, reset with reset_peak_memory_stats

At each phase's end the current RSS is also split into anonymous memory (heap: tensors, the
allocator's free lists), file-backed pages (shared libraries, mmapped weight files) and shared
memory, with the proportional set size (PSS: shared pages divided among the processes that map
them). Each rank writes $DISTFLOW_MEM_OUT/rank<r>.json at exit. Nothing under src/ is modified.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
import time
from pathlib import Path

# the trainer's phases (distflow.metrics.timer) that are their own intervals here; any other phase
# (reward, balance) is charged under its own name
PHASES = {"startup": "startup", "startup:engine": "startup:engine", "startup:policy": "startup:policy",
          "startup:critic": "startup:critic", "generate": "generate", "logprob": "logprob", "update": "update",
          "sync": "sync", "probe": "probe", "validate": "validate"}
KIB = 1024


def _status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes."""
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * KIB for k in keys}


def _pss() -> int:
    try:
        text = open("/proc/self/smaps_rollup").read()
        return int(re.search(r"^Pss:\s+(\d+) kB", text, re.M).group(1)) * KIB
    except (OSError, AttributeError):
        return 0


class PhaseMeter:
    def __init__(self):
        self.stack = ["other"]
        self.peak: dict[str, int] = {}  # phase -> peak RSS (bytes)
        self.cuda_peak: dict[str, int] = {}
        self.cuda_reserved: dict[str, int] = {}
        self.end: dict[str, dict] = {}  # phase -> RSS split at the end of its last occurrence
        self.calls: dict[str, int] = {}
        self.timeline: list[list] = []  # [label, peak during it, RSS at its end, anon at its end] per call
        self.lock = threading.Lock()
        self.sampled_max = 0
        self.method = "clear_refs" if self._reset_hwm() else "sampling"
        if self.method == "sampling":
            threading.Thread(target=self._sample, daemon=True, name="distflow-mem").start()

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _sample(self) -> None:
        while True:
            rss = _status("VmRSS")["VmRSS"]
            with self.lock:
                self.sampled_max = max(self.sampled_max, rss)
            time.sleep(0.005)

    def _close_interval(self) -> int:
        """Charge the peak since the last boundary to the phase on top of the stack, then reset;
        returns that peak."""
        label = self.stack[-1]
        if self.method == "clear_refs":
            peak = _status("VmHWM")["VmHWM"]
            self._reset_hwm()
        else:
            with self.lock:
                peak, self.sampled_max = max(self.sampled_max, _status("VmRSS")["VmRSS"]), 0
        self.peak[label] = max(self.peak.get(label, 0), peak)
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_peak[label] = max(self.cuda_peak.get(label, 0), torch.cuda.max_memory_allocated())
            self.cuda_reserved[label] = max(self.cuda_reserved.get(label, 0), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        return peak

    def enter(self, label: str) -> None:
        self._close_interval()
        self.stack.append(label)
        self.calls[label] = self.calls.get(label, 0) + 1

    def exit(self) -> None:
        peak = self._close_interval()
        label = self.stack.pop()
        now = _status("VmRSS", "RssAnon", "RssFile", "RssShmem")
        self.end[label] = {"rss": now["VmRSS"], "anon": now["RssAnon"], "file": now["RssFile"],
                           "shmem": now["RssShmem"], "pss": _pss()}
        self.timeline.append([label, peak, now["VmRSS"], now["RssAnon"]])

    def result(self) -> dict:
        self._close_interval()
        now = _status("VmRSS", "RssAnon", "RssFile", "RssShmem")
        return {"rank": int(os.environ.get("RANK", "0")), "method": self.method, "peak_rss": self.peak,
                "peak_cuda_allocated": self.cuda_peak, "peak_cuda_reserved": self.cuda_reserved,
                "end_of_phase": self.end, "calls": self.calls,
                "timeline": self.timeline, "exit": now, "children_rss": _children_rss()}


def _children_rss() -> int:
    """RSS of this rank's child processes (reward workers) at exit, counted apart."""
    try:
        import psutil

        return sum(c.memory_info().rss for c in psutil.Process().children(recursive=True))
    except Exception:  # noqa: BLE001 - psutil missing or a child already gone
        return 0


METER: PhaseMeter | None = None


def _write() -> None:
    out = os.environ.get("DISTFLOW_MEM_OUT")
    if not out or METER is None:
        return
    res = METER.result()
    path = Path(out) / f"rank{res['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


class PhaseObserver:
    """An observer of the run (distflow.metrics.timer): each timed phase opens its interval."""

    def on_phase_start(self, phase: str, step: int) -> None:
        METER.enter(PHASES.get(phase, phase))

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None:
        METER.exit()


def install() -> None:
    global METER
    import distflow.metrics.timer

    METER = PhaseMeter()
    distflow.metrics.timer.PROCESS_OBSERVERS.append(PhaseObserver())
    METER.enter("imports")
    METER.exit()
    atexit.register(_write)
