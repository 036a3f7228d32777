"""The start-up GPU memory estimate, on fake device sizes: the worked 32B-on-8-GPUs example of
docs/scaling.md fits as the docs say, and each way of not fitting is one line naming the knob."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from distflow.config import ConfigError, DistflowConfig
from distflow.train.memory_budget import GIB, ModelShape, check, check_memory_budget, estimate
from distflow.train.model_init import skeleton

QWEN_32B = Qwen2Config(hidden_size=5120, num_hidden_layers=64, intermediate_size=27648, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=152064)
H100 = 80 * GIB


@pytest.fixture(scope="module")
def qwen_32b() -> ModelShape:
    model = skeleton(AutoModelForCausalLM, QWEN_32B)  # meta device: counts, allocates nothing
    return ModelShape.of(QWEN_32B, sum(p.numel() for p in model.parameters()))


def _cfg(**rollout) -> DistflowConfig:
    cfg = DistflowConfig()
    cfg.rollout.max_prompt_tokens = cfg.rollout.max_new_tokens = 512
    cfg.optim.micro_batch_tokens, cfg.model.activation_checkpointing, cfg.model.logprob_chunk_tokens = 4096, True, 1024
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def test_the_documented_32b_layout_fits_and_its_terms_are_the_documented_ones(qwen_32b):
    assert 32.7e9 < qwen_32b.parameters < 32.8e9
    phases = estimate(_cfg(gpu_memory_utilization=0.3), qwen_32b, None, H100, shard=8, engine_tp=4, compute_bytes=2)
    check(phases, H100)
    gen, upd = phases["generate"], phases["update"]
    assert gen["policy weights"] == pytest.approx(16.38e9, rel=1e-3) and gen["AdamW state"] == pytest.approx(32.76e9, rel=1e-3)
    assert gen["vLLM engine"] == 0.3 * H100 and "vLLM engine" not in upd  # asleep during the update
    assert upd["gradients"] == pytest.approx(16.38e9, rel=1e-3) and upd["activations"] < 5e9
    # a distillation teacher (here the same 32B) stays between steps, frozen in the compute dtype
    taught = estimate(_cfg(gpu_memory_utilization=0.3), qwen_32b, None, H100, 8, 4, 2,
                      others={"distillation teacher": qwen_32b})
    for phase in ("generate", "update"):
        assert taught[phase]["distillation teacher"] == 2 * qwen_32b.parameters / 8
        assert taught[phase].keys() - {"distillation teacher"} == phases[phase].keys()
    # a judge that does not fit beside the training state is refused, named, before anything loads
    small = ModelShape(qwen_32b.parameters // 8, *dataclasses.astuple(qwen_32b)[1:])
    with pytest.raises(ConfigError, match=r"^the generate phase needs .*\(judge grader 61\.\d"):
        check(estimate(_cfg(gpu_memory_utilization=0.3), small, None, H100, 1, 1, 2,
                       others={"judge grader": qwen_32b}), H100)
    # offloaded to host memory, the same judge costs the device two gathered blocks, and fits
    offloaded = estimate(_cfg(gpu_memory_utilization=0.3), small, None, H100, 1, 1, 2,
                         others={"judge grader": qwen_32b}, offloaded={"judge grader"})
    check(offloaded, H100)
    assert offloaded["update"]["judge grader (offloaded)"] == 2 * 2 * qwen_32b.parameters / qwen_32b.layers
    assert "judge grader" not in offloaded["update"]


def test_without_checkpointing_the_update_is_refused_naming_the_knob(qwen_32b):
    cfg = _cfg(gpu_memory_utilization=0.3)
    cfg.model.activation_checkpointing = False
    with pytest.raises(ConfigError, match=r"^the update phase needs about \d+\.\d GiB per GPU \(activations") as e:
        check(estimate(cfg, qwen_32b, None, H100, 8, 4, 2), H100)
    assert "model.activation_checkpointing=true" in str(e.value) and "run.memory_check=false" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_engine_share_the_card_cannot_hold_beside_the_training_state(qwen_32b):
    with pytest.raises(ConfigError, match=r"^the generate phase .*AdamW state 30\.5.*lower rollout.gpu_memory_util"):
        check(estimate(_cfg(gpu_memory_utilization=0.5), qwen_32b, None, H100, 8, 4, 2), H100)
    # an explicit KV cache replaces the share: the engine's weights (65.6 GB / 4) plus the cache
    phases = estimate(_cfg(kv_cache_gib=4.0), qwen_32b, None, H100, 8, 4, 2)
    assert phases["generate"]["vLLM engine"] == pytest.approx(2 * qwen_32b.parameters / 4 + 5 * GIB)
    # an engine that stays awake through the update counts there too
    phases = estimate(_cfg(sleep_during_update=False), qwen_32b, None, H100, 8, 4, 2)
    assert phases["update"]["vLLM engine"] == 0.35 * H100


def test_the_check_reads_a_model_folder_and_a_small_device_refuses(tiny_model_dir):
    from distflow.config import ModelConfig
    from distflow.distributed import DistInfo
    from distflow.distributed.layout import ParallelLayout

    cfg = DistflowConfig()
    cfg.model.dtype = "bfloat16"  # concrete, as the start-up plan resolves "auto" on CUDA
    cfg.algorithm.kl_coef, cfg.algorithm.advantage = 0.1, "gae"  # a reference and a critic
    layout = ParallelLayout.from_config(ModelConfig(path=tiny_model_dir),
                                        DistInfo(0, 1, 0, 1, torch.device("cuda", 0), "nccl"))
    phases = check_memory_budget(cfg, tiny_model_dir, layout, tiny_model_dir, device_bytes=H100)
    assert {"KL reference", "critic weights and AdamW state"} <= phases["generate"].keys()
    with pytest.raises(ConfigError, match=r"more than the device's 1\.0 GiB"):
        check_memory_budget(cfg, tiny_model_dir, layout, device_bytes=GIB)
    # nothing to check on the CPU, or when turned off
    cpu = ParallelLayout.from_config(ModelConfig(path=tiny_model_dir), DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    assert check_memory_budget(cfg, tiny_model_dir, cpu) is None
    cfg.run.memory_check = False
    assert check_memory_budget(cfg, tiny_model_dir, layout) is None


def test_a_split_runs_rollout_ranks_hold_the_engine_and_the_versions_they_stage(qwen_32b):
    """pipeline.mode=split: trainers as in a sync run but with the engine asleep through every update (it
    wakes only to validate); a rollout rank holds no training state, its engine beside the received
    versions not applied yet, each a full copy of the weights (32.8B x 2 B) whatever the engine's TP size."""
    def split(eta: int, apply: str = "staged", shape: ModelShape = qwen_32b, **rollout) -> dict:
        cfg = _cfg(**rollout)
        cfg.pipeline.mode, cfg.pipeline.rollout_ranks, cfg.pipeline.max_staleness = "split", 8, eta
        cfg.pipeline.apply = apply
        return estimate(cfg, shape, None, H100, 8, 4, 2)

    phases = split(2, kv_cache_gib=4.0, sleep_during_update=False)
    rollout = phases["rollout ranks' generate"]
    assert rollout.keys() == {"CUDA context and NCCL", "vLLM engine", "staged versions", "received bucket"}
    assert rollout["staged versions"] == 2 * 2 * qwen_32b.parameters
    assert rollout["vLLM engine"] == pytest.approx(2 * qwen_32b.parameters / 4 + 5 * GIB)
    assert "vLLM engine" not in phases["update"] and phases["generate"].keys() == split(0)["generate"].keys()
    assert split(3, "inflight")["rollout ranks' generate"]["staged versions"] == 2 * qwen_32b.parameters
    # a 32B model's staged copy (65.6 GB) leaves no room for an engine on an 80 GB card: one line, the knobs
    with pytest.raises(ConfigError, match=r"^the rollout ranks' generate phase needs about 1\d\d\.\d GiB per GPU "
                                          r"\(staged versions 122\.\d.*pipeline.staging=host"):
        check(split(2, kv_cache_gib=4.0), H100)
    seven_b = ModelShape(7_000_000_000, 3584, 28, 18944, 152064)
    check(split(2, shape=seven_b, gpu_memory_utilization=0.3), H100)  # 2 x 14 GB staged beside 24 GB of engine
    with pytest.raises(ConfigError, match=r"^the rollout ranks' generate phase .*staged versions 65\.2"):
        check(split(5, shape=seven_b, gpu_memory_utilization=0.3), H100)


def test_versions_staged_in_host_memory_leave_the_rollout_ranks_gpu_to_the_engine(qwen_32b):
    """pipeline.staging=host: the 32B split run refused above fits; its rollout ranks' GPU holds the engine
    and one broadcast bucket (64 MiB), the received versions wait in pinned host memory."""
    cfg = _cfg(kv_cache_gib=4.0)
    cfg.pipeline.mode, cfg.pipeline.rollout_ranks, cfg.pipeline.max_staleness = "split", 8, 2
    cfg.pipeline.staging = "host"
    phases = estimate(cfg, qwen_32b, None, H100, 8, 4, 2)
    check(phases, H100)
    rollout = phases["rollout ranks' generate"]
    assert rollout["staged versions"] == 0 and rollout["received bucket"] == 64 * 2**20
