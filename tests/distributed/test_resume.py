"""Resume: on another number of ranks (DCP reshards, the sampler's stream continues, new ranks
get derived RNG streams, carried groups are pooled and dealt by position), and the rules that decide whether a launch continues the run in its
output folder (distflow.run.resume). Real gloo ranks, real FSDP2 models, real DCP files."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from dist_helpers import run_distributed
from config_helpers import fp32_config
from distflow.config import ConfigError, config_record
from distflow.checkpoint.checkpointer import FORMAT, POLICY, Checkpointer, ModelOptimState, RNGState, latest_checkpoint, \
    read_marker
from distflow.rollout.carry import CarriedGroup, CarryBuffer
from distflow.sample import Sample
from distflow.tasks.sampler import ShardedSampler
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.errors import RunComplete
from distflow.run.resume import plan_resume
from distflow.run.rundir import RunDir
from distflow.seeds import derive_seed

IDS = torch.tensor([[1, 5, 9, 33, 70, 2], [4, 8, 15, 16, 23, 42]])
SEED, STEP = 7, 3


def _policy(model_dir, shard_ranks):
    cfg = fp32_config()
    cfg.model.shard_ranks = shard_ranks
    return Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))


def _full_state(policy) -> dict:
    """Model and optimizer state as full tensors (gathered on every rank)."""
    model, optim = get_state_dict(policy.model, [policy.optimizer], options=StateDictOptions(full_state_dict=True))
    return {"model": model, "optim": optim}


def _checkpointer(root, rank, policy, sampler, carry):
    ck = Checkpointer(Path(root) / "checkpoints", keep_last=2, rank=rank)
    ck.register(POLICY, ModelOptimState(policy.model, policy.optimizer), "sharded")
    ck.register("sampler", sampler, "rank")
    ck.register("rng", RNGState("cpu", SEED), "rank")
    ck.register("carry", carry, "rank")
    return ck


def _carried(rank: int, world: int) -> CarryBuffer:
    """A carry-over rank's buffer: groups at the positions the sampler dealt it (p mod W = rank)."""
    buffer = CarryBuffer(rank, world)
    buffer.groups = [CarriedGroup(p, 2, 1, [Sample([1, p], [3, 4], [-0.5, -0.25], True, versions=[1, 2])])
                     for p in range(rank, 12, world)]
    return buffer


def _train_and_save(rank, world, model_dir, root, shard_ranks):
    policy = _policy(model_dir, shard_ranks)
    loss = policy.model(input_ids=IDS[rank % 2:rank % 2 + 1]).logits.float().pow(2).mean()
    loss.backward()
    policy.optimizer.step()  # Adam moments exist and differ from zero
    sampler = ShardedSampler(50, rank, world, seed=SEED)
    sampler.next_indices(2)
    torch.manual_seed(100 + rank)
    _checkpointer(root, rank, policy, sampler, _carried(rank, world)).save(STEP, config_record(fp32_config()), model_dir)
    return _full_state(policy)


def _load_and_compare(rank, world, model_dir, root, shard_ranks, saved, saved_world):
    policy = _policy(model_dir, shard_ranks)
    sampler = ShardedSampler(50, rank, world, seed=SEED)
    carry = CarryBuffer(rank, world)
    _checkpointer(root, rank, policy, sampler, carry).load(latest_checkpoint(Path(root) / "checkpoints"))
    # every rank's carried groups pooled and dealt by position: each kept once, none copied from rank 0
    assert [g.to_data() for g in carry.groups] == [g.to_data() for g in _carried(rank, world).groups]
    now = _full_state(policy)
    assert saved["model"].keys() == now["model"].keys()
    assert all(torch.equal(saved["model"][k], now["model"][k]) for k in saved["model"])
    s_opt, n_opt = saved["optim"]["state"], now["optim"]["state"]
    assert s_opt.keys() == n_opt.keys() and len(s_opt) > 0
    for fqn in s_opt:
        for key, value in s_opt[fqn].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(n_opt[fqn][key])), (fqn, key)
    assert sampler.state_dict()["offset"] == 2 * saved_world  # the global stream continues
    drawn = torch.rand(3)
    if rank >= saved_world:  # a rank the saving run did not have: streams from (seed, step, rank)
        torch.manual_seed(derive_seed(SEED, "rng", STEP, rank))
        assert torch.equal(drawn, torch.rand(3))
    else:  # its own saved streams
        torch.manual_seed(100 + rank)
        assert torch.equal(drawn, torch.rand(3))


