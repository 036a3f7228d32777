"""The rollout correction (distflow.algorithms.rollout_correction) against its definitions written
out here one sequence at a time in plain Python; its edge cases (empty and one-token responses,
an all-masked micro-batch, mu = pi); its metrics; the presets; and a planted mismatch: a real HF
engine sampling half the groups at a scaled temperature is masked in the fractions the
definitions predict.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from config_helpers import fp32_config
from launch_helpers import ROOT
from distflow.algorithms import POLICY_LOSSES, compute_token_loss
from distflow.algorithms.correction_metrics import CorrectionSums, correction_metrics, correction_vector
from distflow.algorithms.rollout_correction import importance_weight_sums, rollout_correction
from distflow.config import AlgorithmConfig, ConfigError, DistflowConfig, RolloutCorrectionConfig, TaskConfig
from distflow.rollout.hf_engine import HFEngine

PRESETS = sorted((ROOT / "recipes" / "rollout_correction").glob("*.yaml"))
LENS = [5, 1, 0, 6, 3, 6]  # an empty response and a one-token one among them


def rc(**kw) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(**kw)


def preset(path: Path) -> RolloutCorrectionConfig:
    return DistflowConfig.from_dict({"algorithm": {"rollout_correction": OmegaConf.to_container(
        OmegaConf.load(path))}}).algorithm.rollout_correction


def inputs(scale: float = 0.4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    width = max(LENS)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in LENS])
    old = -torch.rand(len(LENS), width, generator=g) * 3
    eng = old + scale * torch.randn(old.shape, generator=g)
    eng[0, 2] = old[0, 2] + 12.0  # one token far below: rho = e^-12 < 1e-4, the veto's case
    eng = torch.where(mask.bool(), eng, torch.tensor(-50.0))  # garbage on padding
    return old, eng, mask


def reference(old, eng, mask, c: RolloutCorrectionConfig, scale: float = 1.0) -> list[list[float]]:
    """Per-token weights of `c`, written out from the definitions (docs/algorithms.md)."""
    out = []
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        raw = [float(old[i, t]) - float(eng[i, t]) for t in range(n)]
        lr = [min(max(x, -20.0), 20.0) for x in raw]
        seq = min(max(sum(lr), -20.0), 20.0)
        geo = sum(lr) / n if n else 0.0
        rho = [math.exp(x) for x in lr]
        if c.rollout_is == "token":
            w = [min(r, c.rollout_is_threshold) * scale for r in rho]
        elif c.rollout_is == "sequence":
            w = [min(math.exp(seq), c.rollout_is_threshold) * scale] * n
        else:
            w = [1.0] * n
        keep_tok, keep_seq = [True] * n, True
        if c.rollout_rs is not None:
            upper = c.rollout_rs_threshold if c.rollout_rs_threshold is not None else c.rollout_is_threshold
            lower = c.rollout_rs_threshold_lower if c.rollout_rs_threshold_lower is not None else 1 / upper
            if c.rollout_rs == "token":
                keep_tok = [lower <= r <= upper for r in rho]
            elif c.rollout_rs == "sequence":
                keep_seq = lower <= math.exp(seq) <= upper
            elif c.rollout_rs == "geometric":
                keep_seq = lower <= math.exp(geo) <= upper
            else:
                keep_seq = (sum(r - x - 1 for r, x in zip(rho, lr)) / n if n else 0.0) <= upper
        if c.rollout_token_veto_threshold is not None and any(math.exp(x) < c.rollout_token_veto_threshold
                                                              for x in raw):
            keep_seq = False
        row = [wt * (k and keep_seq) for wt, k in zip(w, keep_tok)]
        out.append(row + [1.0] * (old.shape[1] - n))
    return out


CASES = [
    rc(), rc(rollout_is="token"), rc(rollout_is="sequence", rollout_is_threshold=3.0),
    rc(rollout_rs="token", rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.8),
    rc(rollout_rs="sequence", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.2),
    rc(rollout_rs="geometric", rollout_rs_threshold=1.05),
    rc(rollout_rs="k3", rollout_rs_threshold=0.05),
    rc(rollout_token_veto_threshold=1e-4),
    rc(rollout_is="token", rollout_is_threshold=5.0, rollout_rs="token", rollout_rs_threshold=5.0,
       rollout_rs_threshold_lower=0.5),
    rc(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_token_veto_threshold=1e-4),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"is={c.rollout_is},rs={c.rollout_rs},veto="
                                                    f"{c.rollout_token_veto_threshold}")
def test_weights_equal_the_definitions(c):
    old, eng, mask = inputs()
    got = rollout_correction(old, eng, mask, c).weight
    torch.testing.assert_close(got, torch.tensor(reference(old, eng, mask, c)), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(got).all() and not got.requires_grad


def test_every_mode_fires_on_these_inputs():
    """The cases above are not vacuous: each rejection masks some sequences and keeps others."""
    old, eng, mask = inputs()
    for c in CASES[3:8]:
        w = rollout_correction(old, eng, mask, c).weight
        zero = ((w == 0) & mask.bool()).any(-1)
        has = mask.bool().any(-1)
        assert zero.any() and (has & ~zero).any(), c


def test_batch_normalisation_divides_by_the_mean_weight():
    old, eng, mask = inputs()
    for level in ("token", "sequence"):
        c = rc(rollout_is=level, rollout_is_batch_normalize=True)
        total, count = importance_weight_sums(old, eng, mask, c)
        w = [row[:n] for row, n in zip(reference(old, eng, mask, c), LENS)]
        flat = [x for row in w for x in row] if level == "token" else [row[0] for row in w if row]
        assert float(count) == len(flat) and float(total) == pytest.approx(sum(flat), rel=1e-6)
        scale = len(flat) / sum(flat)
        got = rollout_correction(old, eng, mask, c, scale).weight
        torch.testing.assert_close(got, torch.tensor(reference(old, eng, mask, c, scale)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_mu_equal_pi_gives_todays_loss_exactly(path):
    """fp32, one optimizer step: the engine's logprobs equal the policy's, so every preset's loss
    is exactly the uncorrected one (weights are exp(0) = 1, every band holds 1). Decoupled presets
    also keep today's loss at a later pass, where pi moved from pi_old (rho = pi_old / mu = 1)."""
    old, _, mask = inputs()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    a = AlgorithmConfig(rollout_correction=preset(path))
    moved = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    for logp in [old.clone()] + ([] if a.rollout_correction.bypass_mode else [moved]):
        logp.requires_grad_()
        plain, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask, AlgorithmConfig())
        loss, info = compute_token_loss(logp, old, adv, mask, a, engine_logp=old.clone())
        assert torch.equal(loss, plain), path.stem
        assert not info["correction"].clipped.any() and info["correction"].kept.all()


