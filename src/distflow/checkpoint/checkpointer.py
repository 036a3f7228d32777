"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP), and resume.

Everything a run must restore is registered once with the `Checkpointer`, as a DCP `Stateful`
(an object with state_dict/load_state_dict) in one of three scopes:

  sharded   DCP shards, written by every rank in parallel (each model with its optimizer)
  rank      this rank's own state, in `rank_<r>.json` (RNG streams, the data sampler)
  shared    the same on every rank, in the `COMPLETE` marker rank 0 writes last (LR schedules,
            the trainer's counters)

Save and load loop over the registry; nothing else names what a checkpoint holds. Layout:
<output_dir>/checkpoints/step_000012/. A checkpoint is written into a `.tmp` folder and renamed
only once complete, so a crash mid-save never leaves a folder that looks loadable;
`latest_checkpoint` also skips (with a warning) any folder without the marker. The marker
certifies the checkpoint: its FORMAT, step, world size, the size of every file, the run's config
record and the model it trains (the metric history stays in metrics.jsonl). A checkpoint of
another format is refused with a message that says so.

A checkpoint written by N ranks loads on M: DCP reshards the sharded states, and a rank that
did not exist gets rank 0's rank-scoped state, or what the object's `state_for_new_rank`
derives from it (RNGState derives fresh streams from the run seed, the step and the rank).

A checkpoint is data: DCP's files are read through distflow.checkpoint.reader, which runs
no code from them, and a marker that is not the JSON a save writes is a torn checkpoint. A save
that fails on any rank (a full disk, a file over its size limit, a state_dict() that raises) fails
on every rank at the same point with one line, a CheckpointSaveError, and leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distflow.config import ConfigError
from distflow.distributed import agree_failure, one_line, rank_and_world, role_group
from distflow.checkpoint.reader import is_count, is_plain_name, load_checkpoint
from distflow.errors import CheckpointSaveError, free_space
from distflow.seeds import derive_seed

log = logging.getLogger("distflow")

MARKER = "COMPLETE"
FORMAT = 4  # 1: the first layout (policy under "app"); 2: the registry; 3: sectioned config, no history;
# 4: samples seeded by their prompt's stream position (a format-3 run would continue with other samples)
SCOPES = ("sharded", "rank", "shared")
POLICY = "policy"  # the policy's name in the registry: DCP keys start with it (distflow.checkpoint.export reads them)
_STEP_DIR = re.compile(r"^step_(\d+)$")


class ModelOptimState(Stateful):
    """An FSDP2 model and its optimizer (None for a frozen model) as one sharded DCP state.
    trainable_only: the model's frozen parameters are left out (a LoRA policy's base, which
    model.path already holds): the checkpoint is the adapters and their optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False):
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(strict=not trainable_only)
        # every name of a frozen parameter, a tied weight's second one (lm_head.weight) included,
        # which torch's own ignore_frozen_params would keep
        self.frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad} \
            if trainable_only else set()

    def state_dict(self) -> dict[str, Any]:
        optims = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optims, options=self.options)
        model_sd = {k: v for k, v in model_sd.items() if k not in self.frozen}
        return {"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # DCP loads into the shape state_dict() gave, so every key it names was in the checkpoint
        optims = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optims, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=self.options)


class RNGState(Stateful):
    """Every RNG that can affect the run (torch's CPU generator and, on CUDA, the rank's device
    generator; python; numpy), as JSON-safe data. A checkpoint written on CPU restores no CUDA
    state; one written on CUDA restores it only on a CUDA rank."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device, self.seed = torch.device(device), seed

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return _rng_json(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), self.device)
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))

    def state_for_new_rank(self, rank0_state: dict[str, Any], rank: int, step: int) -> dict[str, Any]:
        """Streams for a rank the saving run did not have: seeded from (run seed, step, rank), so
        a resized resume is reproducible. Another rank's streams are never copied (two ranks
        would draw the same numbers)."""
        derived = derive_seed(self.seed, "rng", step, rank)
        cuda = torch.Generator(self.device).manual_seed(derived).get_state() if self.device.type == "cuda" else None
        return _rng_json(torch.Generator().manual_seed(derived).get_state(), random.Random(derived).getstate(),
                         np.random.RandomState(derived % 2**32).get_state(), cuda)


