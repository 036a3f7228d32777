"""Checkpoints on real gloo ranks and real DCP files: every scope saved and loaded back, torn
checkpoints skipped, a checkpoint of another format refused, a save that fails on one rank (a
write, a state_dict() or the fault hook that raises, an error inside DCP) stopping every rank, and
export to a plain HF folder.
(Bit-exact resume of whole runs: distributed/test_trainer_loop.py and the e2e engine runs.)"""

import datetime
import json
import re
import resource
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import free_port, gathered, run_distributed
from config_helpers import fp32_config
from distflow.config import ConfigError, config_record
from distflow.checkpoint.checkpointer import (
    FORMAT,
    MARKER,
    POLICY,
    Checkpointer,
    ModelOptimState,
    is_complete,
    latest_checkpoint,
)
from distflow.distributed.layout import ParallelLayout
from distflow.errors import CheckpointSaveError
from distflow.train.policy import Policy
from torch.distributed.checkpoint.stateful import Stateful

class _Counter:
    """A minimal Stateful; `broken` makes its state_dict() raise."""

    def __init__(self, value):
        self.value, self.broken = value, False

    def state_dict(self):
        if self.broken:
            raise ValueError(f"the state of rank {self.value} is broken")
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _checkpointer(out, rank, policy, keep_last):
    ck = Checkpointer(Path(out) / "checkpoints", keep_last=keep_last, rank=rank)
    ck.register(POLICY, ModelOptimState(policy.model, policy.optimizer), "sharded")
    ck.register("per_rank", _Counter(rank), "rank")
    ck.register("shared", _Counter(0), "shared")
    return ck


def _file_size_limit(limit: int) -> None:
    """Writes past `limit` bytes into any file fail with EFBIG (SIGXFSZ ignored), as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _save_three_then_fail_two(rank, world, model_dir, out, port):
    # a short collective timeout: a rank left waiting for the other fails the test in seconds
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    cfg = fp32_config()
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    ck = _checkpointer(out, rank, policy, keep_last=3)
    for step in (1, 2, 3):
        ck.registry["shared"][1].value = step
        ck.save(step, config_record(cfg), model_dir)
    # step 4: rank 1 cannot write its shards (inside DCP); step 5: rank 0 cannot write the marker,
    # once every rank has written its shards (rank 1 waits in the save's own collective). A
    # completed save would prune step 1 (keep_last=3).
    failures = []
    for step, who, when in ((4, 1, "shards"), (5, 0, "marker")):
        ck.registry["shared"][1].value = step
        if rank == who and when == "shards":
            _file_size_limit(1024)
        ck.before_marker = (lambda _: _file_size_limit(1024)) if rank == who and when == "marker" else None
        failures.append(_save_timed(ck, step, cfg, model_dir))
        _file_size_limit(resource.RLIM_INFINITY)
    failures += _fail_without_oserror(ck, rank, cfg, model_dir)
    # every scope comes back: a fresh registry loads what the last complete save wrote
    fresh = _checkpointer(out, rank, policy, keep_last=3)
    fresh.registry["per_rank"][1].value = fresh.registry["shared"][1].value = -1
    marker = fresh.load(latest_checkpoint(Path(out) / "checkpoints"))
    assert fresh.registry["per_rank"][1].value == rank and fresh.registry["shared"][1].value == 3
    # the marker certifies the checkpoint: format, step, world size, files, the config, the model
    assert {k: marker[k] for k in ("format", "step", "world_size", "model_path")} == \
        {"format": FORMAT, "step": 3, "world_size": 2, "model_path": model_dir}
    assert marker["config"] == config_record(cfg) and set(marker["state"]) == {"shared"}
    assert sorted(marker["files"]) == sorted(p.name for p in latest_checkpoint(Path(out) / "checkpoints").iterdir()
                                             if p.is_file() and p.name != MARKER)
    return gathered(failures)


class _Unpicklable(Stateful):
    """A sharded state whose object DCP cannot pickle on rank 0: DCP hands every rank the error."""

    def __init__(self, rank):
        self.rank = rank

    def state_dict(self):
        return {f"fn_{self.rank}": (lambda: 0) if self.rank == 0 else 0}  # own keys: DCP keeps one copy of a key

    def load_state_dict(self, state):
        pass


def _save_timed(ck, step, cfg, model_dir) -> tuple[str, float]:
    """("saved", 0.0), or the CheckpointSaveError's line and how long the save took to fail."""
    start = time.monotonic()
    try:
        ck.save(step, config_record(cfg), model_dir)
        return "saved", 0.0
    except CheckpointSaveError as e:
        return str(e), time.monotonic() - start