def test_bypass_takes_the_engine_as_the_old_policy():
    old, eng, mask = inputs(scale=0.1)
    eng = torch.where(mask.bool(), eng, 0.0)
    logp = old.clone().requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    a = AlgorithmConfig(rollout_correction=rc(bypass_mode=True))
    loss, info = compute_token_loss(logp, old, adv, mask, a, engine_logp=eng)
    expect, _ = POLICY_LOSSES["ppo_clip"](logp, eng, adv, mask, a)
    assert torch.equal(loss, expect)
    # its rejections read rho = sg(pi) / mu
    a = AlgorithmConfig(rollout_correction=rc(bypass_mode=True, rollout_rs="geometric", rollout_rs_threshold=1.02))
    _, info = compute_token_loss(logp, old + 5.0, adv, mask, a, engine_logp=eng)
    torch.testing.assert_close(info["correction"].log_rho, torch.where(mask.bool(), old - eng, 0.0))


def test_all_masked_micro_batch_gives_exact_zeros():
    old, eng, mask = inputs(scale=3.0)
    logp = old.clone().requires_grad_()
    adv = torch.ones(len(LENS))
    a = AlgorithmConfig(rollout_correction=rc(rollout_rs="geometric", rollout_rs_threshold=1.0 + 1e-9,
                                              rollout_rs_threshold_lower=1.0 - 1e-9,
                                              rollout_token_veto_threshold=1e-4))
    loss, info = compute_token_loss(logp, old, adv, mask, a, engine_logp=eng)
    has = mask.bool().any(-1)
    assert not info["correction"].seq_kept[has].any()
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    # no token at all: a padding-only micro-batch
    z = torch.zeros(2, 3)
    loss, _ = compute_token_loss(z.clone().requires_grad_(), z, torch.ones(2), z, a, engine_logp=z)
    assert torch.equal(loss, torch.zeros_like(loss))


