"""The rollout side: engines behind one small protocol (vLLM, transformers generate, tensor-parallel
groups), single-turn and multi-turn rollouts, cross-rank balancing of groups, scoring, and held-out
evaluation. Its face is one component, `Rollout` (collect, evaluate, load weights, sleep), which
a rank can run without distflow.train: rollout/ never imports it."""

from distflow.rollout.base import RolloutEngine
from distflow.rollout.engines import build_engine
from distflow.rollout.collect import Rollout
from distflow.rollout.evaluation import Validator

__all__ = ["Rollout", "RolloutEngine", "Validator", "build_engine"]