@pytest.mark.parametrize("saved_world,world,shard_ranks", [(2, 1, -1), (1, 2, -1), (2, 1, 1)])
def test_resume_on_another_world_size_restores_model_optimizer_and_streams(
        tiny_model_dir, tmp_path, saved_world, world, shard_ranks):
    root = str(tmp_path / "run")
    saved = run_distributed(_train_and_save, saved_world, tiny_model_dir, root, shard_ranks)
    assert read_marker(latest_checkpoint(tmp_path / "run" / "checkpoints"))["world_size"] == saved_world
    run_distributed(_load_and_compare, world, tiny_model_dir, root, shard_ranks, saved, saved_world)


# ----------------------------------------------------------------------------- which run is this
SECTION = {"steps": "run", "seed": "run", "resume": "checkpoint", "every_s": "checkpoint", "level": "logging"}


def _cfg(out, **keys):
    cfg = fp32_config()
    cfg.task.path, cfg.run.output_dir = "data.jsonl", str(out)
    for key, value in keys.items():
        setattr(getattr(cfg, SECTION[key]), key, value)
    return cfg


def _fake_checkpoint(out, step, cfg, world=2):
    """A complete checkpoint as far as plan_resume reads it: marker, its files, the saved config."""
    path = Path(out) / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "rank_0.json").write_text("{}")
    (path / "COMPLETE").write_text(json.dumps({"format": FORMAT, "step": step, "world_size": world, "files": {
        "rank_0.json": 2}, "config": config_record(cfg), "model_path": "tiny", "state": {}}))
    RunDir(out).marker.write_text("{}")  # the run that wrote it marked its folder
    return path


def test_auto_continues_the_same_run_and_refuses_another(tmp_path):
    ck = _fake_checkpoint(tmp_path, 2, _cfg(tmp_path, steps=5))
    plan = plan_resume(_cfg(tmp_path, steps=5, level="INFO", every_s=60.0))
    assert plan.checkpoint == str(ck) and plan.saved_world_size == 2 and plan.warnings == ()
    with pytest.raises(ConfigError, match=r"holds a different run \(run.seed: 0 -> 1; run.steps: 5 -> 6\)"
                                          r".*checkpoint.resume=never.*checkpoint.resume=force"):
        plan_resume(_cfg(tmp_path, steps=6, seed=1))
    # force continues with the new settings, and says what changed
    plan = plan_resume(_cfg(tmp_path, steps=6, resume="force"))
    assert plan.checkpoint == str(ck) and "run.steps: 5 -> 6" in plan.warnings[0]
    assert ck.is_dir()  # nothing was moved by any of this


def test_a_finished_run_is_reported_not_retrained(tmp_path):
    _fake_checkpoint(tmp_path, 5, _cfg(tmp_path, steps=5))
    with pytest.raises(RunComplete, match="already at step 5 of run.steps=5; nothing to train"):
        plan_resume(_cfg(tmp_path, steps=5))
    # raising the step count is a different run unless asked for
    with pytest.raises(ConfigError, match="run.steps: 5 -> 8"):
        plan_resume(_cfg(tmp_path, steps=8))
    assert plan_resume(_cfg(tmp_path, steps=8, resume="force")).checkpoint.endswith("step_000005")


