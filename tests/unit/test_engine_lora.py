"""The vLLM engine's LoRA set-up for model.lora.resync=adapter: LoRA slots for the adapter's target
layers only (not the embedding or the LM head, which vLLM would adapt too), and a mixture-of-experts
model refused on CPU. The engines themselves (the adapter resync, and the refusal before an engine
loads) are checked family by family in tests/distributed/test_model_families.py."""

from __future__ import annotations

import pytest

from config_helpers import fp32_config
from model_families import _config

from distflow.config import ConfigError
from distflow.rollout.vllm_engine import check_adapter_resync, lora_targets


def family_config(model_type: str):
    """The tiny family's config (tests/support/model_families.py), without building the model."""
    return _config(model_type, 128, dict(bos_token_id=0, eos_token_id=1, pad_token_id=0))


def _model_cfg(*targets: str):
    cfg = fp32_config()
    cfg.model.lora.enabled, cfg.model.lora.resync, cfg.model.lora.target_modules = True, "adapter", list(targets)
    return cfg


@pytest.mark.parametrize("family,want", [
    ("llama", ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("phi3", ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),  # fused in the checkpoint, as in vLLM
    ("qwen3_moe", ["k_proj", "o_proj", "q_proj", "v_proj"]),  # fused experts are no nn.Linear: not targeted
])
def test_the_engine_adapts_the_default_targets_only(family, want):
    assert lora_targets(family_config(family), _model_cfg().model) == want


def test_named_targets_become_leaf_names():
    cfg = _model_cfg("self_attn.q_proj", "v_proj", "mlp.down_proj")
    assert lora_targets(family_config("llama"), cfg.model) == ["down_proj", "q_proj", "v_proj"]


def test_mixture_of_experts_adapters_are_refused_on_cpu_only():
    for family in ("qwen3_moe", "mixtral"):
        with pytest.raises(ConfigError, match="use model.lora.resync=merged$") as info:
            check_adapter_resync(family_config(family), on_cpu=True)
        assert "\n" not in str(info.value) and family in str(info.value)
        check_adapter_resync(family_config(family), on_cpu=False)  # vLLM's Triton kernel runs on CUDA
    check_adapter_resync(family_config("llama"), on_cpu=True)

