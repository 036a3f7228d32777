"""A tiny reward model for the tests: a random one-label sequence classifier on the tiny model's
architecture, tokenizer and chat template, saved as an HF folder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer


def build_reward_model(tiny_model_dir: str, out: Path, seed: int = 3) -> str:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)
