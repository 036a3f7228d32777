"""The rollout-correction section: how the policy loss treats tokens the engine sampled from a
distribution mu that differs from the proximal policy pi_old (numerics: bf16 kernels; staleness:
carried-over tokens). The names are verl's `algorithm.rollout_correction` keys, so a verl
config reads the same here; the equations and where distflow differs are in
docs/algorithms.md, the functions in distflow.algorithms.rollout_correction. The presets are
the recipe group `rollout_correction` (recipes/rollout_correction/*.yaml).

With everything off (the default) nothing changes the loss and the rollout_corr/* metrics are
still reported every step.
"""

from __future__ import annotations

from typing import Literal, Optional

from distflow.config.fields import knob, section

ImportanceLevel = Literal["token", "sequence"]
RejectionLevel = Literal["token", "sequence", "geometric", "k3"]


@section
class RolloutCorrectionConfig:
    bypass_mode: bool = knob(
        False, "false (decoupled): the proximal policy pi_old is the trainer's own logprobs at the weights that "
        "sampled (recomputed, or the update's first forward when one optimizer step follows each rollout), and "
        "rho = pi_old / mu. true (bypass): pi_old := mu, the engine's logprobs, with no recomputation even with "
        "several optimizer steps per batch; the PPO ratio pi / mu then carries the correction, and the rejection "
        "masks use rho = sg(pi) / mu.")
    rollout_is: Optional[ImportanceLevel] = knob(
        None, "Truncated importance weights multiplying the policy loss, detached. token: min(rho_t, "
        "rollout_is_threshold) per token (Yao et al. 2025, TIS); sequence: min(prod_t rho_t, threshold) for every "
        "token of the sequence. null: no weights. Refused with bypass_mode (the ratio already is the weight).")
    rollout_is_threshold: float = knob(2.0, "The importance weights' truncation cap C.")
    rollout_is_batch_normalize: bool = knob(
        False, "Divide the truncated weights by their mean over the whole step's batch (all ranks: over trained "
        "tokens for token weights, over sequences for sequence weights), so they average 1. Needs the old-logprob "
        "pass before the update, which it then runs even with one optimizer step per rollout.")
    rollout_rs: Optional[RejectionLevel] = knob(
        None, "Rejection: masked tokens or sequences contribute nothing to the loss. token: rho_t outside [lower, "
        "upper] (IcePop: [0.5, 5]); sequence: prod_t rho_t outside the band (masked IS, TRL's default with [0, 3]); "
        "geometric: exp(mean_t log rho_t) outside the band (Geo-RS, e.g. [0.999, 1.001]); k3: mean_t (rho_t - "
        "log rho_t - 1) above rollout_rs_threshold (verl's seq_mean_k3). A rejected token keeps its place in the "
        "loss's denominator, as in TRL (verl removes it): the step's normaliser is fixed before the update.")
    rollout_rs_threshold: Optional[float] = knob(
        None, "The band's upper bound (k3: the threshold tau); null: rollout_is_threshold, as verl.")
    rollout_rs_threshold_lower: Optional[float] = knob(
        None, "The band's lower bound; null: 1 / upper, as verl. Unused by k3.")
    rollout_token_veto_threshold: Optional[float] = knob(
        None, "Reject a whole sequence when any of its tokens has rho_t below this (e.g. 1e-4), on the ratio before "
        "any clamp; null: off.")

    @property
    def active(self) -> bool:
        """True when the correction changes the loss (weights, masks or the proximal policy)."""
        return (self.bypass_mode or self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    @property
    def weights_or_masks(self) -> bool:
        """True when older tokens are weighted or masked (what carried-over tokens need)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def band(self) -> tuple[float, float]:
        """The rejection band [lower, upper] (k3: [0, tau])."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        if self.rollout_rs == "k3":
            return 0.0, upper
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper

    def checks(self) -> list[tuple[bool, str]]:
        p = "algorithm.rollout_correction"
        out = [
            (self.rollout_is_threshold > 0, f"{p}.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}"),
            (not (self.bypass_mode and self.rollout_is is not None),
             f"{p}.rollout_is={self.rollout_is} with bypass_mode=true: in bypass mode the PPO ratio pi / mu already is "
             "the importance weight; set rollout_is=null or bypass_mode=false"),
            (not self.rollout_is_batch_normalize or self.rollout_is is not None,
             f"{p}.rollout_is_batch_normalize needs rollout_is (token or sequence)"),
            (self.rollout_token_veto_threshold is None or 0 < self.rollout_token_veto_threshold < 1,
             f"{p}.rollout_token_veto_threshold must be in (0, 1) (or null), got {self.rollout_token_veto_threshold}"),
        ]
        if self.rollout_rs is not None:
            lower, upper = self.band()
            out.append((0 <= lower < upper, f"{p}: the rejection band must satisfy 0 <= lower < upper, got "
                                            f"[{lower}, {upper}] (rollout_rs_threshold_lower, rollout_rs_threshold)"))
        return out
