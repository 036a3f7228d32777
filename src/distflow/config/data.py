"""The data section: how many prompts each rank draws per step, and in what order."""

from __future__ import annotations

from distflow.config.fields import knob, section


@section
class DataConfig:
    prompts_per_rank: int = knob(2, "Prompts each rank draws per step (each gives algorithm.group_size samples).")
    shuffle: bool = knob(True, "Reshuffle the prompts every epoch (distflow.tasks.sampler).")

    def checks(self) -> list[tuple[bool, str]]:
        return [(self.prompts_per_rank >= 1, "data.prompts_per_rank must be >= 1")]
