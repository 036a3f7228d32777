"""Reward functions: (completion text, reference answer) -> float."""

from distflow.rewards.numeric import extract_answer, numeric_match

__all__ = ["extract_answer", "numeric_match"]