def test_a_fresh_start_sets_an_earlier_run_aside(tmp_path):
    # an earlier run killed before its first save: metrics, logs, config, but no checkpoint
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "logs" / "rank_0.log").write_text("old\n")
    (tmp_path / "logs" / "123-node0.log").write_text("the launcher's log of this launch\n")
    RunDir(tmp_path).claim()
    plan = plan_resume(_cfg(tmp_path))
    assert plan.checkpoint is None and plan.set_aside and "moved to" in plan.warnings[0]
    moved = Path(plan.set_aside)
    assert moved.parent == tmp_path / "previous"
    assert (moved / "metrics.jsonl").read_text().count("step") == 2 and (moved / "logs" / "rank_0.log").is_file()
    assert not (tmp_path / "metrics.jsonl").exists() and (moved / ".distflow-run").is_file()
    assert (tmp_path / "logs" / "123-node0.log").is_file()  # not a run file: stays
    assert (tmp_path / ".distflow-run").is_file()  # the new run claimed the folder
    # never: a complete checkpoint is set aside too, into a second folder
    _fake_checkpoint(tmp_path, 3, _cfg(tmp_path))
    plan = plan_resume(_cfg(tmp_path, resume="never"))
    assert plan.checkpoint is None and (Path(plan.set_aside) / "checkpoints" / "step_000003").is_dir()
    assert len(list((tmp_path / "previous").iterdir())) == 2
    assert plan_resume(_cfg(tmp_path / "empty")) == type(plan)()  # an empty folder: a plain fresh start


def test_a_torn_newest_checkpoint_is_named_with_its_defect_and_the_steps_it_costs(tmp_path):
    cfg = _cfg(tmp_path, steps=8)
    older = _fake_checkpoint(tmp_path, 2, cfg)
    newest = Path(tmp_path) / "checkpoints" / "step_000006"
    shutil.copytree(older, newest)
    marker = json.loads((newest / "COMPLETE").read_text())
    (newest / "COMPLETE").write_text(json.dumps({**marker, "step": 6}))
    (newest / "rank_0.json").write_text("{")  # truncated: 1 byte where the marker says 2
    plan = plan_resume(cfg)
    assert plan.checkpoint == str(older)
    assert plan.warnings == (f"skipping checkpoint {newest} (step 6): {newest / 'rank_0.json'} is 1 bytes, the marker "
                             "says 2", f"resuming from {older} (step 2): 4 steps will be computed again")
    # force over a folder whose only checkpoint is torn: stop, naming it and its defect
    shutil.rmtree(older)
    (newest / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume=force: no complete checkpoint in .*; the newest, "
                                          rf"{newest}, cannot be loaded: it has no COMPLETE marker"):
        plan_resume(_cfg(tmp_path, steps=8, resume="force"))
    assert newest.is_dir()  # nothing moved
    # auto: a fresh start, after a line that says so (the torn folder goes aside with the earlier run's files)
    plan = plan_resume(cfg)
    assert plan.checkpoint is None and plan.warnings[:2] == (
        f"skipping checkpoint {newest} (step 6): it has no COMPLETE marker (its save did not finish)",
        "no complete checkpoint to continue: starting a fresh run at step 1")
    assert (Path(plan.set_aside) / "checkpoints" / "step_000006").is_dir()


def test_a_restarted_attempt_continues_even_under_never(tmp_path):
    ck = _fake_checkpoint(tmp_path, 2, _cfg(tmp_path, resume="never"))
    assert plan_resume(_cfg(tmp_path, resume="never"), restart=1).checkpoint == str(ck)


def test_an_explicit_checkpoint_path_is_continued_like_force(tmp_path):
    ck = _fake_checkpoint(tmp_path / "a", 2, _cfg(tmp_path / "a"))
    plan = plan_resume(_cfg(tmp_path / "b", resume=str(ck), seed=4))
    assert plan.checkpoint == str(ck) and "run.seed: 0 -> 4" in plan.warnings[0]
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        plan_resume(_cfg(tmp_path / "b", resume=str(tmp_path / "nowhere")))
    assert sorted(os.listdir(tmp_path / "a")) == [".distflow-run", "checkpoints"]


