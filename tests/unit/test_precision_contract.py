"""The precision contract between engine and trainer (distflow.rollout.precision): the HF engine's
LM head computes in float32 exactly when the trainer's does, stays so across weight loads, and
start-up names where the run depends on their difference. vLLM's float32 head is vLLM's own
option (hf_overrides head_dtype), checked end to end by bench/precision.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from config_helpers import fp32_config
from distflow.rollout.hf_engine import HFEngine
from distflow.rollout.precision import contract_lines

CPU = torch.device("cpu")


def _engine(model_dir, dtype: str, head32: bool) -> HFEngine:
    cfg = fp32_config()
    cfg.model.dtype, cfg.model.logprob_head_float32 = dtype, head32
    return HFEngine(model_dir, cfg.model, cfg.rollout, CPU)


def _logits_and_hidden(engine: HFEngine, ids: torch.Tensor):
    out = engine.model(input_ids=ids, output_hidden_states=True)
    return out.logits, out.hidden_states[-1]


@torch.no_grad()
def test_hf_engine_head_is_float32_exactly_when_the_trainers_is(tiny_model_dir):
    ids = torch.tensor([[3, 17, 42, 9, 25]])
    bf16 = _engine(tiny_model_dir, "bfloat16", True)
    logits, hidden = _logits_and_hidden(bf16, ids)
    head = bf16.model.get_output_embeddings()
    assert logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    assert torch.equal(logits, F.linear(hidden.float(), head.weight.float()))  # the trainer's chunked head
    # a weight load refreshes the float32 copy
    name = next(n for n, p in bf16.model.named_parameters() if p is head.weight)
    bf16.load_weights([(name, head.weight * 2)], version=1)
    logits2, hidden2 = _logits_and_hidden(bf16, ids)
    assert torch.equal(logits2, F.linear(hidden2.float(), head.weight.float())) and not torch.equal(logits2, logits)
    # no float32 head where the trainer has none, or nothing to change
    for dtype, head32 in (("bfloat16", False), ("float32", True)):
        e = _engine(tiny_model_dir, dtype, head32)
        assert e.head32 is None
        assert _logits_and_hidden(e, ids)[0].dtype == getattr(torch, dtype)


def test_start_up_names_what_cannot_match():
    cfg = fp32_config()
    cfg.algorithm.rollout_correction.bypass_mode = True
    assert contract_lines(cfg) == []  # float32: the sides agree to rounding
    cfg.model.dtype = "bfloat16"
    (line,) = contract_lines(cfg)
    assert "bypass_mode clips the PPO ratio against the bf16 engine" in line
    cfg.algorithm.rollout_correction.bypass_mode = False
    for engine in ("vllm", "hf"):  # both engines compute the head as the trainer does
        cfg.rollout.engine = engine
        assert contract_lines(cfg) == []
