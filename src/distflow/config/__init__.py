"""The one description of a run: typed sections, each field with its doc and whether it is
operational (may change on resume), choices as Literal, one validation pass before anything
loads, one config record, old key spellings, and resolving user-named callables.

Each section's dataclass lives in the module named after it (config.model, config.optim, ...,
config.logging); fields.py declares and walks them, schema.py puts them together.

docs/configuration.md is generated from here (`python -m distflow config-docs`).
"""

from distflow.config.agent import AgentConfig
from distflow.config.algorithm import CRITIC_ESTIMATORS, AlgorithmConfig
from distflow.config.aliases import rename_overrides
from distflow.config.checkpoint import CheckpointConfig
from distflow.config.critic import CriticConfig
from distflow.config.data import DataConfig
from distflow.config.fields import ConfigError, hydra_schema
from distflow.config.logging import LoggingConfig
from distflow.config.model import BUILTIN_MODELS, MAX_ENGINE_LORA_RANK, LoraConfig, ModelConfig
from distflow.config.optim import OptimConfig
from distflow.config.pipeline import PipelineConfig
from distflow.config.rollout import RolloutConfig
from distflow.config.rollout_correction import RolloutCorrectionConfig
from distflow.config.run import RunConfig
from distflow.config.schema import OPERATIONAL, DistflowConfig, config_differences, config_record
from distflow.config.task import TaskConfig
from distflow.config.teacher import TeacherConfig
from distflow.config.validation import ValidationConfig

__all__ = [
    "BUILTIN_MODELS", "CRITIC_ESTIMATORS", "MAX_ENGINE_LORA_RANK", "OPERATIONAL", "AgentConfig", "AlgorithmConfig", "CheckpointConfig",
    "ConfigError", "CriticConfig", "DataConfig", "DistflowConfig", "LoggingConfig", "LoraConfig", "ModelConfig",
    "OptimConfig", "PipelineConfig", "RolloutConfig", "RolloutCorrectionConfig", "RunConfig", "TaskConfig", "TeacherConfig", "ValidationConfig", "config_differences",
    "config_record", "hydra_schema", "rename_overrides",
]
