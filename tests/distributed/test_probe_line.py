"""The start-up probe's one line: the statistic the stop applies to (the max over every rank), the
mean over every rank's tokens, the dtype and its bound, and whether the value is within it; past
the bound the run's single line is the mismatch warning (or the stop), never a second one.

Real gloo ranks, the HF engine and the FSDP2 policy of the tiny model, and real prompts.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from config_helpers import fp32_config
from dist_helpers import gathered, run_distributed
from distflow.probe import PROBE_LIMIT, start_line

LINE = re.compile(r"start-up probe \(float32\): max \|engine - policy\| logprob (\S+), mean (\S+), "
                  r"within the float32 bound 0\.001")


def _worker(rank, world, model_dir):
    from transformers import AutoTokenizer

    from distflow.distributed.layout import ParallelLayout
    from distflow.probe import EngineProbe
    from distflow.rollout import build_engine
    from distflow.tasks.prompts import PromptEncoder, PromptItem
    from distflow.train.policy import Policy

    cfg = fp32_config()
    cfg.rollout.engine = "hf"
    cfg.run.allow_engine_mismatch = True
    tok = AutoTokenizer.from_pretrained(model_dir)
    encode = PromptEncoder(tok)
    questions = [f"What is {rank + 3} + {k}?" for k in range(3)]  # each rank its own prompts
    items = [PromptItem(*encode([{"role": "user", "content": q}]), "0", {}) for q in questions]
    engine = build_engine(model_dir, cfg.model, cfg.rollout, torch.device("cpu"), seed=0)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    probe = EngineProbe(engine, policy, cfg.run, "float32", tok.pad_token_id)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("distflow")
    log.addHandler(handler)
    old_level, log.level = log.level, logging.INFO
    try:
        healthy = probe.at_start(items)
        lines = [(r.levelname, r.getMessage()) for r in records]
        records.clear()
        with torch.no_grad():  # the policy moves, the engine keeps the old weights: a stale engine
            for p in policy.model.parameters():
                p.to_local().add_(torch.randn(p.to_local().shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        stale = probe.at_start(items)
        stale_lines = [(r.levelname, r.getMessage()) for r in records]
    finally:
        log.removeHandler(handler)
        log.level = old_level
    engine.shutdown()
    return gathered({"healthy": healthy, "lines": lines, "stale": stale, "stale_lines": stale_lines})


def test_the_start_up_line_names_max_mean_dtype_and_bound(tiny_model_dir):
    ranks = run_distributed(_worker, 2, tiny_model_dir, timeout=600)
    assert ranks[0]["lines"] == ranks[1]["lines"], ranks  # every rank reports the same all-rank values
    for r in ranks:
        ((level, line),) = r["lines"]
        match = LINE.fullmatch(line)
        assert level == "INFO" and match, line
        top, mean = float(match.group(1)), float(match.group(2))
        assert top == pytest.approx(r["healthy"], rel=1e-2) and 0 <= mean <= top <= 1e-5, line
        # past the bound: the one warning line and nothing else
        ((level, line),) = r["stale_lines"]
        assert level == "WARNING" and line.startswith("start-up: the engine's logprobs differ from the policy's by up to ")
        assert "(qwen2, float32; at most 0.001 expected)" in line and r["stale"] > PROBE_LIMIT["float32"], line


def test_the_bfloat16_line_reads_as_within_its_bound():
    assert start_line(0.418, 0.0312, "bfloat16") == (
        "start-up probe (bfloat16): max |engine - policy| logprob 0.418, mean 0.0312, within the bfloat16 bound 3")
    assert start_line(9.5367e-07, 1.2e-07, "float32").endswith("logprob 9.54e-07, mean 1.2e-07, within the float32 "
                                                                "bound 0.001")
