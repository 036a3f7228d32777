"""The run's own sections, in torchtitan's manner: the run itself (length, seed, folder, where it
executes), checkpointing and resume, validation on the held-out split, and logging."""

from __future__ import annotations

from typing import List, Literal

from distflow.config.fields import knob, section

Logger = Literal["console", "jsonl", "wandb", "tensorboard"]


@section
class RunConfig:
    steps: int = knob(3, "Training steps (each: rollout, advantages, update, resync).")
    seed: int = knob(0, "Seeds the models' initialisation, the data order and sampling.")
    output_dir: str = knob("outputs/run", "The run folder: metrics, logs, checkpoints, summary (distflow.run.rundir).",
                           operational=True)
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", "auto: CUDA when torch can use it; GPUs visible or allocated that torch cannot use stop the run "
        "(distflow.distributed.devices). cpu trains on the CPU on purpose.", operational=True)
    backend: Literal["auto", "gloo", "nccl"] = knob("auto", "auto: nccl on CUDA, gloo on CPU.", operational=True)
    collective_timeout_s: float = knob(600.0, "A collective that waits longer than this fails the run.",
                                       operational=True)
    balance_lengths: bool = knob(
        True, "Move whole groups between ranks after rollout so every rank trains on about as many tokens "
        "(distflow.rollout.balance); results are the same either way, only the slowest rank changes.",
        operational=True)
    sync_probe_seqs: int = knob(2, "Sequences of each probed step used to check the engine's logprobs against the "
                                "policy's after the resync; 0: never probe.", operational=True)
    sync_probe_every: int = knob(10, "Probe at step 1 and every N steps (a forward pass in engine and policy, about "
                                 "10% of a SmolLM2 step on CPU).", operational=True)
    allow_engine_mismatch: bool = knob(
        False, "A probe (at start-up and on probed steps) past what the dtype explains stops the run: the engine "
        "would sample from another distribution than the policy trains (distflow.probe.PROBE_LIMIT). "
        "true: warn and train anyway.", operational=True)
    memory_check: bool = knob(
        True, "On CUDA, estimate at start-up what each phase puts on a rank's GPU (engine, weights, AdamW state, "
        "gradients, reference, critic, activations) and stop with one line when it cannot fit "
        "(distflow.train.memory_budget); false: skip the estimate.", operational=True)
    max_nonfinite_steps: int = knob(
        3, "A step whose loss or gradient norm is not finite on any rank is skipped on all ranks "
        "(update/nonfinite_skipped); this many consecutive skipped steps stop the run.", operational=True)
    host_mmap_threshold_kib: int = knob(
        1024, "Host memory blocks of at least this many KiB get their own mapping, handed back to the OS when freed "
        "(glibc's M_MMAP_THRESHOLD, distflow.run.hostmem); 0: glibc's default, which climbs to 32 MiB and "
        "keeps freed activations resident (bench/memory.py).", operational=True)
    fault_inject: str = knob(
        "", "Test-only: RANK:STEP[:kill|raise|nan|kill_saving|sleep=S|stale_resync] fails that rank during that step "
        "(STEP+: that step and every later one; nan makes its loss NaN; sleep=S delays it S seconds before its update; "
        "kill_saving kills it in the middle of that step's checkpoint write; stale_resync leaves a tensor out of its "
        "resync).", operational=True)

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.steps >= 0, "run.steps must be >= 0"),
            (self.sync_probe_every >= 1, "run.sync_probe_every must be >= 1"),
            (self.sync_probe_seqs >= 0, "run.sync_probe_seqs must be >= 0 (0 = never probe)"),
            (self.max_nonfinite_steps >= 1, "run.max_nonfinite_steps must be >= 1"),
            (0 <= self.host_mmap_threshold_kib <= 32 * 1024,
             "run.host_mmap_threshold_kib must be 0 (glibc's default) to 32768 (glibc's maximum), "
             f"got {self.host_mmap_threshold_kib}"),
            (self.backend != "nccl" or self.device != "cpu",
             "run.backend=nccl needs CUDA, but run.device=cpu (use gloo or auto)"),
        ]


@section
class CheckpointConfig:
    """torch.distributed.checkpoint saves and resume (distflow.checkpoint.checkpointer, distflow.run.resume)."""

    every: int = knob(0, "Save every N steps; 0: none besides the others below.", operational=True)
    every_s: float = knob(0.0, "Also save when this many seconds passed since the last save (the slowest rank's "
                          "clock); 0: off.", operational=True)
    at_end: bool = knob(True, "Save the final state (needed to continue a run with more steps).", operational=True)
    keep_last: int = knob(2, "Complete checkpoints kept; older ones are deleted.", operational=True)
    resume: str = knob(
        "auto", "auto: continue the newest checkpoint in run.output_dir if the same run wrote it (a different config "
        "stops with what differs; a finished run exits 0), else start fresh; never: start fresh; force: continue the "
        "newest checkpoint whatever changed (e.g. more steps); or a checkpoint folder. A fresh start moves an "
        "earlier run's files to output_dir/previous/<time>/. SIGTERM or SIGUSR1 saves at the next step boundary and "
        "exits 75 (distflow.run.preemption).", operational=True)
    export_at_end: bool = knob(False, "Also write a plain HF folder of the final policy (hf_model/; LoRA: and "
                               "adapter/).", operational=True)

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.every >= 0 and self.every_s >= 0,
                 "checkpoint.every and checkpoint.every_s must be >= 0 (0 = off)")]


@section
class ValidationConfig:
    """Greedy pass@1 (and sampled pass@k) on the task's held-out split (distflow.rollout.evaluation). Not
    operational: validation draws from the engine's sampler, so it is part of what a run computes."""

    every: int = knob(0, "Validate every N steps; 0: never during training.")
    before_train: bool = knob(False, "Validate once before the first step.")
    at_end: bool = knob(False, "Validate after the last step.")
    pass_k: int = knob(0, "Also sample k answers per item and report pass@k; 0: greedy pass@1 only.")

    @property
    def wanted(self) -> bool:
        return bool(self.every or self.before_train or self.at_end)

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.every >= 0 and self.pass_k >= 0, "validation.every and validation.pass_k must be >= 0")]


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
