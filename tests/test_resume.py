"""Resume: on another number of ranks (DCP reshards, the sampler's stream continues, new ranks
get derived RNG streams), and the rules that decide whether a launch continues the run in its
output folder (distflow.resume). Real gloo ranks, real FSDP2 models, real DCP files."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from dist_helpers import run_distributed
from distflow.checkpoint import POLICY, Checkpointer, ModelOptimState, RNGState, latest_checkpoint, read_marker
from distflow.config import ConfigError, DistflowConfig
from distflow.data.sampler import ShardedSampler
from distflow.layout import ParallelLayout
from distflow.policy import Policy
from distflow.resume import RunComplete, config_differences, config_record, plan_resume

IDS = torch.tensor([[1, 5, 9, 33, 70, 2], [4, 8, 15, 16, 23, 42]])
SEED, STEP = 7, 3


def _policy(model_dir, shard_ranks):
    cfg = DistflowConfig()
    cfg.model.shard_ranks = shard_ranks
    return Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))


def _full_state(policy) -> dict:
    """Model and optimizer state as full tensors (gathered on every rank)."""
    model, optim = get_state_dict(policy.model, [policy.optimizer], options=StateDictOptions(full_state_dict=True))
    return {"model": model, "optim": optim}


def _checkpointer(root, rank, policy, sampler):
    ck = Checkpointer(root, keep_last=2, rank=rank)
    ck.register(POLICY, ModelOptimState(policy.model, policy.optimizer), "sharded")
    ck.register("sampler", sampler, "rank")
    ck.register("rng", RNGState("cpu", SEED), "rank")
    return ck


def _train_and_save(rank, world, model_dir, root, shard_ranks, out):
    policy = _policy(model_dir, shard_ranks)
    loss = policy.model(input_ids=IDS[rank % 2:rank % 2 + 1]).logits.float().pow(2).mean()
    loss.backward()
    policy.optimizer.step()  # Adam moments exist and differ from zero
    sampler = ShardedSampler(50, rank, world, seed=SEED)
    sampler.next_indices(2)
    torch.manual_seed(100 + rank)
    _checkpointer(root, rank, policy, sampler).save(STEP)
    state = _full_state(policy)
    if rank == 0:
        torch.save(state, out)


def _load_and_compare(rank, world, model_dir, root, shard_ranks, saved_file, saved_world):
    policy = _policy(model_dir, shard_ranks)
    sampler = ShardedSampler(50, rank, world, seed=SEED)
    _checkpointer(root, rank, policy, sampler).load(latest_checkpoint(root))
    saved, now = torch.load(saved_file, weights_only=False), _full_state(policy)
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
        torch.manual_seed((SEED * 1_000_003 + STEP) * 1_009 + rank)
        assert torch.equal(drawn, torch.rand(3))
    else:  # its own saved streams
        torch.manual_seed(100 + rank)
        assert torch.equal(drawn, torch.rand(3))


@pytest.mark.parametrize("saved_world,world,shard_ranks", [(2, 1, -1), (1, 2, -1), (2, 1, 1)])
def test_resume_on_another_world_size_restores_model_optimizer_and_streams(
        tiny_model_dir, tmp_path, saved_world, world, shard_ranks):
    root, saved = str(tmp_path / "run"), str(tmp_path / "saved.pt")
    run_distributed(_train_and_save, saved_world, tiny_model_dir, root, shard_ranks, saved)
    assert read_marker(latest_checkpoint(root))["world_size"] == saved_world
    run_distributed(_load_and_compare, world, tiny_model_dir, root, shard_ranks, saved, saved_world)


# ----------------------------------------------------------------------------- which run is this
def _cfg(out, **trainer):
    cfg = DistflowConfig()
    cfg.trainer.output_dir = str(out)
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def _fake_checkpoint(out, step, cfg, world=2):
    """A complete checkpoint as far as plan_resume reads it: marker, its files, the saved config."""
    path = Path(out) / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "rank_0.json").write_text("{}")
    meta = {"config": config_record(cfg), "world_size": world}
    (path / "COMPLETE").write_text(json.dumps({"format": 2, "step": step, "world_size": world, "meta": meta,
                                               "files": {"rank_0.json": 2}, "state": {}}))
    return path


def test_config_differences_name_the_run_keys_only():
    a, b = config_record(DistflowConfig()), DistflowConfig()
    b.trainer.seed, b.trainer.steps, b.model.path = 1, 9, "elsewhere"
    b.trainer.log_level, b.optim.micro_batch_size, b.rollout.engine = "INFO", 2, "hf"  # operational
    b.task.gym_config = {"digits": 3}
    assert config_differences(a, config_record(b)) == [
        "model.path: 'tiny' -> 'elsewhere'", "task.gym_config: {} -> {'digits': 3}",
        "trainer.seed: 0 -> 1", "trainer.steps: 3 -> 9"]
    assert config_differences(a, a) == []
    # a subsection compares key by key; its resync mode is operational
    b = DistflowConfig()
    b.model.lora.enabled, b.model.lora.rank, b.model.lora.resync = True, 16, "adapter"
    assert config_differences(a, config_record(b)) == ["model.lora.enabled: False -> True",
                                                       "model.lora.rank: 8 -> 16"]
    # a run saved before a key existed used its default: no difference, until it is changed
    old = copy.deepcopy(a)
    del old["model"]["lora"], old["model"]["grad_bucket_mib"], old["trainer"]["straggler_warn_steps"]
    assert config_differences(old, a) == []
    b = DistflowConfig()
    b.model.lora.enabled = True
    assert config_differences(old, config_record(b)) == ["model.lora.enabled: False -> True"]


def test_auto_continues_the_same_run_and_refuses_another(tmp_path):
    ck = _fake_checkpoint(tmp_path, 2, _cfg(tmp_path, steps=5))
    plan = plan_resume(_cfg(tmp_path, steps=5, log_level="INFO", checkpoint_every_s=60.0))
    assert plan.checkpoint == str(ck) and plan.saved_world_size == 2 and plan.warnings == ()
    with pytest.raises(ConfigError, match=r"holds a different run \(trainer.seed: 0 -> 1; trainer.steps: 5 -> 6\)"
                                          r".*trainer.resume=never.*trainer.resume=force"):
        plan_resume(_cfg(tmp_path, steps=6, seed=1))
    # force continues with the new settings, and says what changed
    plan = plan_resume(_cfg(tmp_path, steps=6, resume="force"))
    assert plan.checkpoint == str(ck) and "trainer.steps: 5 -> 6" in plan.warnings[0]
    assert ck.is_dir()  # nothing was moved by any of this


def test_a_finished_run_is_reported_not_retrained(tmp_path):
    _fake_checkpoint(tmp_path, 5, _cfg(tmp_path, steps=5))
    with pytest.raises(RunComplete, match="already at step 5 of trainer.steps=5; nothing to train"):
        plan_resume(_cfg(tmp_path, steps=5))
    # raising the step count is a different run unless asked for
    with pytest.raises(ConfigError, match="trainer.steps: 5 -> 8"):
        plan_resume(_cfg(tmp_path, steps=8))
    assert plan_resume(_cfg(tmp_path, steps=8, resume="force")).checkpoint.endswith("step_000005")


def test_a_fresh_start_sets_an_earlier_run_aside(tmp_path):
    # an earlier run killed before its first save: metrics, logs, config, but no checkpoint
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "logs" / "rank_0.log").write_text("old\n")
    (tmp_path / "logs" / "123-node0.log").write_text("the launcher's log of this launch\n")
    (tmp_path / "config.json").write_text("{}")
    plan = plan_resume(_cfg(tmp_path))
    assert plan.checkpoint is None and plan.set_aside and "moved to" in plan.warnings[0]
    moved = Path(plan.set_aside)
    assert moved.parent == tmp_path / "previous"
    assert (moved / "metrics.jsonl").read_text().count("step") == 2 and (moved / "logs" / "rank_0.log").is_file()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.json").exists()
    assert (tmp_path / "logs" / "123-node0.log").is_file()  # not a run file: stays
    # never: a complete checkpoint is set aside too, into a second folder
    _fake_checkpoint(tmp_path, 3, _cfg(tmp_path))
    plan = plan_resume(_cfg(tmp_path, resume="never"))
    assert plan.checkpoint is None and (Path(plan.set_aside) / "checkpoints" / "step_000003").is_dir()
    assert len(list((tmp_path / "previous").iterdir())) == 2
    assert plan_resume(_cfg(tmp_path)) == type(plan)()  # an empty folder: a plain fresh start


def test_a_restarted_attempt_continues_even_under_never(tmp_path):
    ck = _fake_checkpoint(tmp_path, 2, _cfg(tmp_path, resume="never"))
    assert plan_resume(_cfg(tmp_path, resume="never"), restart=1).checkpoint == str(ck)


def test_an_explicit_checkpoint_path_is_continued_like_force(tmp_path):
    ck = _fake_checkpoint(tmp_path / "a", 2, _cfg(tmp_path / "a"))
    plan = plan_resume(_cfg(tmp_path / "b", resume=str(ck), seed=4))
    assert plan.checkpoint == str(ck) and "trainer.seed: 0 -> 4" in plan.warnings[0]
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        plan_resume(_cfg(tmp_path / "b", resume=str(tmp_path / "nowhere")))
    assert os.listdir(tmp_path / "a") == ["checkpoints"]
