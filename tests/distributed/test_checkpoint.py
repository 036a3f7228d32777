"""Checkpoints on real gloo ranks and real DCP files: every scope saved and loaded back, torn
checkpoints skipped, a checkpoint of another format refused, a save that fails on one rank
stopping every rank, and export to a plain HF folder.
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

class _Counter:
    """A minimal Stateful."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
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
        start = time.monotonic()
        try:
            ck.save(step, config_record(cfg), model_dir)
            failures.append(("saved", 0.0))
        except CheckpointSaveError as e:
            failures.append((str(e), time.monotonic() - start))
        _file_size_limit(resource.RLIM_INFINITY)
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


@pytest.fixture(scope="module")
def saves(tiny_model_dir, tmp_path_factory):
    """Two gloo ranks save steps 1-3, then fail to save steps 4 and 5: (the checkpoints folder as
    they left it, each rank's (error line, seconds) per failed save)."""
    out = tmp_path_factory.mktemp("saves")
    failures = run_distributed(_save_three_then_fail_two, 2, tiny_model_dir, str(out), free_port(), timeout=120)
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