def _fail_without_oserror(ck, rank, cfg, model_dir) -> list[tuple[str, float]]:
    """Steps 6-8, each failing with something else than an OSError: rank 1's state_dict() raises
    (before DCP runs), rank 1's fault hook raises once its shards are written (raise_saving), and an
    object rank 0 cannot pickle fails inside DCP."""
    from distflow.run.faults import FaultInjector

    failures = []
    for step in (6, 7, 8):
        ck.registry["per_rank"][1].broken = step == 6 and rank == 1
        ck.before_marker = FaultInjector("1:7:raise_saving", rank).before_checkpoint_marker
        if step == 8:
            ck.register("unpicklable", _Unpicklable(rank), "sharded")
        failures.append(_save_timed(ck, step, cfg, model_dir))
    ck.registry.pop("unpicklable")
    ck.registry["per_rank"][1].broken, ck.before_marker = False, None
    return failures


@pytest.fixture(scope="module")
def saves(tiny_model_dir, tmp_path_factory):
    """Two gloo ranks save steps 1-3, then fail to save steps 4 and 5: (the checkpoints folder as
    they left it, each rank's (error line, seconds) per failed save)."""
    out = tmp_path_factory.mktemp("saves")
    failures = run_distributed(_save_three_then_fail_two, 2, tiny_model_dir, str(out), free_port(), timeout=240)
    return out / "checkpoints", failures


def test_a_failed_write_on_one_rank_stops_every_rank_and_keeps_the_checkpoints(saves):
    root, per_rank = saves
    for failures in per_rank:
        for (line, seconds), step, rank in zip(failures, (4, 5), (1, 0)):
            assert re.fullmatch(rf"checkpoint of step {step}: could not write {root}/step_00000{step}.tmp: File too "
                                rf"large on rank {rank} \([0-9.]+ [KMGT]?i?B free there\); the save was removed and "
                                rf"the latest checkpoint is still {root}/step_000003: make room and relaunch to "
                                "resume", line), line
            assert seconds < 10  # learned through the save's collectives, not by waiting out a timeout
    # no .tmp folder is left, nothing was pruned, and the checkpoints before are complete
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    assert all(is_complete(p) for p in root.iterdir()) and latest_checkpoint(root) == root / "step_000003"


def test_a_save_that_raises_on_one_rank_stops_every_rank_with_its_line(saves):
    """Not a write that fails but code that raises, before DCP, after it and inside it: every rank
    raises the same CheckpointSaveError naming the failing rank, within the save (the collective
    timeout is 20 s), and the checkpoints stay as they were (checked above: steps 6-8 left nothing)."""
    root, per_rank = saves
    kept = f"the save was removed and the latest checkpoint is still {root}/step_000003"
    lines = [[line for line, _ in failures[2:]] for failures in per_rank]
    assert lines[0] == lines[1], lines  # the same line on every rank
    six, seven, eight = lines[0]
    assert six == (f"checkpoint of step 6: rank 1 raised ValueError: the state of rank 1 is broken; {kept} (rank 1's "
                   "log has the traceback)")
    assert seven == (f"checkpoint of step 7: rank 1 raised RuntimeError: injected fault on rank 1 while saving step 7; "
                     f"{kept} (rank 1's log has the traceback)")
    # DCP hands the error to both ranks; the line names the rank it happened on
    assert re.fullmatch(rf"checkpoint of step 8: rank 0 raised \w+: .*pickle.*; {re.escape(kept)} \(rank 0's log has "
                        r"the traceback\)", eight), eight
    assert all(seconds < 20 for failures in per_rank for _, seconds in failures[2:])  # not the collective timeout


