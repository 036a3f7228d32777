"""The run section, in torchtitan's manner: the run itself (length, seed, folder, where it
executes, its probes and guards)."""

from __future__ import annotations

import re
from typing import Literal

from distflow.config.fields import knob, section

# run.fault_inject's modes (distflow.run.faults), besides sleep=S
FAULT_MODES = ("kill", "raise", "nan", "kill_saving", "raise_saving", "raise_report", "stale_resync")
_FAULT_SPEC = re.compile(rf"\d+:\d+\+?(:({'|'.join(FAULT_MODES)}|sleep=\d+(\.\d+)?))?")


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
        "", "Test-only: RANK:STEP[:kill|raise|nan|kill_saving|raise_saving|raise_report|sleep=S|stale_resync] fails "
        "that rank during that step (STEP+: that step and every later one; kill, the default, and raise fail it before "
        "its update; nan makes its loss NaN; sleep=S delays it S seconds before its update; kill_saving kills it and "
        "raise_saving raises in the middle of that step's checkpoint write; raise_report raises as that step's metrics "
        "are written; stale_resync leaves a tensor out of its resync).", operational=True)

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
            (not self.fault_inject or _FAULT_SPEC.fullmatch(self.fault_inject) is not None,
             f"run.fault_inject must be RANK:STEP[+][:MODE], MODE one of {', '.join(FAULT_MODES)} or sleep=S; "
             f"got '{self.fault_inject}'"),
        ]
