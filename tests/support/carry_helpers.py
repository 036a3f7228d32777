"""The carry-over driver over a few steps, on any step-wise engine: what the driver tests share."""

from __future__ import annotations

from config_helpers import fp32_config
from distflow.tasks.prompts import PromptItem

G, PER_STEP = 2, 3
# a long tail: most groups are short, every fourth long
LENGTHS = {p: (24 if p % 4 == 3 else 3 + p % 3) for p in range(64)}


def carry_config(eta: int, concurrency: int | None = None):
    cfg = fp32_config()
    cfg.algorithm.group_size, cfg.rollout.max_new_tokens = G, 24
    cfg.pipeline.mode, cfg.pipeline.max_staleness, cfg.pipeline.max_concurrency = "carryover", eta, concurrency
    return cfg


def item(position: int) -> PromptItem:
    return PromptItem([5 + position % 40, 17, 42, 7 + position % 3], "", "", {})


def admitted(driver, step: int) -> list[int]:
    """The positions a step admits: the first eta steps' quotas ahead at step 1, one quota after."""
    start = 0 if step == 1 else PER_STEP * (step - 1 + driver.eta)
    return list(range(start, start + driver.admits(step, PER_STEP, True)))


def run_steps(engine, driver, steps: int, resync, first_step: int = 1) -> list[tuple[dict, dict]]:
    """Steps of the driver, `resync(engine, version)` after each; per step the trained groups
    {position: samples} and the step's counts."""
    out = []
    for step in range(first_step, first_step + steps):
        positions = admitted(driver, step)
        done = driver.round(step, positions, [item(p) for p in positions], PER_STEP)
        counts = driver.end_step(step)
        assert engine.pending() == 0  # the engine is empty at every boundary
        out.append(({p: g for p, g in zip(done.positions, done.groups)}, counts))
        resync(engine, step)
    return out


def key(samples) -> list[tuple]:
    return [(s.prompt_ids, s.response_ids, s.logprobs, s.truncated, s.versions) for s in samples]


def moved_weights(engine, seed: int) -> tuple[dict, dict]:
    """The engine's weights now, and a copy moved by 0.05 x N(0, 1) noise (another version's)."""
    import torch

    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    return original, {n: p + 0.05 * torch.randn(p.shape, generator=gen) for n, p in original.items()}


def model_logprobs(engine, weights: dict, sample) -> list[float]:
    """`sample`'s response logprobs under `weights`, one fresh forward (the engine keeps its version number)."""
    engine.load_weights(iter(weights.items()), engine.version)
    return engine.prompt_logprobs([sample.prompt_ids + sample.response_ids])[0][len(sample.prompt_ids) - 1:]

