"""A run's start-up, in the order that matters, before any weights load.

The process group comes first (the engine reuses it), then every "auto" made concrete
(distflow.plan.resolve), the run folder and the resume decision (which may stop the launch
here), the rank's output, the plan's second half (layout, model folder, model-option and memory
checks: distflow.plan), the config record every rank must share, the seeds, and the tokenizer.
What comes out is a `Run`: the plan and what each component needs to build itself.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import torch
from transformers import AutoTokenizer

from distflow.config import DistflowConfig
from distflow.distributed import DistInfo, init_distributed
from distflow.plan import RunPlan, resolve
from distflow.rollout.precision import contract_lines
from distflow.run.hostmem import limit_malloc_retention
from distflow.run.output import note_expected_warnings, save_config, setup_output
from distflow.run.preemption import StopSignal
from distflow.run.resume import ResumePlan, agree_on_plan
from distflow.run.rundir import RunDir

log = logging.getLogger("distflow")


@dataclasses.dataclass(frozen=True)
class Run:
    plan: RunPlan  # every automatic value concrete, the layout, the model folder, its shape and memory
    dist: DistInfo
    run_dir: RunDir
    resume: ResumePlan  # the checkpoint this launch continues, if any
    tokenizer: object
    pad_id: int

    @property
    def cfg(self) -> DistflowConfig:
        return self.plan.cfg

    def record(self) -> dict:
        """The config record: config.json's, the checkpoint marker's, the loggers'."""
        return self.plan.record()

    def note_expected_warnings(self) -> None:
        """Start-up is over: the expected third-party warnings held back so far are counted once."""
        note_expected_warnings(self.run_dir.rank_log(self.dist.rank))


def start_run(cfg: DistflowConfig, stop_signal: StopSignal) -> Run:
    """Everything before the task and the models, on every rank; installs `stop_signal` once the run
    folder is decided."""
    cfg = cfg.validate()
    r = cfg.run
    limit_malloc_retention(r.host_mmap_threshold_kib)  # before any model or engine allocates
    dist = init_distributed(r.backend, r.device, r.collective_timeout_s)
    resolved = resolve(cfg, dist.device, dist.backend)  # dtype, eager mode, shard degree, ... for the device
    run_dir = RunDir(r.output_dir)
    resume = agree_on_plan(resolved.cfg, dist)  # before anything is written or loaded: may stop here
    stop_signal.install()
    setup_output(run_dir.rank_log(dist.rank), dist.rank, cfg.logging.level)
    for note in resume.warnings:
        log.warning(note)
    log.info(f"{dist.world_size} rank(s) on {dist.device.type} ({dist.backend}), {resolved.dtype_note}")
    plan = resolved.plan(dist)  # layout, model folder, its checks: before any weights load
    for line in contract_lines(plan.cfg):
        log.info(line)
    save_config(plan.cfg, run_dir.config, write=dist.is_main, auto=plan.auto)
    random.seed(r.seed)
    np.random.seed(r.seed)
    torch.manual_seed(r.seed)
    tokenizer = AutoTokenizer.from_pretrained(plan.model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Run(plan, dist, run_dir, resume, tokenizer, pad_id)
