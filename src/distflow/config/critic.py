"""The critic section: PPO's value model, its optimizer and warm-up, and value clipping."""

from __future__ import annotations

from typing import Optional

from distflow.config.fields import knob, section
from distflow.config.model import model_path_checks


@section
class CriticConfig:
    """PPO's value model. It exists exactly when the advantage estimator needs values (algorithm.advantage=gae)."""

    path: str = knob("", "The critic's backbone; empty: the policy's model.path (same backbone, a fresh value head).")
    lr: float = knob(1e-5, "AdamW's learning rate for the critic.")
    lr_warmup_steps: int = knob(0, "Linear learning-rate warm-up of the critic's optimizer.")
    warmup_steps: int = knob(
        0, "Steps at the start that train only the critic, so the actor's first advantages come from a value "
        "function that has seen some returns (verl's critic_warmup).")
    value_clip: Optional[float] = knob(
        0.5, "Value clipping: predictions move at most this far from the rollout-time values (null: off).")

    def checks(self) -> list[tuple[bool, str]]:
        """Checked when there is a critic (DistflowConfig.validate asks only then)."""
        return [
            (self.lr > 0 and self.warmup_steps >= 0 and self.lr_warmup_steps >= 0,
             "critic.lr must be > 0 and critic.warmup_steps, critic.lr_warmup_steps >= 0"),
            (self.value_clip is None or self.value_clip > 0,
             f"critic.value_clip must be > 0 (or null), got {self.value_clip}"),
            *(model_path_checks(self.path, "critic.path") if self.path else []),
        ]