def test_torn_checkpoints_are_skipped_with_a_warning(saves, tmp_path, caplog):
    root = tmp_path / "checkpoints"
    shutil.copytree(saves[0], root)
    assert latest_checkpoint(root) == root / "step_000003"
    (root / "step_000003" / MARKER).unlink()  # no completion marker
    shard = next((root / "step_000002").glob("*.distcp"))
    with open(shard, "r+b") as f:  # truncated shard
        f.truncate(shard.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="distflow"):
        assert latest_checkpoint(root) == root / "step_000001"
    assert "step_000003" in caplog.text and "step_000002" in caplog.text
    # a half-written save (.tmp folder) is ignored too
    shutil.copytree(root / "step_000001", root / "step_000009.tmp")
    assert latest_checkpoint(root) == root / "step_000001"
    # a checkpoint of an earlier format is refused with a message that says what to do: the first
    # (no "format" in its marker) and the second (the config before its sections, the metric history)
    marker = root / "step_000001" / MARKER
    current = json.loads(marker.read_text())
    for fmt, old in ((1, {k: v for k, v in current.items() if k != "format"}), (2, {**current, "format": 2})):
        marker.write_text(json.dumps(old))
        with pytest.raises(ConfigError, match=f"has format {fmt}, this distflow reads format {FORMAT}; resume it with "
                                              "the distflow that wrote it, or start fresh with checkpoint.resume=never"):
            Checkpointer(root, keep_last=1, rank=0).load(root / "step_000001")


IDS = [[1, 5, 9, 33, 70, 2]]


def _save_perturbed(rank, world, model_dir, ckpt_root):
    cfg = fp32_config()
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    with torch.no_grad():  # make the live weights differ from the base model
        for p in policy.model.parameters():
            p.to_local().mul_(1.01)
    _checkpointer(ckpt_root, rank, policy, keep_last=1).save(5, config_record(cfg), model_dir)
    with torch.no_grad():
        return policy.model(input_ids=torch.tensor(IDS)).logits


def test_export_round_trip_matches_live_policy(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from distflow.checkpoint.export import export_checkpoint

    live = run_distributed(_save_perturbed, 2, tiny_model_dir, str(tmp_path / "ck"))
    # exported without any process group, as the CLI does
    export_checkpoint(str(tmp_path / "ck" / "checkpoints" / "step_000005"), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = exported(input_ids=torch.tensor(IDS)).logits
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=torch.tensor(IDS)).logits
    assert float((live - base).abs().max()) > 1e-3  # the perturbation is visible
    assert float((live - logits).abs().max()) <= 1e-6


def test_cuda_rng_state_is_saved_and_restored_on_cuda_ranks(monkeypatch):
    """On a CUDA rank the device generator rides along (faked here: CPU torch has no CUDA RNG)."""
    from distflow.checkpoint.checkpointer import RNGState

    device_state = {"cuda:1": torch.arange(16, dtype=torch.uint8)}
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: device_state[str(device)].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((str(device), state)))
    state = json.loads(json.dumps(RNGState("cuda:1").state_dict()))  # what rank_<r>.json holds
    assert state["cuda"] == list(range(16))
    RNGState("cuda:1").load_state_dict(state)
    assert [(d, s.tolist()) for d, s in restored] == [("cuda:1", list(range(16)))]
    # a CPU rank neither writes nor restores one; a CPU checkpoint restores no CUDA state
    assert "cuda" not in RNGState("cpu").state_dict()
    RNGState("cpu").load_state_dict(state)
    RNGState("cuda:1").load_state_dict({k: v for k, v in state.items() if k != "cuda"})
    assert len(restored) == 1