def test_metrics_equal_their_definitions_and_add_over_parts():
    old, eng, mask = inputs()
    c = rc(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="geometric", rollout_rs_threshold=1.05,
           rollout_token_veto_threshold=1e-4)
    budget = 6
    whole = correction_metrics(correction_vector(rollout_correction(old, eng, mask, c), mask, budget).tolist())
    parts = CorrectionSums()
    for rows in ([0, 1, 2], [3, 4, 5]):
        corr = rollout_correction(old[rows], eng[rows], mask[rows], c)
        parts = parts + CorrectionSums(correction_vector(corr, mask[rows], budget).tolist())
    assert correction_metrics(parts.values) == pytest.approx(whole, rel=1e-12)
    w = reference(old, eng, mask, c)
    toks = [(i, t) for i, n in enumerate(LENS) for t in range(n)]
    lr = {(i, t): min(max(float(old[i, t] - eng[i, t]), -20), 20) for i, t in toks}
    rho = [math.exp(lr[k]) for k in toks]
    seqs = [i for i, n in enumerate(LENS) if n]
    masked_seqs = [i for i in seqs if all(w[i][t] == 0 for t in range(LENS[i]))]
    ws = [w[i][t] for i, t in toks]
    expect = {
        "rollout_corr/rho_mean": sum(rho) / len(rho), "rollout_corr/rho_max": max(rho),
        "rollout_corr/seq_log_ratio_mean": sum(sum(lr[(i, t)] for t in range(LENS[i])) for i in seqs) / len(seqs),
        "rollout_corr/tokens_masked_frac": sum(x == 0 for x in ws) / len(ws),
        "rollout_corr/seqs_masked_frac": len(masked_seqs) / len(seqs),
        "rollout_corr/tokens_clipped_frac": sum(r > 1.5 for r in rho) / len(rho),
        "rollout_corr/weight_mean": sum(ws) / len(ws),
        "rollout_corr/ess": sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws)),
    }
    for key, value in expect.items():
        assert whole[key] == pytest.approx(value, rel=1e-6), key
    assert 0 < expect["rollout_corr/seqs_masked_frac"] < 1
    # by length: quarter k of the budget (6 tokens): lengths 1 -> q1, 3 -> q3, 5 -> q4, 6 -> q4
    assert [whole[f"rollout_corr/len_q{k}/seqs"] for k in (1, 2, 3, 4)] == [1, 0, 1, 3]
    q4 = [i for i in seqs if LENS[i] >= 5]
    assert whole["rollout_corr/len_q4/seqs_masked_frac"] == pytest.approx(
        sum(i in masked_seqs for i in q4) / len(q4))
    sorted_rho = sorted(rho)
    exact_p99 = sorted_rho[math.ceil(0.99 * len(rho)) - 1]
    assert exact_p99 <= whole["rollout_corr/rho_p99"] <= math.exp(math.log(exact_p99) * 1.13) + 1e-9


