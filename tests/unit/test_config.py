"""The config schema: every recipe composes and validates; choices, ranges and types are refused
with one line before anything loads; old key spellings still compose, with one line naming the
new key; the operational flags are the keys a resume may change; docs/configuration.md is the
schema's own page."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from config_helpers import RECIPES, compose
from launch_helpers import ROOT
from distflow.config import (OPERATIONAL, ConfigError, DistflowConfig, TaskConfig, config_differences, config_record,
                             hydra_schema, rename_overrides)
from distflow.config.aliases import ALIASES
from distflow.config.docs import configuration_markdown
from distflow.config.fields import choices_of, leaf_keys


def valid(**sections) -> DistflowConfig:
    """A config with a task that has data, so only what a test sets can be wrong."""
    return DistflowConfig(**{"task": TaskConfig(path="data.jsonl"), **sections})


@pytest.mark.parametrize("group,name", [
    (g, p.stem) for g in ("experiment", "algorithm", "model", "rollout", "task")
    for p in sorted((RECIPES / g).glob("*.yaml"))
])
def test_every_recipe_config_composes_and_validates(group, name):
    needs = {("task", "jsonl"): ["task.path=data.jsonl"], ("algorithm", "distill"): ["teacher.path=tiny"]}
    cfg = compose([f"{group}={name}", *needs.get((group, name), [])])
    if group == "model" and name != "tiny":
        cfg.model.path = "tiny"  # validation only: do not convert a real model here
    cfg.validate()


@pytest.mark.parametrize("override,needle", [
    ("optim.micro_batch_tokens=-1", "optim.micro_batch_tokens must be >= 0"),
    ("optim.lr=-1e-5", "optim.lr must be >= 0, got -1e-05"),
    ("optim.lr=inf", "optim.lr must be >= 0, got inf"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
    ("optim.beta2=1.0", "optim.beta1 and optim.beta2 must be in .0, 1.. got 0.9, 1.0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm must be > 0"),
    ("logging.progress_every_s=-1", "logging.progress_every_s must be >= 0"),
    ("run.sync_probe_every=0", "run.sync_probe_every must be >= 1"),
    ("model.shard_ranks=0", "model.shard_ranks must be -1"),
    ("model.logprob_chunk_tokens=-1", "model.logprob_chunk_tokens must be >= 0"),
    ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib must be > 0"),
    ("checkpoint.every_s=-1", "checkpoint.every and checkpoint.every_s must be >= 0"),
    ("checkpoint.every=-2", "checkpoint.every and checkpoint.every_s must be >= 0"),
    ("run.host_mmap_threshold_kib=-1", "run.host_mmap_threshold_kib must be 0"),
    ("run.host_mmap_threshold_kib=65536", "run.host_mmap_threshold_kib must be 0"),
    ("model.replica_grad_sync=ddp", "model.replica_grad_sync must be one of bucketed, fsdp; got 'ddp'"),
    ("model.grad_bucket_mib=0", "model.grad_bucket_mib must be > 0"),
    ("logging.straggler_warn_steps=-1", "logging.straggler_warn_steps must be >= 0"),
    ("run.device=gpu", "run.device must be one of auto, cpu, cuda; got 'gpu'"),
    ("run.backend=mpi", "run.backend must be one of auto, gloo, nccl"),
    ("rollout.enforce_eager=maybe", "rollout.enforce_eager must be one of auto, true, false"),
    ("logging.level=LOUD", "logging.level must be one of DEBUG, INFO, WARNING, ERROR"),
    ("logging.loggers=[jsonl,bogus]", "logging.loggers must be one of console, jsonl, wandb, tensorboard; got 'bogus'"),
    ("task.name=csv", "task.name must be one of jsonl, reasoning_gym"),
    ("model.dtype=float16", "model.dtype=float16 is not supported: fp16 training needs a gradient scaler"),
    ("validation.at_end=true", "validation needs a held-out split: set task.heldout_path"),
    ("+run.bogus=1", "unknown config key run.bogus"),
])
def test_bad_values_are_one_line_config_errors(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")) as e:
        compose([override]).validate()
    assert "\n" not in str(e.value)


def test_wrong_type_is_rejected():
    with pytest.raises(Exception, match="steps"):
        compose(["run.steps=many"])


def test_every_choice_is_checked():
    """Every Literal field refuses a value outside its choices (the generic check sees them all)."""
    fields = [(key, choices_of(ann)) for key, _, ann in leaf_keys(DistflowConfig) if choices_of(ann)]
    assert len(fields) == 25, fields  # model: dtype, grad sync, lora resync; optim: shared prefix; rollout: engine, eager; algorithm: 4 + rollout_correction: 2; pipeline: mode, apply, staging, kv_after_update, late, env_wait; task; agent: wait, rows; run: 2; logging: 2
    for key, _ in fields:
        cfg = valid()
        *path, leaf = key.split(".")
        section = cfg
        for part in path:
            section = getattr(section, part)
        setattr(section, leaf, ["not-a-choice"] if isinstance(getattr(section, leaf), list) else "not-a-choice")
        with pytest.raises(ConfigError, match=f"^{key} must be one of"):
            cfg.validate()


def test_choices_in_any_letter_case_are_the_declared_ones():
    cfg = compose(["logging.level=info", "rollout.enforce_eager=true", "logging.loggers=[JSONL]"])
    assert (cfg.logging.level, cfg.rollout.enforce_eager, cfg.logging.loggers) == ("INFO", "true", ["jsonl"])


def test_the_critic_follows_from_the_estimator():
    assert compose(["algorithm=ppo"]).has_critic and not compose(["algorithm=grpo"]).has_critic
    assert compose(["algorithm=grpo", "algorithm.advantage=gae"]).has_critic


# ----------------------------------------------------------------------------- old spellings
PREVIOUS_TRAINER_KEYS = (  # the trainer section before the split into run / checkpoint / validation / logging
    "steps", "seed", "output_dir", "backend", "device", "collective_timeout_s", "balance_lengths", "sync_probe_seqs",
    "sync_probe_every", "progress_bar", "straggler_warn_steps", "host_mmap_threshold_kib", "log_level",
    "max_nonfinite_steps", "loggers", "wandb_project", "plot_at_end", "checkpoint_every", "checkpoint_every_s",
    "checkpoint_at_end", "keep_last", "resume", "export_at_end", "val_every", "val_before_train", "val_at_end",
    "val_pass_k", "fault_inject")
PREVIOUS_OPERATIONAL = {  # the list resume kept by hand before the schema carried the flag
    "model.dtype", "model.shard_ranks", "model.trust_remote_code", "model.meta_device_init",
    "model.activation_checkpointing", "model.logprob_chunk_tokens", "model.replica_grad_sync", "model.grad_bucket_mib",
    "model.lora.resync", "rollout.engine", "rollout.kv_cache_gib", "rollout.gpu_memory_utilization",
    "rollout.enforce_eager", "rollout.sleep_during_update", "rollout.sync_bucket_mib", "rollout.tensor_parallel_size",
    "optim.micro_batch_size", "optim.micro_batch_tokens", "task.reward_timeout_s", "task.reward_workers",
    *(f"trainer.{k}" for k in (
        "output_dir", "backend", "device", "collective_timeout_s", "balance_lengths", "sync_probe_seqs",
        "sync_probe_every", "progress_bar", "log_level", "max_nonfinite_steps", "loggers", "wandb_project",
        "plot_at_end", "checkpoint_every", "checkpoint_every_s", "checkpoint_at_end", "keep_last", "resume",
        "export_at_end", "fault_inject", "host_mmap_threshold_kib", "straggler_warn_steps")),
}


def test_every_old_key_has_a_new_one_that_exists():
    keys = {key for key, _, _ in leaf_keys(DistflowConfig)}
    assert {f"trainer.{k}" for k in PREVIOUS_TRAINER_KEYS} | {"critic.enabled", "algorithm.tis_cap"} == set(ALIASES)
    assert all(new in keys for new in ALIASES.values() if new is not None)


def test_old_spellings_compose_the_same_config_and_name_the_new_keys():
    old = ["trainer.steps=7", "trainer.output_dir=/tmp/x", "trainer.val_at_end=true", "trainer.log_level=INFO",
           "trainer.loggers=[jsonl]", "++trainer.keep_last=4", "critic.enabled=true", "task.heldout_path=h.jsonl"]
    new = ["run.steps=7", "run.output_dir=/tmp/x", "validation.at_end=true", "logging.level=INFO",
           "logging.loggers=[jsonl]", "checkpoint.keep_last=4", "task.heldout_path=h.jsonl"]
    assert compose(old) == compose(new)
    renamed, notes = rename_overrides(old + ["trainer.steps=8"])
    assert renamed[:2] == ["run.steps=7", "run.output_dir=/tmp/x"] and "++checkpoint.keep_last=4" in renamed
    assert notes == ["trainer.steps is deprecated: use run.steps", "trainer.output_dir is deprecated: use run.output_dir",
                     "trainer.val_at_end is deprecated: use validation.at_end",
                     "trainer.log_level is deprecated: use logging.level",
                     "trainer.loggers is deprecated: use logging.loggers",
                     "trainer.keep_last is deprecated: use checkpoint.keep_last",
                     "critic.enabled is deprecated and ignored: the critic follows from algorithm.advantage "
                     "(gae trains one)"]  # one line per key, however often it is used


NEWER_OPERATIONAL = {"logging.progress_every_s", "run.allow_engine_mismatch", "run.memory_check",
                     "logging.sync_timing", "optim.shared_prefix",
                     "validation.save_samples", "agent.host", "agent.port",
                     "agent.served_model_name"}  # operational keys added since that list


def test_operational_keys_are_the_ones_resume_always_allowed():
    renamed = {ALIASES.get(k, k) for k in PREVIOUS_OPERATIONAL}
    assert OPERATIONAL == renamed | NEWER_OPERATIONAL


def test_config_differences_ignore_operational_keys_and_name_the_run_keys():
    a = config_record(valid())
    b = valid()
    b.run.seed, b.run.steps, b.model.path = 1, 9, "elsewhere"
    b.logging.level, b.optim.micro_batch_size, b.rollout.engine, b.run.output_dir = "INFO", 2, "hf", "x"  # operational
    assert config_differences(a, config_record(b)) == [
        "model.path: 'tiny' -> 'elsewhere'", "run.seed: 0 -> 1", "run.steps: 3 -> 9"]
    b.model.lora.enabled = True  # a nested section compares key by key
    assert "model.lora.enabled: False -> True" in config_differences(a, config_record(b))
    older = config_record(valid())
    del older["model"]["lora"], older["logging"]["straggler_warn_steps"]  # a key newer than the saved run
    assert config_differences(older, a) == []


# ----------------------------------------------------------------------------- one schema
def test_the_record_builds_the_config_back_and_hydra_sees_every_key():
    from omegaconf import OmegaConf

    cfg = compose(["experiment=tools_smoke", "algorithm=ppo"])
    assert DistflowConfig.from_dict(config_record(cfg)) == cfg
    tree = OmegaConf.to_container(OmegaConf.structured(hydra_schema(DistflowConfig)))
    flat = {f"{s}.{k}" for s, keys in tree.items() for k in keys}
    nested = ("model.lora.", "algorithm.rollout_correction.")  # sections inside sections: one entry each
    assert flat == {key.rsplit(".", 1)[0] if key.startswith(nested) else key
                    for key, _, _ in leaf_keys(DistflowConfig)} | {"model.lora", "algorithm.rollout_correction"}


def test_unknown_keys_name_the_key():
    with pytest.raises(ConfigError, match=r"^unknown config key rollout.engin\b"):
        DistflowConfig.from_dict({"rollout": {"engin": "hf"}})
    with pytest.raises(ConfigError, match=r"^unknown config key model.lora.rnk\b"):
        DistflowConfig.from_dict({"model": {"lora": {"rnk": 4}}})
    with pytest.raises(ConfigError, match="^model.lora is a section of keys"):
        DistflowConfig.from_dict({"model": {"lora": 4}})



@pytest.mark.parametrize("tree,line", [
    # under a section that does not exist, the key the user wrote, not the section
    ({"trainer": {"bogus_key": 1}}, "unknown config key trainer.bogus_key; trainer.* keys are now under checkpoint, "
                                    "logging, run, validation (docs/configuration.md lists every key)"),
    ({"trainer": {"steps": 3}}, "unknown config key trainer.steps; did you mean run.steps? "),  # the same leaf
    ({"trainer": {"stpes": 3}}, "unknown config key trainer.stpes; did you mean run.steps? "),  # and misspelt
    ({"run": {"outptu_dir": "x"}}, "unknown config key run.outptu_dir; did you mean run.output_dir? "),
    ({"model": {"lora": {"rnk": 4}}}, "unknown config key model.lora.rnk; did you mean model.lora.rank? "),
    ({"run": {"bogus": 1}}, "unknown config key run.bogus (docs/configuration.md lists every key)"),  # nothing near
    ({"nosuch": {"a": {"b": 1}}}, "unknown config key nosuch.a.b (docs/configuration.md lists every key)"),
])
def test_an_unknown_key_is_named_as_written_with_the_closest_real_one(tree, line):
    with pytest.raises(ConfigError) as e:
        DistflowConfig.from_dict(tree)
    assert str(e.value).startswith(line), str(e.value)


def test_every_field_has_a_doc():
    undocumented = [key for key, f, ann in leaf_keys(DistflowConfig) if not f.metadata.get("doc")]
    assert undocumented == []
    for section in dataclasses.fields(DistflowConfig):
        assert typing.get_type_hints(DistflowConfig)[section.name]  # every section is typed


def test_configuration_page_is_generated_from_the_schema():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == configuration_markdown(), "docs/configuration.md is stale: python -m distflow config-docs > " \
                                             "docs/configuration.md"
    for key, _, _ in leaf_keys(DistflowConfig):
        assert f"`{key}`" in page
