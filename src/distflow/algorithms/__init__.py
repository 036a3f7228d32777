"""Advantage estimators, policy losses and loss aggregation: small pure functions of tensors.

An algorithm is a config choosing among these; the trainer never branches on its name.
"""

from distflow.algorithms.advantages import group_normalized_advantages
from distflow.algorithms.losses import LOSS_AGG_MODES, aggregate_numerator, aggregate_denominator, clipped_surrogate

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_denominator",
    "aggregate_numerator",
    "clipped_surrogate",
    "group_normalized_advantages",
]
