"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), and resume.

Layout: <output_dir>/checkpoints/step_000012/ holding DCP shards (model + optimizer, written
by every rank in parallel), `rank_<r>.json` (that rank's RNG and loader state) and, written
last by rank 0, `COMPLETE` (step, metric history). A checkpoint is written into a `.tmp`
folder and renamed only once complete, so a crash mid-save never leaves a folder that looks
loadable; `latest_checkpoint` also skips (with a warning) any folder without the marker.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distflow.config import ConfigError
from distflow.distributed import barrier

log = logging.getLogger("distflow")

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class ModelOptimState(Stateful):
    """The FSDP2 model and its optimizer as one DCP-stateful object (sharded on save/load)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        optims = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optims)
        return {"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optims = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optims, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=StateDictOptions(strict=True))


def rng_state() -> dict[str, Any]:
    """Every RNG that can affect the run, as JSON-safe data (torch, python, numpy)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state().tolist(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def latest_checkpoint(output_dir: str) -> Path | None:
    """The newest complete checkpoint under output_dir, warning about torn ones."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for path in root.iterdir():
        step = _step_of(path)
        if step is None:
            continue
        if not is_complete(path):
            log.warning("skipping incomplete checkpoint %s (no %s marker or missing files)", path, MARKER)
            continue
        if best is None or step > best[0]:
            best = (step, path)
    return best[1] if best else None


def is_complete(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    # a truncated or missing shard is as bad as a missing marker
    return all((path / name).is_file() and (path / name).stat().st_size == size
               for name, size in info.get("files", {}).items())


class Checkpointer:
    def __init__(self, output_dir: str, keep_last: int, rank: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = max(1, keep_last)
        self.rank = rank

    def save(self, step: int, states: dict[str, Stateful], rank_state: dict, shared_state: dict) -> Path:
        """Collective: every rank calls it. `states` (e.g. {"app": ModelOptimState(...)}) go to DCP;
        `shared_state` (identical on all ranks) goes in the marker."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        dcp.save(states, checkpoint_id=str(tmp))
        (tmp / f"rank_{self.rank}.json").write_text(json.dumps(rank_state))
        barrier()
        if self.rank == 0:
            files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            (tmp / MARKER).write_text(json.dumps({"step": step, "files": files, **shared_state}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        complete = sorted((p for p in self.root.iterdir() if _step_of(p) is not None and is_complete(p)), key=_step_of)
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, states: dict[str, Stateful]) -> tuple[dict, dict]:
        """Collective. Returns (this rank's state, the shared state from the marker)."""
        if not is_complete(path):
            raise ConfigError(f"checkpoint {path} is incomplete (no {MARKER} marker or a truncated file)")
        dcp.load(states, checkpoint_id=str(path))
        rank_file = path / f"rank_{self.rank}.json"
        if not rank_file.is_file():
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise ConfigError(f"checkpoint {path} has no state for rank {self.rank}; was it saved with world size {world}?")
        return json.loads(rank_file.read_text()), json.loads((path / MARKER).read_text())


def resolve_resume(resume: str, output_dir: str) -> Path | None:
    """trainer.resume: 'auto' = latest complete checkpoint in output_dir (or none), 'never', or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(f"trainer.resume={resume!r} is not a complete checkpoint folder")
    return path
