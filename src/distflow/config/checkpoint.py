"""The checkpoint section: when to save, how many to keep, resume, and the HF export."""

from __future__ import annotations

from distflow.config.fields import knob, section


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
