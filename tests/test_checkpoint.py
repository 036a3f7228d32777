"""Checkpoints: bit-exact resume, a SIGKILLed rank under torchrun restarts, torn checkpoints,
a raising rank, and export to a plain HF folder. Real torchrun runs, real DCP files."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import run_distributed
from launch_helpers import ROOT, read_metrics, stable_metrics, torchrun
from distflow.checkpoint import MARKER, POLICY, Checkpointer, ModelOptimState, latest_checkpoint
from distflow.config import ConfigError, DistflowConfig
from distflow.layout import ParallelLayout
from distflow.policy import Policy

BASE = ["experiment=smoke", "task.reward=rewards_for_tests:digit_fraction", "trainer.checkpoint_every=2"]


def _run(out, *extra, **kw):
    proc = torchrun([*BASE, f"trainer.output_dir={out}", *extra], **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(straight, "trainer.steps=4", "trainer.export_at_end=true")
    _run(split, "trainer.steps=2")
    proc = _run(split, "trainer.steps=4", "trainer.export_at_end=true", "trainer.resume=force")  # more steps: asked for
    assert "resumed from step 2" in proc.stdout
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [stable_metrics(r) for r in a[2:]] == [stable_metrics(r) for r in b[2:]]
    wa, wb = load_file(straight / "hf_model" / "model.safetensors"), load_file(split / "hf_model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # keep_last=2: steps 2 and 4 remain, both complete
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # the CLI export of the final checkpoint equals the end-of-run export
    cli = tmp_path / "cli_export"
    subprocess.run([sys.executable, "-m", "distflow.export", str(split / "checkpoints" / "step_000004"), str(cli)],
                   check=True, capture_output=True, cwd=ROOT)
    wc = load_file(cli / "model.safetensors")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (cli / "tokenizer.json").is_file() and (cli / "chat_template.jinja").is_file()


@pytest.mark.slow
def test_killed_rank_is_restarted_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, "rollout=hf", "trainer.steps=4", "trainer.fault_inject=1:3",
                torchrun_args=["--max-restarts=1", "--monitor-interval=1"], timeout=900)
    assert "resumed from step 2" in proc.stdout, proc.stdout[-3000:]
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [1, 2, 3, 4]  # each step exactly once, no gaps


@pytest.mark.slow
def test_raising_rank_fails_the_job_with_its_error(tmp_path):
    proc = torchrun([*BASE, "rollout=hf", f"trainer.output_dir={tmp_path}", "trainer.steps=3",
                     "trainer.fault_inject=1:2:raise", "trainer.collective_timeout_s=60"], timeout=240)
    assert proc.returncode != 0
    assert "distflow: rank 1 failed: RuntimeError: injected fault on rank 1 at step 2" in proc.stderr


class _Counter:
    """A minimal Stateful."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _checkpointer(out, rank, policy, keep_last):
    ck = Checkpointer(out, keep_last=keep_last, rank=rank)
    ck.register(POLICY, ModelOptimState(policy.model, policy.optimizer), "sharded")
    ck.register("per_rank", _Counter(rank), "rank")
    ck.register("shared", _Counter(0), "shared")
    return ck


def _save_two(rank, world, model_dir, out):
    cfg = DistflowConfig()
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    ck = _checkpointer(out, rank, policy, keep_last=5)
    for step in (1, 2, 3):
        ck.registry["shared"][1].value = step
        ck.save(step, meta={"model_path": model_dir})
    # every scope comes back: a fresh registry loads what the last save wrote
    fresh = _checkpointer(out, rank, policy, keep_last=5)
    fresh.registry["per_rank"][1].value = fresh.registry["shared"][1].value = -1
    assert fresh.load(latest_checkpoint(out)) == {"model_path": model_dir}
    assert fresh.registry["per_rank"][1].value == rank and fresh.registry["shared"][1].value == 3


def test_torn_checkpoints_are_skipped_with_a_warning(tiny_model_dir, tmp_path, caplog):
    run_distributed(_save_two, 2, tiny_model_dir, str(tmp_path))
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(str(tmp_path)) == root / "step_000003"
    (root / "step_000003" / MARKER).unlink()  # no completion marker
    shard = next((root / "step_000002").glob("*.distcp"))
    with open(shard, "r+b") as f:  # truncated shard
        f.truncate(shard.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="distflow"):
        assert latest_checkpoint(str(tmp_path)) == root / "step_000001"
    assert "step_000003" in caplog.text and "step_000002" in caplog.text
    # a half-written save (.tmp folder) is ignored too
    shutil.copytree(root / "step_000001", root / "step_000009.tmp")
    assert latest_checkpoint(str(tmp_path)) == root / "step_000001"
    # a checkpoint of the first format (no "format" in its marker) is refused with a message
    marker = root / "step_000001" / MARKER
    old = json.loads(marker.read_text())
    del old["format"]
    marker.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="has format 1, this distflow reads format 2"):
        Checkpointer(str(tmp_path), keep_last=1, rank=0).load(root / "step_000001")


IDS = [[1, 5, 9, 33, 70, 2]]


def _save_perturbed(rank, world, model_dir, ckpt_root, out):
    cfg = DistflowConfig()
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    with torch.no_grad():  # make the live weights differ from the base model
        for p in policy.model.parameters():
            p.to_local().mul_(1.01)
    _checkpointer(ckpt_root, rank, policy, keep_last=1).save(5, meta={"model_path": model_dir})
    with torch.no_grad():
        live = policy.model(input_ids=torch.tensor(IDS)).logits
    if rank == 0:
        torch.save({"logits": live}, out)


def test_export_round_trip_matches_live_policy(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from distflow.export import export_checkpoint

    out = tmp_path / "live.pt"
    run_distributed(_save_perturbed, 2, tiny_model_dir, str(tmp_path / "ck"), str(out))
    # exported without any process group, as the CLI does
    export_checkpoint(str(tmp_path / "ck" / "checkpoints" / "step_000005"), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = exported(input_ids=torch.tensor(IDS)).logits
    live = torch.load(out, weights_only=True)["logits"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=torch.tensor(IDS)).logits
    assert float((live - base).abs().max()) > 1e-3  # the perturbation is visible
    assert float((live - logits).abs().max()) <= 1e-6


def test_cuda_rng_state_is_saved_and_restored_on_cuda_ranks(monkeypatch):
    """On a CUDA rank the device generator rides along (faked here: CPU torch has no CUDA RNG)."""
    from distflow.checkpoint import RNGState

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
