"""The step's phase clock, and the observers that watch a run from outside its loop.

`PhaseTimer.phase(key)` adds a block's wall time to the step's timing record and tells every
observer when a phase starts and ends. Benchmarks (memory per phase, collectives per step, FLOP/s
around the run) and test-only fault injection are observers: none of them patches the trainer.
An observer implements any of the `Observer` methods; the missing ones are skipped.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch

# Observers every Trainer built in this process gets, after the ones it is given (a benchmark's
# hooks, installed before the recipe builds the trainer, or a module's the run imports later).
PROCESS_OBSERVERS: list[Any] = []


class Observer(Protocol):
    def on_train_start(self, step: int) -> None: ...

    def on_phase_start(self, phase: str, step: int) -> None: ...

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, step: int, path: str) -> None: ...

    def on_run_end(self, trainer: Any) -> None: ...

    # Observers that may change what passes (test-only fault injection, distflow.run.faults):
    def on_batch(self, step: int, batch: Any) -> Any: ...

    def on_weights(self, step: int, weights: Any) -> Any: ...

    def before_checkpoint_marker(self, step: int) -> None: ...


class PhaseTimer:
    """Times phases into `timing` (one dict per step: `new_step`) and notifies observers.

    logging.sync_timing (`sync_device`): on CUDA the host queues kernels and runs ahead, so a
    phase's host-clock time is when its work was queued, not done. With it, every phase edge
    waits for the device first (a cost: the host can no longer run ahead across phases). A no-op
    on CPU."""

    def __init__(self, device: torch.device, sync_device: bool = False, observers: list | None = None):
        self.edge: Callable[[], None] | None = torch.cuda.synchronize if sync_device and device.type == "cuda" else None
        self.given = list(observers or [])
        self.step = 0
        self.timing: dict[str, float] = {}

    @property
    def observers(self) -> list:
        return self.given + PROCESS_OBSERVERS

    def new_step(self, step: int) -> dict[str, float]:
        self.step, self.timing = step, {}
        return self.timing

    def notify(self, event: str, *args) -> None:
        for obs in self.observers:
            if (hook := getattr(obs, event, None)) is not None:
                hook(*args)

    def passed(self, event: str, step: int, value: Any) -> Any:
        """`value` after every observer's `event` hook (on_batch, on_weights) has seen it."""
        for obs in self.observers:
            if (hook := getattr(obs, event, None)) is not None:
                value = hook(step, value)
        return value

    @contextmanager
    def phase(self, key: str) -> Iterator[None]:
        """Adds the wall time of the block to timing[key] (so repeated phases accumulate)."""
        if self.edge is not None:
            self.edge()
        self.notify("on_phase_start", key, self.step)
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.edge is not None:
                self.edge()
            seconds = time.perf_counter() - t
            self.timing[key] = self.timing.get(key, 0.0) + seconds
            self.notify("on_phase_end", key, self.step, seconds)
