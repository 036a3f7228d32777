"""Rollout engines behind one small protocol, and the weight stream that keeps them in sync."""

from distflow.rollout.base import RolloutEngine, Sample, build_engine

__all__ = ["RolloutEngine", "Sample", "build_engine"]
