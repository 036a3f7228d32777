"""The start-up plan (distflow.plan): every automatic value made concrete once, by the same rules as
before, the model-folder checks and the memory estimate held before any weights load, components
that refuse "auto", and a config record that says what ran with what the user wrote beside it.
Runs on the CPU with the tiny model and no process group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import distflow.config.schema as schema
from distflow.config import ConfigError, DistflowConfig, ModelConfig, config_differences, config_record
from distflow.distributed import DistInfo
from distflow.distributed import devices
from distflow.distributed.devices import CpuBf16, UnresolvedAuto, dtype_line, resolve_auto
from distflow.plan import AUTOMATIC, RunPlan, plan, resolve

CPU = DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo")
ZEN4, SKYLAKE = CpuBf16(False, True), CpuBf16(False, False)
GIB = 2**30


def _cfg(**algorithm) -> DistflowConfig:
    cfg = DistflowConfig()
    cfg.task.path = "data.jsonl"
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    return cfg


@pytest.fixture(scope="module")
def cpu_plan(tiny_model_dir) -> RunPlan:
    return plan(_cfg(), CPU, tiny_model_dir)


def test_every_automatic_value_is_concrete_and_listed_beside(cpu_plan, tiny_model_dir):
    p, user = cpu_plan, _cfg()
    c = p.cfg
    assert (c.optim.shared_prefix, c.rollout.enforce_eager, c.rollout.kv_cache_gib) == ("on", "true", 0.25)
    assert (c.model.shard_ranks, c.run.device, c.run.backend) == (1, "cpu", "gloo")  # tiny: replicas
    assert c.model.dtype in ("float32", "bfloat16")
    assert p.auto == AUTOMATIC  # the user wrote every automatic setting; each was made concrete
    assert user.model.dtype == "auto" and user.optim.shared_prefix == "auto"  # the input is not modified
    assert p.dtype == getattr(torch, c.model.dtype)
    # the same choices resolve_auto makes, on this machine's CPU
    before = resolve_auto(user, "cpu")
    assert (c.model, c.rollout, c.optim) == (before.model, before.rollout, before.optim)
    assert p.dtype_note == dtype_line("auto", "cpu")
    # a concrete config has nothing left to resolve
    again = resolve(c, "cpu")
    assert again.cfg == c and again.auto == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cfg = user  # type: ignore[misc]


def test_the_plan_holds_layout_model_config_and_shape_before_any_weights(cpu_plan, tiny_model_dir):
    p = cpu_plan
    assert p.model_path == p.critic_path == tiny_model_dir
    assert (p.layout.world_size, p.layout.shard, p.layout.engine_tp) == (1, 1, 1)
    assert p.model_config.hidden_size == 64 and p.model_config.num_hidden_layers == 2
    assert (p.shape.hidden, p.shape.layers, p.shape.intermediate) == (64, 2, 128) and p.shape.parameters > 0
    assert p.critic_shape is None and p.memory is None  # no critic; no estimate on the CPU
    with_critic = plan(_cfg(advantage="gae"), CPU, tiny_model_dir)
    assert with_critic.critic_shape == with_critic.shape  # the critic's backbone is the policy's folder


def test_the_memory_estimate_is_made_and_held_on_cuda(tiny_model_dir, monkeypatch):
    from distflow.train.memory_budget import check_memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 80 * GIB))
    cuda = DistInfo(0, 1, 0, 1, torch.device("cuda", 0), "nccl")
    p = plan(_cfg(kl_coef=0.1), cuda, tiny_model_dir)
    assert (p.cfg.model.dtype, p.cfg.rollout.enforce_eager, p.cfg.run.backend) == ("bfloat16", "false", "nccl")
    assert p.cfg.rollout.kv_cache_gib is None and "rollout.kv_cache_gib" not in p.auto  # vLLM sizes it on CUDA
    assert "KL reference" in p.memory["generate"]
    assert p.memory == check_memory_budget(p.cfg, tiny_model_dir, p.layout, device_bytes=80 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, GIB))
    with pytest.raises(ConfigError, match=r"more than the device's 1\.0 GiB"):
        plan(_cfg(), cuda, tiny_model_dir)


@pytest.mark.parametrize("cpu,dtype", [(ZEN4, "bfloat16"), (SKYLAKE, "float32"), (None, None)])
def test_dtype_follows_the_cpus_bf16_support_as_resolve_auto_does(cpu, dtype):
    got = resolve(_cfg(), "cpu", cpu=cpu)
    assert got.cfg.model.dtype == resolve_auto(_cfg(), "cpu", cpu).model.dtype == \
        (dtype or str(devices.auto_dtype("cpu")[0]).removeprefix("torch."))
    assert got.dtype_note == dtype_line("auto", "cpu", cpu)
    pinned = _cfg()
    pinned.model.dtype = "float32"
    assert resolve(pinned, "cpu", cpu=ZEN4).cfg.model.dtype == "float32" and "model.dtype" not in \
        resolve(pinned, "cpu", cpu=ZEN4).auto


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_shared_prefix_is_decided_by_the_updaters_old_rule(setting, group_size):
    from distflow.train.update import Updater

    cfg = _cfg(group_size=group_size, advantage="reinforce_pp")  # not group-relative: group_size 1 is valid
    cfg.optim.shared_prefix = setting
    got = resolve(cfg, "cpu").cfg
    old_rule = setting == "on" or (setting == "auto" and group_size > 1)  # train/update.py before the plan
    assert got.optim.shared_prefix == ("on" if old_rule else "off")
    assert Updater(got, 0).shared_prefix is old_rule


def test_eager_mode_is_concrete_for_each_device():
    assert resolve(_cfg(), "cpu").cfg.rollout.enforce_eager == "true"
    assert resolve(_cfg(), "cuda").cfg.rollout.enforce_eager == "false"
    explicit = _cfg()
    explicit.rollout.enforce_eager = "true"
    assert resolve(explicit, "cuda").cfg.rollout.enforce_eager == "true"


def test_components_refuse_auto_and_decide_nothing_after_the_plan(cpu_plan, tiny_model_dir, monkeypatch):
    from distflow.rollout.hf_engine import HFEngine
    from distflow.rollout.vllm_engine import VLLMEngine, memory_kwargs
    from distflow.train.memory_budget import check_memory_budget
    from distflow.train.policy import Policy
    from distflow.train.update import Updater

    p, raw = cpu_plan, _cfg()
    auto_model = ModelConfig(path=tiny_model_dir)
    with pytest.raises(UnresolvedAuto, match=r"optim.shared_prefix='auto'"):
        Updater(raw, 0)
    with pytest.raises(UnresolvedAuto, match=r"model.dtype='auto'"):
        Policy(tiny_model_dir, auto_model, p.cfg.optim, p.layout)
    with pytest.raises(UnresolvedAuto, match=r"optim.shared_prefix='auto'"):
        Policy(tiny_model_dir, p.cfg.model, raw.optim, p.layout)
    with pytest.raises(UnresolvedAuto, match=r"model.dtype='auto'"):
        HFEngine(tiny_model_dir, auto_model, p.cfg.rollout, torch.device("cpu"))
    with pytest.raises(UnresolvedAuto, match=r"model.dtype='auto'"):
        VLLMEngine(tiny_model_dir, auto_model, p.cfg.rollout, torch.device("cpu"), 0)
    with pytest.raises(UnresolvedAuto, match=r"rollout.enforce_eager='auto'"):
        VLLMEngine(tiny_model_dir, p.cfg.model, raw.rollout, torch.device("cpu"), 0)
    with pytest.raises(UnresolvedAuto, match=r"rollout.kv_cache_gib=None"):
        memory_kwargs(raw.rollout, on_cpu=True)
    with pytest.raises(UnresolvedAuto, match=r"model.dtype='auto'"):
        check_memory_budget(raw, tiny_model_dir, p.layout, device_bytes=80 * GIB)

    def decided_again(*args, **kwargs):
        raise AssertionError("a component resolved an automatic value the plan had resolved")

    for name in ("auto_dtype", "enforce_eager", "kv_cache_gib", "shared_prefix", "torch_dtype"):
        monkeypatch.setattr(devices, name, decided_again)
    assert Updater(p.cfg, 0).shared_prefix is True
    assert memory_kwargs(p.cfg.rollout, on_cpu=True) == {"kv_cache_memory_bytes": GIB // 4}
    engine = HFEngine(p.model_path, p.cfg.model, p.cfg.rollout, torch.device("cpu"))
    assert next(engine.model.parameters()).dtype == p.dtype


def test_config_json_records_what_ran_with_the_auto_beside(cpu_plan, tmp_path):
    from distflow.run.output import save_config

    save_config(cpu_plan.cfg, tmp_path / "config.json", write=True, auto=cpu_plan.auto)
    record = json.loads((tmp_path / "config.json").read_text())
    assert record == cpu_plan.record()
    assert record["auto"] == {"model.dtype": "auto", "model.shard_ranks": None, "optim.shared_prefix": "auto",
                              "rollout.enforce_eager": "auto", "rollout.kv_cache_gib": None, "run.device": "auto",
                              "run.backend": "auto"}
    assert record["optim"]["shared_prefix"] == "on" and record["model"]["dtype"] == cpu_plan.cfg.model.dtype
    assert DistflowConfig.from_dict({k: v for k, v in record.items() if k != "auto"}) == cpu_plan.cfg


def _before_the_plan(p: RunPlan) -> dict:
    """The record a run wrote before the plan: shared prefix, KV cache, device and backend as written."""
    record = config_record(p.cfg)
    record["optim"]["shared_prefix"], record["rollout"]["kv_cache_gib"] = "auto", None
    record["run"]["device"] = record["run"]["backend"] = "auto"
    return record


def test_a_saved_auto_equals_what_it_resolves_to_now(cpu_plan, monkeypatch):
    monkeypatch.setattr(schema, "OPERATIONAL", frozenset())  # compare even the operational keys
    old = _before_the_plan(cpu_plan)
    assert config_differences(old, cpu_plan.record()) == []
    assert config_differences(cpu_plan.record(), config_record(cpu_plan.cfg)) == []  # "auto" is no key itself
    assert config_differences(cpu_plan.record(), cpu_plan.record()) == []
    padded = _cfg()
    padded.optim.shared_prefix = "off"  # a real change is still one
    assert "optim.shared_prefix: 'auto' -> 'off'" in config_differences(old, resolve(padded, "cpu").record())


def test_a_checkpoint_from_before_the_plan_resumes_under_auto(cpu_plan, tmp_path):
    from distflow.checkpoint.checkpointer import FORMAT
    from distflow.run.resume import plan_resume
    from distflow.run.rundir import RunDir

    cfg = dataclasses.replace(cpu_plan.cfg, run=dataclasses.replace(cpu_plan.cfg.run, output_dir=str(tmp_path),
                                                                      steps=5))
    saved = _before_the_plan(dataclasses.replace(cpu_plan, cfg=cfg))
    assert saved["optim"]["shared_prefix"] == "auto" and cfg.optim.shared_prefix == "on"
    path = Path(tmp_path) / "checkpoints" / "step_000002"
    path.mkdir(parents=True)
    (path / "rank_0.json").write_text("{}")
    (path / "COMPLETE").write_text(json.dumps({"format": FORMAT, "step": 2, "world_size": 1, "files": {
        "rank_0.json": 2}, "config": saved, "model_path": "tiny", "state": {}}))
    RunDir(tmp_path).marker.write_text("{}")
    assert cfg.checkpoint.resume == "auto"
    resumed = plan_resume(cfg)
    assert resumed.checkpoint == str(path) and resumed.warnings == ()