def _rng_json(torch_state: torch.Tensor, python_state: tuple, numpy_state: tuple,
              cuda_state: torch.Tensor | None) -> dict[str, Any]:
    """RNG states as the JSON data rank_<r>.json holds."""
    name, keys, pos, has_gauss, cached = numpy_state
    state = {"torch": torch_state.tolist(), "python": [python_state[0], list(python_state[1]), python_state[2]],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if cuda_state is not None:
        state["cuda"] = cuda_state.tolist()
    return state


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def latest_checkpoint(root: Path, skipped: list[tuple[Path, int, str]] | None = None) -> Path | None:
    """The newest complete checkpoint in the checkpoints folder `root`. Every torn one newer than it
    is logged, or, when the caller reports them itself, appended to `skipped` as (folder, step, its
    defect), newest first (the resume decision runs before the rank's log exists)."""
    if not root.is_dir():
        return None
    steps = sorted(((step, path) for path in root.iterdir() if (step := _step_of(path)) is not None), reverse=True)
    for step, path in steps:
        defect = checkpoint_defect(path)
        if defect is None:
            return path
        if skipped is None:
            log.warning("skipping incomplete checkpoint %s: %s", path, defect)
        else:
            skipped.append((path, step, defect))
    return None


def is_complete(path: Path) -> bool:
    """A well-formed marker, and every file it lists at the size it lists (a truncated or missing
    shard is as bad as a missing marker)."""
    return checkpoint_defect(path) is None


def checkpoint_defect(path: Path) -> str | None:
    """Why the folder is not a complete checkpoint (the first defect found), or None."""
    if not (path / MARKER).is_file():
        return f"it has no {MARKER} marker (its save did not finish)"
    marker = _marker(path)
    if marker is None:
        return f"its {MARKER} marker is not a checkpoint marker (torn or not distflow's)"
    for name, size in marker["files"].items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if (found := file.stat().st_size) != size:
            return f"{file} is {found} bytes, the marker says {size}"
    return None


def _marker(path: Path) -> dict | None:
    """The folder's marker if it is what a save writes: a JSON object with an int `step`, an int
    `format` (none: format 1), `files` mapping the folder's plain file names to sizes, and, in this
    format, what `load` reads; else None (torn, or not distflow's)."""
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError, RecursionError):  # ValueError: not JSON, not UTF-8, a 5000-digit number
        return None
    if not isinstance(info, dict) or not is_count(info.get("step")) or not is_count(info.get("format", 1)):
        return None
    files = info.get("files")
    if not isinstance(files, dict) or not files or not all(
            is_plain_name(name) and is_count(size) for name, size in files.items()):
        return None
    if info.get("format", 1) == FORMAT and not (
            is_count(info.get("world_size")) and info["world_size"] >= 1 and isinstance(info.get("config"), dict)
            and isinstance(info.get("model_path"), str) and isinstance(info.get("state"), dict)):
        return None
    return info


def _attempt(phase: Callable[[], None]) -> BaseException | None:
    """Run one phase of a save; the error it met (an OSError, or what a Stateful or DCP raised), else None."""
    try:
        phase()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns it (Checkpointer._agree)
        if not isinstance(e, OSError):
            log.debug("a checkpoint save failed on this rank", exc_info=True)
        return e
    return None


def _save_failure(error: BaseException, rank: int, tmp: Path, root: Path) -> tuple[str, str]:
    """(what failed on which rank, what to do). DCP hands every rank a CheckpointException (a
    BaseException) holding each failing rank's error and traceback: the lowest rank's OSError is
    named, else the lowest rank's error."""
    if isinstance(error, CheckpointException):
        failures = sorted((r, err) for r, (err, _) in error.failures.items())
        rank, error = next(((r, err) for r, err in failures if isinstance(err, OSError)), failures[0])
    if isinstance(error, OSError):
        what = os.strerror(error.errno) if error.errno else "write failed"
        return f"could not write {tmp}: {what} on rank {rank} ({free_space(root)} free there)", \
            ": make room and relaunch to resume"
    return f"rank {rank} raised {type(error).__name__}: {one_line(error)}", f" (rank {rank}'s log has the traceback)"


