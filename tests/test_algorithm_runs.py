"""Every algorithm config runs the smoke experiment end to end on 2 ranks, and DAPO's dynamic
sampling keeps ranks in step when their kept-group counts differ."""

import math

import pytest

from launch_helpers import ROOT, read_metrics, torchrun

ALGORITHMS = sorted(p.stem for p in (ROOT / "recipes" / "algorithm").glob("*.yaml"))
SPECIFIC = {
    "dapo": ["dynamic_sampling/kept_groups", "dynamic_sampling/rounds"],
    "ppo": ["value/loss", "value/clip_fraction", "value/mean", "critic/grad_norm"],
}


def _smoke(tmp_path, *overrides, steps=2):
    out = tmp_path / "run"
    proc = torchrun(["experiment=smoke", "rollout=hf", f"trainer.steps={steps}", f"trainer.output_dir={out}",
                     "trainer.plot_at_end=false", *overrides])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(out)
    # one row per step: per-row checks in the tests below never run over a missing or short file
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    return rows, proc


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_runs_smoke(tmp_path, algorithm):
    rows, _ = _smoke(tmp_path, f"algorithm={algorithm}", "task.reward=rewards_for_tests:digit_fraction")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["loss/policy", "clip/fraction_low", "clip/fraction_high", *SPECIFIC.get(algorithm, [])]:
        assert key in rows[-1], (algorithm, key)
    assert all(r["sync/max_abs_logprob_diff"] <= 1e-5 for r in rows)


@pytest.mark.slow
def test_kl_entropy_tis_and_dual_clip_metrics(tmp_path):
    # tis_cap below 1 makes the cap bind: the engine samples with the policy's own weights (the
    # sync probe checks them to 1e-5), so every token's pi_old / pi_engine is ~1, above the cap.
    tis_cap = 0.99
    rows, _ = _smoke(tmp_path, "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01", f"algorithm.tis_cap={tis_cap}",
                     "algorithm.dual_clip_c=3.0", "task.reward=rewards_for_tests:digit_fraction")
    for key in ["loss/kl", "loss/entropy", "tis/mean_weight", "clip/fraction_dual"]:
        assert key in rows[-1], key
    assert rows[-1]["loss/entropy"] > 0
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert rows[-1]["loss/kl"] > 0
    for r in rows:
        weight, dual = r["tis/mean_weight"], r["clip/fraction_dual"]
        assert math.isfinite(weight) and 0 < weight <= tis_cap + 1e-6, r
        assert math.isfinite(dual) and 0.0 <= dual <= 1.0, r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5, r
        # the cap fired on every trained token (a token whose engine logprob were misaligned
        # with the trainer's would have a ratio far from 1 and pull the mean below the cap)
        assert weight == pytest.approx(tis_cap, abs=1e-5), r
        # one on-policy update per step: the ratio is exactly 1, inside the clip range and below
        # the dual-clip bound c = 3 > 1, so no token may be flagged by any clip
        assert dual == 0.0 and r["clip/fraction_low"] == 0.0 and r["clip/fraction_high"] == 0.0, r


@pytest.mark.slow
def test_dynamic_sampling_with_an_empty_rank(tmp_path):
    # rank 1's groups always have equal rewards: it keeps nothing and must still run the same
    # number of FSDP passes as rank 0. Rank 0 keeps at most 2 groups a round, so reaching the
    # global target of 4 takes at least 2 rounds (or all 3 when some of its groups tie too).
    rows, _ = _smoke(tmp_path, "algorithm=dapo", "task.reward=rewards_for_tests:flat_on_rank1")
    for r in rows:
        assert r["dynamic_sampling/rounds"] >= 2
        assert r["dynamic_sampling/kept_groups"] >= 4 or r["dynamic_sampling/rounds"] == 3
        assert r["dynamic_sampling/generated_groups"] == 4 * r["dynamic_sampling/rounds"]
        assert r["update/skipped"] == 0
        assert r["grad_norm"] > 0


@pytest.mark.slow
def test_everything_filtered_skips_the_update(tmp_path):
    rows, proc = _smoke(tmp_path, "algorithm=dapo", "algorithm.max_sampling_rounds=2",
                        "task.reward=rewards_for_tests:constant")
    assert "every group was filtered out; update skipped" in proc.stdout
    for r in rows:
        assert r["update/skipped"] == 1 and r["dynamic_sampling/kept_groups"] == 0
        assert r["dynamic_sampling/rounds"] == 2


@pytest.mark.parametrize("override,needle", [
    ("algorithm.group_size=1", "group_size"),
    ("algorithm.clip_eps_high=0.1", "clip_eps"),
    ("algorithm.loss_agg_mode=bogus", "loss_agg_mode"),
    ("algorithm.kl_coef=-1", "kl_coef"),
])
def test_incompatible_settings_fail_before_loading(tmp_path, override, needle):
    proc = torchrun(["experiment=smoke", override, f"trainer.output_dir={tmp_path}"], timeout=180,
                    torchrun_args=["--monitor-interval=15"])
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("distflow: error:")]
    assert len(errors) == 2 and all(needle in e for e in errors), errors
    assert "Loading weights" not in proc.stderr  # failed before any model was loaded