def test_metrics_by_version_lag_equal_their_definitions():
    """Tokens of older policy versions (carried over): each lag's tokens, masked fraction, weight mean
    and max and ESS, from the final weights; lag 3 holds the older ones too; the parts combine (sums
    add, maxima by max) into the whole; a lag without tokens is not reported."""
    old, eng, mask = inputs()
    c = rc(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold=1.4,
           rollout_rs_threshold_lower=0.6)
    lag = torch.tensor([[(i + t) % 3 + (i == 5) * 2 for t in range(mask.shape[1])] for i in range(len(LENS))])
    corr = rollout_correction(old, eng, mask, c)
    whole = correction_metrics(correction_vector(corr, mask, 6, lag).tolist())
    parts = CorrectionSums()
    for rows in ([0, 1, 2], [3, 4, 5]):
        part = rollout_correction(old[rows], eng[rows], mask[rows], c)
        parts = parts + CorrectionSums(correction_vector(part, mask[rows], 6, lag[rows]).tolist())
    assert correction_metrics(parts.values) == pytest.approx(whole, rel=1e-12)
    w = reference(old, eng, mask, c)
    by = {}
    for i, n in enumerate(LENS):
        for t in range(n):
            by.setdefault(min(int(lag[i, t]), 3), []).append(w[i][t])
    assert set(by) == {0, 1, 2, 3} and not any(k.startswith("rollout_corr/lag4") for k in whole)
    for k, ws in by.items():
        assert whole[f"rollout_corr/lag{k}/tokens"] == len(ws)
        assert whole[f"rollout_corr/lag{k}/tokens_masked_frac"] == pytest.approx(sum(x == 0 for x in ws) / len(ws))
        assert whole[f"rollout_corr/lag{k}/weight_mean"] == pytest.approx(sum(ws) / len(ws), rel=1e-6)
        assert whole[f"rollout_corr/lag{k}/weight_max"] == pytest.approx(max(ws), rel=1e-6)
        assert whole[f"rollout_corr/lag{k}/ess"] == pytest.approx(sum(ws) ** 2 / (len(ws) * sum(x * x for x in ws)),
                                                                  rel=1e-6)
    assert 0 < whole["rollout_corr/tokens_masked_frac"] < 1
    # without versions every token is lag 0, and lag 0 is the whole
    plain = correction_metrics(correction_vector(corr, mask, 6).tolist())
    assert plain["rollout_corr/lag0/weight_mean"] == pytest.approx(plain["rollout_corr/weight_mean"], rel=1e-12)
    assert not any(k.startswith(("rollout_corr/lag1", "rollout_corr/lag2", "rollout_corr/lag3")) for k in plain)


def test_metrics_with_mu_equal_pi_are_exact():
    old, _, mask = inputs()
    m = correction_metrics(correction_vector(rollout_correction(old, old, mask, rc()), mask, 6).tolist())
    assert m["rollout_corr/rho_mean"] == m["rollout_corr/rho_p99"] == m["rollout_corr/rho_max"] == 1.0
    assert m["rollout_corr/tokens_masked_frac"] == m["rollout_corr/seq_log_ratio_mean"] == 0.0
    assert m["rollout_corr/ess"] == m["rollout_corr/weight_mean"] == 1.0


def test_presets_validate_and_the_old_key_still_works():
    names = {p.stem for p in PRESETS}
    assert {"metrics", "token_tis", "seq_tis", "seq_mis", "icepop", "geo_rs", "bypass", "bypass_geo_rs"} <= names
    for path in PRESETS:
        DistflowConfig(algorithm=AlgorithmConfig(rollout_correction=preset(path)),
                       task=TaskConfig(path="data.jsonl")).validate()
    assert not preset(ROOT / "recipes" / "rollout_correction" / "metrics.yaml").active
    from distflow.config import rename_overrides

    args, notes = rename_overrides(["algorithm.tis_cap=1.5", "algorithm.tis_cap=null"])
    assert args == ["algorithm.rollout_correction.rollout_is=token",
                    "algorithm.rollout_correction.rollout_is_threshold=1.5",
                    "algorithm.rollout_correction.rollout_is=null"]
    assert len(notes) == 1 and "rollout_is=token" in notes[0]


def test_carryover_needs_a_correction():
    cfg = DistflowConfig(task=TaskConfig(path="data.jsonl"))
    cfg.pipeline.mode, cfg.pipeline.max_staleness = "carryover", 1
    with pytest.raises(ConfigError, match="rollout_correction=token_tis"):
        cfg.validate()
    for c in (rc(rollout_is="token"), rc(rollout_rs="geometric", rollout_rs_threshold=1.001), rc(bypass_mode=True)):
        cfg.algorithm.rollout_correction = c
        cfg.validate()


