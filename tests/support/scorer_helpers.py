"""A tiny reward model for the tests (a random one-label sequence classifier on the tiny model's
architecture, tokenizer and chat template, saved as an HF folder), and whether a frozen model's
FSDP2 shards are offloaded to host memory."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer


def build_reward_model(tiny_model_dir: str, out: Path, seed: int = 3) -> str:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def offloaded_shards(model: torch.nn.Module) -> bool:
    """True when every FSDP2 parameter of `model` is held by CPU offload (its shard in host memory
    between uses), False when none is; a mix is an error."""
    flags = {p.offload_to_cpu and p._sharded_param_data.device.type == "cpu"
             for m in model.modules() if isinstance(m, FSDPModule)
             for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None
             for p in group.fsdp_params}
    assert len(flags) == 1, f"offloaded and resident shards in one model: {flags}"
    return flags.pop()
