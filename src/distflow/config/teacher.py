"""The teacher section: the model whose per-token log-probabilities a student learns from in
on-policy distillation (algorithm.advantage=distill)."""

from __future__ import annotations

from distflow.config.fields import knob, section
from distflow.config.model import model_path_checks


@section
class TeacherConfig:
    """The distillation teacher. It exists exactly when algorithm.advantage=distill: a frozen causal LM
    on the policy's tokenizer, built, sharded and run like the KL reference (model.dtype, the logprob
    head settings), scoring every token the student sampled."""

    path: str = knob("", "The teacher's model folder or hub name; it must share model.path's tokenizer (refused at "
                     "start-up when it does not). Empty: no teacher.")
    offload: bool = knob(False, "Keep the teacher's shards in host memory (pinned on CUDA) between its forwards; "
                                "each block is copied in just before use (FSDP2's CPU offload). Slower, and "
                                "off the device's memory estimate but for two gathered blocks.")

    def checks(self) -> list[tuple[bool, str]]:
        return model_path_checks(self.path, "teacher.path") if self.path else []
