"""The start-up plan: every automatic setting made concrete once, and every check that needs the model
folder, before any weights load.

An "auto" decided where it is used gets decided more than once, possibly differently, and the run's
record keeps the word instead of what ran. So the plan decides each one here, by the rules in
distflow.distributed.devices, and every component built after it reads concrete values (they refuse
"auto": devices.concrete). config.json then records what ran, with what the user wrote beside it
(`record()`, under "auto").

Two halves, so a launcher can put the resume decision between them (it needs the concrete config,
not the model folder):
  resolve(cfg, device)    pure, no I/O: the concrete config, the keys the user left automatic (with
                          what they wrote), the start-up line on the dtype.
  Resolved.plan(dist)     reads the model folder: the parallel layout, the HF config and the model's
                          shape, the model-option checks, the GPU memory estimate.
`plan(cfg, dist)` runs both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from distflow.config import DistflowConfig, config_record
from distflow.distributed import DistInfo, on_local_rank0_first
from distflow.distributed.devices import CpuBf16, choose_backend, compute_dtype, dtype_line, resolve_auto
from distflow.distributed.layout import ParallelLayout
from distflow.errors import ConfigError
from distflow.train.memory_budget import ModelShape, check_memory_budget, model_shape

# Every key that has an automatic setting, spelled as the user writes it; the plan makes each concrete.
AUTOMATIC: dict[str, Any] = {
    "model.dtype": "auto",
    "model.shard_ranks": None,
    "optim.shared_prefix": "auto",
    "rollout.enforce_eager": "auto",
    "rollout.kv_cache_gib": None,  # stays null on CUDA: vLLM sizes the cache from gpu_memory_utilization
    "run.device": "auto",
    "run.backend": "auto",
}


def _value(cfg: DistflowConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The config with every automatic value concrete, and what the user wrote for those."""

    cfg: DistflowConfig
    auto: dict[str, Any]  # key -> the automatic setting the user wrote, for each key made concrete
    dtype_note: str  # the start-up line: which dtype the model computes in, and why

    def record(self) -> dict[str, Any]:
        """What config.json (and the checkpoint marker) store: the concrete config, "auto" beside it."""
        return config_record(self.cfg, self.auto)

    def plan(self, dist: DistInfo, model_path: str | None = None, critic_path: str | None = None) -> "RunPlan":
        """The second half: layout and model folder. `model_path`/`critic_path`: local folders
        (default: model.path and critic.path resolved here, once per node; a collective)."""
        cfg = self.cfg
        layout = ParallelLayout.from_config(cfg.model, dist, cfg.rollout.tensor_parallel_size,
                                            cfg.pipeline.rollout_ranks)
        if model_path is None:
            model_path = _local_folder(cfg.model.path, dist)
        if critic_path is None:
            critic_path = _local_folder(cfg.critic.path, dist) if cfg.critic.path else model_path
        from transformers import AutoConfig

        from distflow.models.folder_check import check_model_folder, check_same_tokenizer
        from distflow.train.policy import check_model_options

        trust = cfg.model.trust_remote_code
        check_model_folder(model_path, "model.path", trust)
        if cfg.has_critic and critic_path != model_path:
            check_model_folder(critic_path, "critic.path", trust, tokenizer=False)
        teacher_path, others, offloaded = None, {}, set()
        if cfg.algorithm.needs_teacher:
            teacher_path = _local_folder(cfg.teacher.path, dist)
            check_model_folder(teacher_path, "teacher.path", trust)
            check_same_tokenizer(model_path, teacher_path, "teacher.path", trust)
            others["distillation teacher"] = model_shape(AutoConfig.from_pretrained(teacher_path,
                                                                                    trust_remote_code=trust), trust)
            if cfg.teacher.offload:
                offloaded.add("distillation teacher")
        scorer_paths = _scoring_models(cfg, dist, others, offloaded)
        model_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
        check_model_options(model_path, cfg.model, model_config)  # before any weights load
        check_context(cfg.rollout, model_config, model_path)
        shape = model_shape(model_config, trust)
        critic_shape = None
        if cfg.has_critic:
            critic_shape = shape if critic_path == model_path else \
                model_shape(AutoConfig.from_pretrained(critic_path, trust_remote_code=trust), trust)
        # CUDA: what each phase needs must fit (None on CPU, or with run.memory_check=false)
        memory = check_memory_budget(cfg, model_path, layout, critic_path, policy_shape=shape,
                                     critic_shape=critic_shape, others=others, offloaded=offloaded)
        return RunPlan(cfg, self.auto, self.dtype_note, layout, model_path, critic_path, model_config, shape,
                       critic_shape, memory, teacher_path, scorer_paths)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything a run decides before any weights load; components build from `cfg` (all concrete)."""

    cfg: DistflowConfig
    auto: dict[str, Any]  # as Resolved.auto
    dtype_note: str
    layout: ParallelLayout
    model_path: str  # a local folder
    critic_path: str  # the critic's backbone folder (model_path unless critic.path is set)
    model_config: Any  # the policy's HF config (transformers.PretrainedConfig), read once
    shape: ModelShape  # the policy's parameter count and sizes
    critic_shape: ModelShape | None  # None without a critic
    memory: dict[str, dict[str, float]] | None  # bytes per rank by item and phase (CUDA, run.memory_check)
    teacher_path: str | None = None  # the distillation teacher's local folder; None without one
    scorer_paths: dict[str, str] = dataclasses.field(default_factory=dict)  # reward models' and judges' folders

    @property
    def dtype(self) -> torch.dtype:
        """The engine's weights and FSDP's compute dtype."""
        return compute_dtype(self.cfg.model.dtype)

    def record(self) -> dict[str, Any]:
        """As Resolved.record: the concrete config, with the keys the user left automatic beside it."""
        return config_record(self.cfg, self.auto)


def resolve(cfg: DistflowConfig, device: torch.device | str, backend: str | None = None,
            cpu: CpuBf16 | None = None) -> Resolved:
    """`cfg` (validated) with every automatic value made concrete for `device`, once. `backend`: the
    process group's (default: what run.backend=auto picks for the device); `cpu`: this machine's
    bf16 report unless given."""
    cfg.validate()
    concrete = resolve_auto(cfg, device, cpu)
    kind = torch.device(device).type
    run = dataclasses.replace(
        concrete.run, device=kind if cfg.run.device == "auto" else cfg.run.device,
        backend=(backend or choose_backend("auto", kind)) if cfg.run.backend == "auto" else cfg.run.backend)
    concrete = dataclasses.replace(concrete, run=run)
    auto = {key: spelled for key, spelled in AUTOMATIC.items()
            if _value(cfg, key) == spelled and _value(concrete, key) != spelled}
    return Resolved(concrete, auto, dtype_line(cfg.model.dtype, device, cpu))


def plan(cfg: DistflowConfig, dist: DistInfo, model_path: str | None = None, critic_path: str | None = None,
         cpu: CpuBf16 | None = None) -> RunPlan:
    """The whole start-up plan for this rank: `resolve`, then `Resolved.plan` (see the module doc)."""
    return resolve(cfg, dist.device, dist.backend, cpu).plan(dist, model_path, critic_path)


def check_context(rollout, model_config, model_path: str) -> None:
    """The longest sequence a run asks for must fit the model's positions: vLLM refuses a longer
    context, and the HF engine and the policy would run past the positions the model was trained on."""
    limit = getattr(model_config, "max_position_embeddings", None)
    need = rollout.max_sequence_tokens()
    if isinstance(limit, int) and need > limit:
        budget = f"rollout.max_new_tokens={rollout.max_new_tokens}" if rollout.max_turns == 1 else \
            f"a response budget of {rollout.response_budget()} tokens over {rollout.max_turns} turns"
        raise ConfigError(f"rollout.max_prompt_tokens={rollout.max_prompt_tokens} and {budget} need sequences of up "
                          f"to {need} tokens, beyond the model's max_position_embeddings={limit} "
                          f"({model_path}/config.json): lower them")


def _scoring_models(cfg: DistflowConfig, dist: DistInfo, shapes: dict, offloaded: set) -> dict[str, str]:
    """Each reward model's and judge's local folder (by its configured path), checked before any
    weights load: the folder, a reward model's head (one label), a judge's yes/no tokens. Their
    shapes join `shapes` (and the names of those offloaded `offloaded`) for the memory estimate."""
    from transformers import AutoConfig, AutoTokenizer

    from distflow.models.folder_check import check_model_folder
    from distflow.train.model_rewards import check_reward_model_config, judge_token_ids

    trust, paths = cfg.model.trust_remote_code, {}
    for kind, specs in (("reward_models", cfg.task.reward_model_specs), ("judges", cfg.task.judge_specs)):
        for i, spec in enumerate(specs):
            where = f"task.{kind}[{i}].path"
            local = paths[spec.path] = _local_folder(spec.path, dist)
            check_model_folder(local, where, trust)
            config = AutoConfig.from_pretrained(local, trust_remote_code=trust)
            if kind == "reward_models":
                check_reward_model_config(config, f"{where} {local}")
            else:
                judge_token_ids(AutoTokenizer.from_pretrained(local, trust_remote_code=trust), spec, f"{where} {local}")
            name = f"{kind[:-1].replace('_', ' ')} {spec.name}"
            shapes[name] = model_shape(config, trust)
            if spec.offload:
                offloaded.add(name)
    return paths


def _local_folder(path: str, dist: DistInfo) -> str:
    from distflow.models import resolve_model_path

    return on_local_rank0_first(lambda: resolve_model_path(path), dist.local_rank)