class Checkpointer:
    def __init__(self, root: Path, keep_last: int, rank: int):
        self.root = Path(root)
        self.keep_last = max(1, keep_last)
        self.rank = rank
        self.registry: dict[str, tuple[str, Stateful]] = {}
        self.before_marker: Callable[[int], None] | None = None  # observers' hook (test-only fault injection)

    def register(self, name: str, state: Stateful, scope: str) -> None:
        """Add `state` to every later save and load, under `name`."""
        if scope not in SCOPES:
            raise ValueError(f"unknown checkpoint scope {scope!r}; choose from {SCOPES}")
        if name in self.registry:
            raise ValueError(f"checkpoint state {name!r} is registered twice")
        self.registry[name] = (scope, state)

    def register_model(self, name: str, model, optimizer, scheduler, trainable_only: bool = False) -> None:
        """A trained model: its shards with their optimizer state under `name` (trainable_only: a LoRA
        policy's adapters alone, model.path holds the base), its LR schedule under `<name>_schedule`."""
        self.register(name, ModelOptimState(model, optimizer, trainable_only=trainable_only), "sharded")
        self.register(f"{name}_schedule", scheduler, "shared")

    def register_rng(self, device: torch.device, seed: int) -> None:
        """Every RNG of this rank (RNGState), under "rng"."""
        self.register("rng", RNGState(device, seed), "rank")

    def _scope(self, scope: str) -> dict[str, Stateful]:
        return {name: state for name, (s, state) in self.registry.items() if s == scope}

    def save(self, step: int, config: dict, model_path: str) -> Path:
        """Collective: every rank calls it. `config` (the run's config record) and `model_path` (the
        resolved base model, which export loads) go in the marker, identical on every rank.

        Each phase is checked by the agreement that follows it (distflow.distributed.agreement): an
        error on any rank, an OSError (ENOSPC, EFBIG) or any other (a state_dict() that raises), is a
        CheckpointSaveError on every rank there, with the same line; the `.tmp` folder is removed and
        nothing is pruned. Every state_dict() runs in the first phase, before DCP's own collectives,
        so a rank that fails there never leaves the others inside DCP."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        states: dict[str, dict[str, Any]] = {}

        def prepare() -> None:
            if self.rank == 0:
                for torn in self.root.glob("step_*.tmp"):  # saves cut short earlier (no save runs beside this one)
                    shutil.rmtree(torn, ignore_errors=True)
                tmp.mkdir(parents=True)
            for scope in SCOPES:
                states[scope] = {name: s.state_dict() for name, s in self._scope(scope).items()}

        def write_shards() -> None:
            if states["sharded"]:
                dcp.save(states["sharded"], checkpoint_id=str(tmp), process_group=role_group())
            (tmp / f"rank_{self.rank}.json").write_text(json.dumps(states["rank"]))

        def ready() -> None:  # every rank's shards are written; nothing makes them a checkpoint yet
            if self.before_marker is not None:
                self.before_marker(step)

        def finish() -> None:
            if self.rank != 0:
                return
            files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "step": step, "world_size": rank_and_world()[1],
                                                  "files": files, "config": config, "model_path": model_path,
                                                  "state": states["shared"]}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()  # only once this save is complete

        for phase in (prepare, write_shards, ready, finish):
            error = _attempt(phase)
            self._agree(None if error is None else _save_failure(error, self.rank, tmp, self.root), step, tmp)
        return final

    def _agree(self, failure: tuple[str, str] | None, step: int, tmp: Path) -> None:
        """Collective (the barrier between a save's phases): every rank learns whether any rank
        failed; if one did, rank 0 removes `tmp` and every rank raises the same line."""
        found = agree_failure(failure)
        if found is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _, (what, then) = found
        previous = latest_checkpoint(self.root)
        raise CheckpointSaveError(f"checkpoint of step {step}: {what}; the save was removed and the latest checkpoint "
                                  f"is still {previous or 'none'}{then}")

    def _prune(self) -> None:
        try:
            complete = sorted((p for p in self.root.iterdir() if _step_of(p) is not None and is_complete(p)),
                              key=_step_of)
        except OSError as e:  # the save itself is complete; pruning is retried after the next one
            log.warning("could not list %s to prune old checkpoints: %s", self.root, e)
            return
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path) -> dict:
        """Collective: restore every registered state from `path`; returns its marker."""
        marker = read_marker(path)
        rank_file = path / f"rank_{self.rank}.json"
        new_rank = not rank_file.is_file()
        if new_rank and not (path / "rank_0.json").is_file():
            raise ConfigError(f"checkpoint {path} holds no per-rank state (no rank_0.json)")
        rank_state = json.loads((path / "rank_0.json" if new_rank else rank_file).read_text())
        missing = [n for n in self._scope("shared") if n not in marker["state"]]
        missing += [n for n in self._scope("rank") if n not in rank_state]
        if missing:
            raise ConfigError(f"checkpoint {path} holds no state for {', '.join(missing)} (a run with another "
                              "algorithm or model setup wrote it)")
        sharded = self._scope("sharded")
        if sharded:
            load_checkpoint(sharded, path)  # reshards to this world size; runs no code from the files
        resized = marker.get("world_size") != rank_and_world()[1]
        for name, state in self._scope("rank").items():
            try:
                if resized and hasattr(state, "load_pooled"):  # every saving rank's share, dealt anew
                    state.load_pooled([json.loads(f.read_text())[name] for f in sorted(path.glob("rank_*.json"))])
                    continue
                saved = rank_state[name]
                if new_rank and hasattr(state, "state_for_new_rank"):
                    saved = state.state_for_new_rank(saved, self.rank, marker["step"])
                state.load_state_dict(saved)
            except ConfigError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"checkpoint {path} is incomplete: its {name} state is malformed "
                                  f"({type(e).__name__}: {e})") from None
        for name, state in self._scope("shared").items():
            state.load_state_dict(marker["state"][name])
        return marker


def read_marker(path: Path) -> dict:
    """The marker of a complete checkpoint of this format; ConfigError otherwise."""
    if (defect := checkpoint_defect(path)) is not None:
        raise ConfigError(f"checkpoint {path} is incomplete: {defect}")
    marker = _marker(path)
    if marker.get("format", 1) != FORMAT:
        raise ConfigError(f"checkpoint {path} has format {marker.get('format', 1)}, this distflow reads format "
                          f"{FORMAT}; resume it with the distflow that wrote it, or start fresh with "
                          "checkpoint.resume=never (or another run.output_dir)")
    return marker
