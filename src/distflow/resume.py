"""Which run an output folder holds, and what this launch does with it (trainer.resume).

  auto    Continue the newest complete checkpoint if the same run wrote it: its saved config
          equals this one, apart from the keys in OPERATIONAL_KEYS (resources, logging and
          checkpoint cadence, which a requeued or resized job may change). A different run
          stops with one line that says what differs. A run already at trainer.steps says so
          and exits 0 without training. No checkpoint: a fresh start.
  never   A fresh start.
  force   Continue the newest checkpoint whatever differs (the differences are logged), e.g.
          a finished run with trainer.steps raised. No checkpoint: a fresh start.
  <path>  Continue that checkpoint, as force does.

A fresh start in a folder that holds an earlier run's files first moves them to
<output_dir>/previous/<time>/, so two runs never mix in one metrics.jsonl. Rank 0 decides and
moves; the caller broadcasts the plan, so every rank acts (or fails) alike.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from distflow.checkpoint import latest_checkpoint, read_marker, resolve_resume, saved_world_size
from distflow.config import ConfigError, DistflowConfig

# Keys that do not change what a run computes (or only by float rounding): where it runs, how it
# logs, how often it saves. Everything else in the config names the run.
OPERATIONAL_KEYS = frozenset({
    "model.dtype", "model.shard_ranks", "model.trust_remote_code", "model.meta_device_init",
    "model.activation_checkpointing", "model.logprob_chunk_tokens", "model.replica_grad_sync",
    "model.grad_bucket_mib", "model.lora.resync",
    "rollout.engine", "rollout.kv_cache_gib", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
    "rollout.sleep_during_update", "rollout.sync_bucket_mib",
    "rollout.tensor_parallel_size",
    "optim.micro_batch_size", "optim.micro_batch_tokens",
    "task.reward_timeout_s", "task.reward_workers",
    "trainer.output_dir", "trainer.backend", "trainer.device", "trainer.collective_timeout_s",
    "trainer.balance_lengths", "trainer.sync_probe_seqs", "trainer.sync_probe_every", "trainer.progress_bar",
    "trainer.log_level", "trainer.max_nonfinite_steps", "trainer.loggers", "trainer.wandb_project",
    "trainer.plot_at_end", "trainer.checkpoint_every", "trainer.checkpoint_every_s", "trainer.checkpoint_at_end",
    "trainer.keep_last", "trainer.resume", "trainer.export_at_end", "trainer.fault_inject",
    "trainer.host_mmap_threshold_kib", "trainer.straggler_warn_steps",
})
# What a run writes into its output folder (the launchers' own files, e.g. logs/<job>-<node>.log
# and launch.txt, belong to the current launch and stay).
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.json", "training.png", "hf_model",
             "wandb_run_id", "tb")


class RunComplete(Exception):
    """The folder holds this run, already finished: nothing to train (exit 0)."""


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    checkpoint: str | None = None  # None: a fresh start
    saved_world_size: int = 0
    set_aside: str | None = None  # where an earlier run's files went
    warnings: tuple[str, ...] = ()  # for the run's log, once it is set up


def config_record(cfg: DistflowConfig) -> dict[str, Any]:
    """The resolved config as JSON data, as a checkpoint stores it."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


# Sub-sections of the config (nested dataclasses), compared key by key like the sections.
SUBSECTIONS = frozenset({"model.lora"})


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    """{"section.key": value}; a dict-valued key (task.gym_config) stays one value, a
    subsection's keys are listed one by one ("model.lora.rank")."""
    flat = {f"{section}.{key}": value for section, keys in record.items() for key, value in keys.items()}
    for sub in SUBSECTIONS & flat.keys():
        flat.update({f"{sub}.{key}": value for key, value in flat.pop(sub).items()})
    return flat


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: saved -> current' for every key that names the run and differs. A key newer than the
    saved run counts as saved at its default (a run from before the key existed used it)."""
    a = {**_flat(config_record(DistflowConfig())), **_flat(saved)}
    b = _flat(current)
    keys = sorted((a.keys() | b.keys()) - OPERATIONAL_KEYS)
    missing = "(unset)"
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}" for k in keys if a.get(k, missing) != b.get(k, missing)]


def plan_resume(cfg: DistflowConfig, restart: int = 0) -> ResumePlan:
    """Rank 0 only: read the folder and decide (ConfigError / RunComplete when it must stop).
    restart: > 0 for a restarted torchrun attempt or a requeued SLURM job, which continues what
    its launch wrote, also under trainer.resume=never."""
    t = cfg.trainer
    mode = "auto" if t.resume == "never" and restart > 0 else t.resume
    if mode in ("auto", "force"):
        found = latest_checkpoint(t.output_dir)
    elif mode == "never":
        found = None
    else:
        found = resolve_resume(mode, t.output_dir)
    if found is None:
        moved = _set_aside(t.output_dir)
        note = (f"{t.output_dir} held files of an earlier run; they were moved to {moved}",) if moved else ()
        return ResumePlan(set_aside=moved, warnings=note)
    marker = read_marker(found)
    saved = marker.get("meta", {}).get("config")
    diffs = config_differences(saved, config_record(cfg)) if saved is not None else []
    if diffs and mode == "auto":
        raise ConfigError(
            f"{t.output_dir} holds a different run ({'; '.join(diffs)}). Start a new run with "
            f"trainer.resume=never (the earlier one moves to {t.output_dir}/previous/) or another "
            "trainer.output_dir; continue the earlier one with these settings with trainer.resume=force")
    if marker["step"] >= t.steps:
        raise RunComplete(
            f"{found} is already at step {marker['step']} of trainer.steps={t.steps}; nothing to train "
            f"(results: {Path(t.output_dir) / 'summary.json'}). Start a new run with trainer.resume=never, or "
            "continue this one with a higher trainer.steps and trainer.resume=force")
    note = (f"continuing {found} with other settings than it was written with: {'; '.join(diffs)}",) if diffs else ()
    return ResumePlan(str(found), saved_world_size(marker), warnings=note)


def _set_aside(output_dir: str) -> str | None:
    """Move an earlier run's files to <output_dir>/previous/<time>/ (None if there were none)."""
    root = Path(output_dir)
    found = [root / name for name in RUN_FILES if (root / name).exists()]
    found += sorted((root / "logs").glob("rank_*.log")) if (root / "logs").is_dir() else []
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = root / "previous" / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = root / "previous" / f"{stamp}-{n}"
    for path in found:
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(target))
    return str(dest)