# ----------------------------------------------------------------------------- a planted mismatch

PLANT_T = 0.3  # the perturbed engine's temperature: its logits scaled by 1 / 0.3


@pytest.fixture(scope="module")
def planted(tiny_model_dir):
    """8 groups of 4 from a real HF engine (fp32): groups 0-3 at temperature 1 (mu = pi up to float
    rounding), groups 4-7 from an engine at temperature 0.3 (scaled logits); pi from a plain
    transformers forward at temperature 1."""
    from transformers import AutoModelForCausalLM

    samples = []
    for temperature, first in ((1.0, 0), (PLANT_T, 4)):
        cfg = fp32_config()
        cfg.rollout.temperature, cfg.rollout.max_new_tokens = temperature, 12
        engine = HFEngine(tiny_model_dir, cfg.model, cfg.rollout, torch.device("cpu"))
        prompts = [[5 + k, 9 + 2 * k, 17 + k] for k in range(first, first + 4)]
        samples += [s for group in engine.generate(prompts, 4, [100 + k for k in range(first, first + 4)])
                    for s in group]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    width = max(len(s.response_ids) for s in samples)
    pi, mu, mask = (torch.zeros(len(samples), width) for _ in range(3))
    with torch.no_grad():
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            n, p = len(s.response_ids), len(s.prompt_ids)
            pi[i, :n] = lp[p - 1:p - 1 + n].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
            mu[i, :n], mask[i, :n] = torch.tensor(s.logprobs), 1.0
    perturbed = torch.arange(len(samples)) >= 16
    return pi, mu, mask, perturbed


def test_planted_mismatch_is_masked_as_the_definitions_predict(planted):
    pi, mu, mask, perturbed = planted
    m = mask.bool()
    diff = (pi - mu).abs()[m & ~perturbed[:, None]]
    assert float(diff.max()) < 1e-4  # the unperturbed half: mu = pi up to float rounding
    log_rho = torch.where(m, pi - mu, 0.0)
    n = mask.sum(-1)
    geo = log_rho.sum(-1) / n
    # Geo-RS [0.999, 1.001]: predicted = the sequences whose mean |log rho| leaves the band: every
    # perturbed one (a temperature of 0.3 moves each token's logprob by far more), no other
    predicted = (geo.exp() < 0.999) | (geo.exp() > 1.001)
    assert torch.equal(predicted, perturbed)
    two_sided = RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=2.0)  # [0.5, 2]
    for name in ("geo_rs", "seq_mis", "two_sided", "icepop"):
        c = two_sided if name == "two_sided" else preset(ROOT / "recipes" / "rollout_correction" / f"{name}.yaml")
        corr = rollout_correction(pi, mu, mask, c)
        metrics = correction_metrics(correction_vector(corr, mask, 12).tolist())
        masked_tok = m & ~corr.kept
        assert not masked_tok[~perturbed].any(), name  # the engine that matches is never masked
        seq_ratio = [math.exp(max(min(float(log_rho[i].sum()), 20.0), -20.0)) for i in range(len(n))]
        if name == "geo_rs":
            assert metrics["rollout_corr/seqs_masked_frac"] == 0.5
        elif name == "seq_mis":  # TRL's one-sided band: prod rho > 3. A sharper engine (mu above pi on
            # the tokens it picks) gives rho < 1 and is never masked by it: the predicted fraction is 0
            expect = sum(r > 3.0 for r in seq_ratio)
            assert metrics["rollout_corr/seqs_masked_frac"] == expect / len(n)
        elif name == "two_sided":  # prod rho outside [0.5, 2]
            expect = sum(not (0.5 <= r <= 2.0) for r in seq_ratio)
            assert metrics["rollout_corr/seqs_masked_frac"] == expect / len(n) > 0.25
        else:  # rho_t outside [0.5, 5]
            rho = [math.exp(float(log_rho[i, t])) for i in range(len(n)) for t in range(int(n[i]))]
            expect = sum(not (0.5 <= r <= 5.0) for r in rho)
            assert metrics["rollout_corr/tokens_masked_frac"] == pytest.approx(expect / len(rho))
            assert expect > 0
