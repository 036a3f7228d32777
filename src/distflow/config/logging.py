"""The logging section: where step metrics go, console verbosity and progress, timing, plots."""

from __future__ import annotations

from typing import List, Literal

from distflow.config.fields import knob, section

Logger = Literal["console", "jsonl", "wandb", "tensorboard"]


@section
class LoggingConfig:
    loggers: List[Logger] = knob(factory=lambda: ["console", "jsonl"], operational=True,
                                 doc="Where step metrics go, several at once (distflow.metrics.loggers).")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = knob(
        "WARNING", "Third-party messages (vLLM, transformers, ...) on rank 0's console from this level up. Below INFO "
        "the warnings expected at start-up and on every resync are one line that counts them; INFO shows each. Every "
        "rank's logs/rank_<r>.log holds everything regardless.",
        operational=True)
    progress_bar: bool = knob(
        True, "A tqdm bar on rank 0's console when it is a terminal. Output to a file or a pipe (a batch log, "
        "nohup, CI), or false: plain progress lines instead (logging.progress_every_s).", operational=True)
    progress_every_s: float = knob(
        10.0, "Without a bar, a progress line (step, reward, step time, ETA) at the first and the last step and at "
        "most once per this many seconds between them; 0: every step.", operational=True)
    wandb_project: str = knob("distflow", "The W&B project (loggers: wandb).", operational=True)
    sync_timing: bool = knob(
        False, "CUDA: wait for the device at every phase edge, so timing/* and throughput/* measure the device's work "
        "rather than when the host queued it (costs the host's run-ahead); no effect on CPU.", operational=True)
    plot_at_end: bool = knob(True, "Write training.png at the end of the run (distflow.metrics.plot).", operational=True)
    straggler_warn_steps: int = knob(
        5, "Warn when the same rank has the most compute time (step minus timing/wait_s) for this many consecutive "
        "steps and is >10% slower than the fastest (a slow node); 0: never warn.", operational=True)

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.straggler_warn_steps >= 0, "logging.straggler_warn_steps must be >= 0 (0 = never warn)"),
                (self.progress_every_s >= 0, "logging.progress_every_s must be >= 0 (0 = every step)")]
