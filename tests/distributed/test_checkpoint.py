"""Checkpoints on real gloo ranks and real DCP files: every scope saved and loaded back, torn
checkpoints skipped, a checkpoint of another format refused, and export to a plain HF folder.
(Bit-exact resume of whole runs: distributed/test_trainer_loop.py and e2e/test_smoke.py.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_helpers import run_distributed
from config_helpers import fp32_config
from distflow.config import ConfigError, config_record
from distflow.run.checkpoint import FORMAT, MARKER, POLICY, Checkpointer, ModelOptimState, latest_checkpoint
from distflow.distributed.layout import ParallelLayout
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


def _save_two(rank, world, model_dir, out):
    cfg = fp32_config()
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    ck = _checkpointer(out, rank, policy, keep_last=5)
    for step in (1, 2, 3):
        ck.registry["shared"][1].value = step
        ck.save(step, config_record(cfg), model_dir)
    # every scope comes back: a fresh registry loads what the last save wrote
    fresh = _checkpointer(out, rank, policy, keep_last=5)
    fresh.registry["per_rank"][1].value = fresh.registry["shared"][1].value = -1
    marker = fresh.load(latest_checkpoint(Path(out) / "checkpoints"))
    assert fresh.registry["per_rank"][1].value == rank and fresh.registry["shared"][1].value == 3
    # the marker certifies the checkpoint: format, step, world size, files, the config, the model
    assert {k: marker[k] for k in ("format", "step", "world_size", "model_path")} == \
        {"format": FORMAT, "step": 3, "world_size": 2, "model_path": model_dir}
    assert marker["config"] == config_record(cfg) and set(marker["state"]) == {"shared"}
    assert sorted(marker["files"]) == sorted(p.name for p in latest_checkpoint(Path(out) / "checkpoints").iterdir()
                                             if p.is_file() and p.name != MARKER)


def test_torn_checkpoints_are_skipped_with_a_warning(tiny_model_dir, tmp_path, caplog):
    run_distributed(_save_two, 2, tiny_model_dir, str(tmp_path))
    root = tmp_path / "checkpoints"
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

    from distflow.run.export import export_checkpoint

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
    from distflow.run.checkpoint import RNGState

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
