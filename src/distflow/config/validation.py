"""The validation section: when to run greedy pass@1 (and sampled pass@k) on the held-out split."""

from __future__ import annotations

from distflow.config.fields import knob, section


@section
class ValidationConfig:
    """Greedy pass@1 (and sampled pass@k) on the task's held-out split (distflow.rollout.evaluation). Not
    operational: validation draws from the engine's sampler, so it is part of what a run computes."""

    every: int = knob(0, "Validate every N steps; 0: never during training.")
    before_train: bool = knob(False, "Validate once before the first step.")
    at_end: bool = knob(False, "Validate after the last step.")
    pass_k: int = knob(0, "Also sample k answers per item and report pass@k; 0: greedy pass@1 only.")
    save_samples: bool = knob(
        False, "Write each evaluation's greedy answers (item, prompt, response, reward) to run.output_dir/validation/"
        "<before|stepN|after>.rank<R>.jsonl, each rank its own items (verl's validation_data_dir).",
        operational=True)

    @property
    def wanted(self) -> bool:
        return bool(self.every or self.before_train or self.at_end)

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.every >= 0 and self.pass_k >= 0, "validation.every and validation.pass_k must be >= 0")]