# ----------------------------------------------------------------------------- the folder's lock, a cut-short set-aside
LAUNCH = """
import sys, time
from distflow.config import DistflowConfig
from distflow.run.resume import plan_resume
cfg = DistflowConfig()
cfg.model.dtype, cfg.task.path, cfg.checkpoint.resume = "float32", "data.jsonl", "never"
cfg.run.output_dir = sys.argv[1]
print(plan_resume(cfg).set_aside, flush=True)
time.sleep(120)
"""


def _tree(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


def test_two_launches_into_one_folder_are_one_run_and_one_refusal(tmp_path):
    _fake_checkpoint(tmp_path, 2, _cfg(tmp_path, seed=3))  # an earlier run: the first launch sets it aside
    first = subprocess.Popen([sys.executable, "-c", LAUNCH, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        moved = first.stdout.readline().strip()
        assert Path(moved).parent == tmp_path / "previous", moved
        before = _tree(tmp_path)
        with pytest.raises(ConfigError, match=rf"^run.output_dir {tmp_path} is in use by another run \(host .+, "
                                              rf"pid {first.pid}, started .+\); wait for it to end"):
            plan_resume(_cfg(tmp_path, resume="never"))
        assert _tree(tmp_path) == before  # the refused launch moved and wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stdout.close()
    plan = plan_resume(_cfg(tmp_path))  # the first launch was killed: its lock does not block
    assert plan.checkpoint is None and json.loads(RunDir(tmp_path).lockfile.read_text())["pid"] == os.getpid()
    RunDir(tmp_path).unlock()


KILLED_SET_ASIDE = """
import os, shutil, signal, sys
from distflow.run.rundir import RunDir
moves, after, real_move = [], int(sys.argv[2]), shutil.move
def move(src, dst):
    if not moves and after == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    moves.append(real_move(src, dst))
    if len(moves) == after:
        os.kill(os.getpid(), signal.SIGKILL)
shutil.move = move
RunDir(sys.argv[1]).set_aside()
"""


@pytest.mark.parametrize("moved_before_kill", [0, 2, 5])
def test_a_set_aside_killed_midway_is_finished_by_the_next_launch(tmp_path, moved_before_kill):
    """SIGKILL after some of the earlier run's artifacts (5: config, metrics, checkpoints, a rank log,
    the marker) moved; the next launch, resume=auto, finishes the move into the same folder, and does
    not continue the checkpoint that was about to be set aside."""
    cfg = _cfg(tmp_path)
    _fake_checkpoint(tmp_path, 2, cfg)
    (tmp_path / "config.json").write_text(json.dumps(config_record(cfg)))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_0.log").write_text("earlier\n")
    (tmp_path / "notes.txt").write_text("mine")
    earlier = _tree(tmp_path)
    killed = subprocess.run([sys.executable, "-c", KILLED_SET_ASIDE, str(tmp_path), str(moved_before_kill)],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (cut_short,) = (tmp_path / "previous").iterdir()
    assert len(os.listdir(cut_short)) == moved_before_kill + 1  # what it moved, and its journal
    plan = plan_resume(_cfg(tmp_path))
    assert plan.checkpoint is None, plan  # a fresh start, as the killed launch had decided
    assert any(f"moved a run's files to {cut_short}; it is finished now" in w for w in plan.warnings), plan.warnings
    assert os.listdir(tmp_path / "previous") == [cut_short.name]  # one folder holds the whole earlier run
    assert _tree(cut_short) == [f for f in earlier if f != "notes.txt"]
    assert sorted(_tree(tmp_path)) == sorted([".distflow-lock", ".distflow-run", "notes.txt",
                                              *(f"previous/{cut_short.name}/{f}" for f in _tree(cut_short))])
    RunDir(tmp_path).unlock()
