"""Packed shared-prefix rows (distflow.train.shared_prefix) compute what padded rows compute.

Groups of 4 responses to prompts of different lengths (one empty response, multi-turn
observation tokens, truncated samples) go through the real FSDP2 policy and critic in float32 on
1 and 2 gloo ranks, once packed (optim.shared_prefix=on) and once padded (off), on the same
weights: logprobs, entropy, the reference's logprobs, values, the KL, the clip counts, the loss
and every parameter's gradient agree to rel. 1e-5, for GRPO, DAPO, PPO with a critic,
REINFORCE++, GSPO and Dr. GRPO composed from their recipes (old logprobs off the current ones,
so the clips are active), for LoRA adapters under activation checkpointing, for a token budget
smaller than one group (split into units that each carry the prompt again) and for a rank left
without samples; 2 packed ranks also equal 1 padded rank. One launch per world size runs every
case, building each model once.

Without processes: the planner and the packer on hand-checked examples and random ones, the
attention function against dense attention over the whole row (sliding window and soft cap
included), and the size of the masks at a long-response shape (no model is run).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.sdpa_attention import repeat_kv

from config_helpers import compose
from dist_helpers import gathered, run_distributed
from grad_helpers import assert_grads_close, full_grads, update_batch
from distflow.algorithms import AdvantageInputs, gae_advantages
from distflow.algorithms.correction_metrics import HEAD
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.sample import Sample
from distflow.train.batch import TokenBatch, UpdateBatch
from distflow.train.critic import Critic
from distflow.train.policy import Policy
from distflow.train.shared_prefix import (
    PackedRows,
    RowTokens,
    group_chunks,
    pack,
    plan_packed,
    row_tokens,
    shared_prefix_attention,
    unit_tokens,
)
from distflow.train.update import Updater

CPU = torch.device("cpu")
G = 4
# (prompt length, response lengths) of each group: an empty response, prompts of four lengths
GROUPS = [(5, [6, 0, 9, 4]), (11, [3, 7, 7, 2]), (3, [10, 1, 5, 8]), (8, [4, 4, 12, 6])]
# multi-turn episodes: 0 marks the observation tokens an environment appended between turns
MULTI_TURN = {(2, 0): [1, 1, 0, 0, 1, 1, 1, 0, 1, 1], (2, 3): [1, 0, 0, 1, 1, 1, 1, 1],
              (3, 2): [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1]}
BUDGET = 30  # packed tokens per micro-batch in the split case: below the largest group's prompt + responses
CASES = {  # name: (recipe overrides, options)
    "grpo": (["algorithm=grpo", "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01",
              "optim.micro_batch_size=3"], {}),
    # clip-higher, the overlong filter (truncated samples out of the loss), dual clip and TIS,
    # mini-batches, and a budget that splits a group
    "dapo": (["algorithm=dapo", "algorithm.overlong_filter=true", "algorithm.entropy_coef=0.01",
              "algorithm.dual_clip_c=3.0", "rollout_correction=token_tis", f"optim.micro_batch_tokens={BUDGET}",
              "optim.mini_batches=2"], {}),
    # the critic's values, GAE advantages and the clipped value loss; the plain (unchunked) head
    "ppo": (["algorithm=ppo", "algorithm.entropy_coef=0.01", "critic.value_clip=0.02",
             "model.logprob_chunk_tokens=0"], {"critic": True}),
    "reinforce_pp": (["algorithm=reinforce_pp", "algorithm.kl_coef=0.02", "algorithm.kl_estimator=k2",
                      "algorithm.entropy_coef=0.01", "rollout.temperature=0.7", "optim.micro_batch_tokens=64"], {}),
    # the sequence-level ratio: its clip range is 3e-4 / 4e-4, so the old logprobs move less
    "gspo": (["algorithm=gspo", "algorithm.entropy_coef=0.01"], {"old_scale": 1e-3}),
    # the reference is the base (adapters off), computed packed as well
    "lora": (["algorithm=grpo", "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01", "model.lora.enabled=true",
              "model.activation_checkpointing=true", f"optim.micro_batch_tokens={BUDGET}"], {"lora": True}),
    # rank 1 holds nothing (dynamic sampling can leave a rank empty): it runs padding passes only;
    # Dr. GRPO's token sum over a constant length
    "empty_rank": (["algorithm=drgrpo", "algorithm.entropy_coef=0.01"], {"groups": [0, 2], "one_rank": True}),
}
METRICS = ("loss", "tokens", "kl", "entropy", "clip_low", "clip_high", "dual_clip")
CORRECTION = ("weight_sum", "rho_sum", "tokens_clipped")  # the rollout correction's sums (correction_metrics)
COUNTS = ("tokens", "clip_low", "clip_high", "dual_clip", "value_clipped", "value_tokens", "tokens_clipped")
VALUE_METRICS = ("value_loss", "value_clipped", "value_sum", "value_tokens")


@pytest.fixture(scope="module")
def cases():
    """Each case's config, composed from its recipe as recipes/grpo.py does, in float32."""
    out = {}
    for name, (overrides, opts) in CASES.items():
        cfg = compose(overrides)
        cfg.model.dtype = "float32"
        out[name] = (cfg, opts)
    return out


def _groups() -> list[list[Sample]]:
    """GROUPS as samples: G responses per prompt; each group's longest response was truncated."""
    g = torch.Generator().manual_seed(11)
    out = []
    for gi, (p_len, lens) in enumerate(GROUPS):
        prompt = torch.randint(3, 200, (p_len,), generator=g).tolist()
        group = []
        for j, r in enumerate(lens):
            response = torch.randint(3, 200, (r,), generator=g).tolist()
            engine = (-5.0 + 0.3 * torch.randn(r, generator=g)).tolist()
            group.append(Sample(prompt, response, engine, r == max(lens), MULTI_TURN.get((gi, j))))
        out.append(group)
    return out


def _held(rank: int, world: int, opts: dict) -> list[int]:
    """The groups a rank holds: every world-th one, so that mini-batch m of 2 ranks (rows
    [m*k, (m+1)*k) of each) holds the groups mini-batch m of 1 rank does."""
    groups = opts.get("groups", list(range(len(GROUPS))))
    if opts.get("one_rank"):
        return groups if rank == 0 else []
    return groups[rank::world]


def _noise(sid: int, kind: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * kind + sid))


def _with(cfg, shared_prefix: str):
    cfg = copy.deepcopy(cfg)
    cfg.optim.shared_prefix = shared_prefix
    return cfg


def _padded(cfg):
    """The reference: padded rows, one micro-batch per pass (the loss does not depend on the
    split, test_fsdp_equivalence; fewer passes keep this test short)."""
    cfg = _with(cfg, "off")
    cfg.optim.micro_batch_tokens, cfg.optim.micro_batch_size = 0, 64
    return cfg


def _trainable_grads(model) -> dict[str, torch.Tensor]:
    if all(p.requires_grad for p in model.parameters()):
        return full_grads(model)
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def _entropy(policy: Policy, plan, temperature: float) -> torch.Tensor:
    out = torch.zeros_like(plan.tokens.resp_mask)
    for mb in plan.whole:  # every pass, padding ones included: each is an FSDP collective
        ent = policy.forward(mb.inputs, temperature, with_entropy=True)[1]
        if mb.real:
            out[mb.rows, : ent.shape[1]] = ent
    return out


def _per_sample(t: torch.Tensor, samples: list[Sample], sids: list[int]) -> dict[int, list[float]]:
    """Every rank's [B, R] rows, trimmed to each response, by global sample id."""
    local = {sid: t[i, : len(s.response_ids)].tolist() for i, (sid, s) in enumerate(zip(sids, samples))}
    return {k: v for part in gathered(local) for k, v in part.items()}


def _plan_stats(plan, n_rows: int) -> dict:
    real = [mb for mb in plan.whole if mb.real]
    placed = sorted(i for mb in real for i in mb.rows)
    return {"kinds": sorted({type(mb.inputs).__name__ for mb in real}), "micro": len(real),
            "tokens": sum(mb.inputs.input_ids.numel() for mb in real), "placed_once": placed == list(range(n_rows))}


def _build(model_dir, cfg, opts):
    """The policy of a case's model settings (packed rows installed); LoRA's B made non-zero, so
    A's gradients are not trivially zero."""
    cfg = _with(cfg, "on")
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    if opts.get("lora"):
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.full_like(p, 0.05))
    return policy


def _worker(rank, world, model_dir, cases):
    torch.set_num_threads(1)  # tiny matrices: a second thread per rank only contends for the cores
    torch.manual_seed(0)
    groups = _groups()
    policies: dict = {}
    out = {}
    for name, (cfg, opts) in cases.items():
        key = (cfg.model.lora.enabled, cfg.model.activation_checkpointing)
        if key not in policies:
            policies[key] = _build(model_dir, cfg, opts)
        policies[key].logprob_chunk_tokens = cfg.model.logprob_chunk_tokens  # 0: the plain head path
        critic = None
        if opts.get("critic"):
            on = _with(cfg, "on")
            critic = Critic(model_dir, on.critic, on.model, on.optim, ParallelLayout.current(on.model))
        out[name] = _case(rank, world, policies[key], critic, cfg, opts, groups)
    if world == 1:
        out["installed_padded_equal"] = _padded_path_unchanged(model_dir, cases["grpo"][0], policies[(False, False)],
                                                               groups)
    return out


def _padded_path_unchanged(model_dir, cfg, installed, groups):
    """Padded rows through a model with the packed attention installed give exactly what a model
    without it gives: one model serves both kinds of batch."""
    off = _with(cfg, "off")
    plain = Policy(model_dir, off.model, off.optim, ParallelLayout.current(off.model))
    installed.logprob_chunk_tokens = plain.logprob_chunk_tokens
    tokens = TokenBatch.from_samples([s for g in groups for s in g], 0, CPU)
    with torch.no_grad():
        return bool(torch.equal(plain.logprobs(tokens), installed.logprobs(tokens)))


def _case(rank, world, policy, critic, cfg, opts, groups):
    held = _held(rank, world, opts)
    samples = [s for g in held for s in groups[g]]
    sids = [g * G + j for g in held for j in range(G)]
    tokens = TokenBatch.from_samples(samples, 0, CPU) if samples else UpdateBatch.empty(CPU).tokens
    up = {"on": Updater(_with(cfg, "on"), 0), "off": Updater(_padded(cfg), 0)}
    plans = {p: up[p].plan(tokens) for p in up}
    a, temperature = cfg.algorithm, cfg.rollout.temperature
    out: dict = {p: {"plan": gathered(_plan_stats(plans[p], len(samples)))} for p in up}

    # inputs both paths share: old logprobs near the current ones (the ratio straddles the clips),
    # a reference's (not the policy's: the KL is not 0), advantages
    current = up["off"].logprobs(policy, plans["off"])
    n = [len(s.response_ids) for s in samples]
    old = [current[i, : n[i]] + opts.get("old_scale", 0.3) * _noise(sid, 0, n[i]) for i, sid in enumerate(sids)]
    ref = [current[i, : n[i]] + 0.2 * _noise(sid, 1, n[i]) for i, sid in enumerate(sids)]
    adv = torch.stack([_noise(sid, 2, 1)[0] for sid in sids]) if sids else torch.zeros(0)
    values = returns = None
    if critic is not None:
        padded = up["off"].values(critic, plans["off"])
        out["off"]["values"] = _per_sample(padded, samples, sids)
        out["on"]["values"] = _per_sample(up["on"].values(critic, plans["on"]), samples, sids)
        mask = tokens.resp_mask
        rewards = torch.tensor([(sid % 5 - 2) / 2 for sid in sids])
        adv, ret = gae_advantages(AdvantageInputs(rewards, torch.zeros_like(mask), mask, padded), a,
                                  lambda v: all_reduce(v).tolist())
        values = [padded[i, : n[i]] + 0.05 * _noise(sid, 3, n[i]) for i, sid in enumerate(sids)]
        # returns below the values: the value head's bias gradient is a sum of one sign (see test_ppo)
        returns = [ret[i, : n[i]] - 0.5 + 0.3 * _noise(sid, 4, n[i]) for i, sid in enumerate(sids)]

    for p in up:
        res = out[p]
        res["lp"] = _per_sample(up[p].logprobs(policy, plans[p]), samples, sids)
        res["entropy"] = _per_sample(_entropy(policy, plans[p], temperature), samples, sids)
        if opts.get("lora"):  # the reference a LoRA run uses: the same model with its adapters off
            base = up[p].logprobs(policy.base(), plans[p])
            res["ref"] = _per_sample(base, samples, sids)
            ref_p = [base[i, : n[i]] for i in range(len(samples))]
        else:
            ref_p = ref
        batch = update_batch(samples, adv, old, ref_p if a.kl_coef > 0 else None, values, returns,
                             drop_truncated=a.overlong_filter)
        rows = up[p].mini_batch_rows(len(batch))
        res["minis"] = []
        for m, micro in enumerate(plans[p].minis):
            sums = up[p].backward_policy(policy, batch, rows[m], micro)
            mini = {k: float(all_reduce(getattr(sums, k))) for k in METRICS}
            mini.update({k: float(all_reduce(sums.correction.values[HEAD.index(k)])) for k in CORRECTION})
            mini["grads"] = _trainable_grads(policy.model)
            policy.optimizer.zero_grad(set_to_none=True)
            if critic is not None:
                sums = up[p].backward_value(critic, batch, rows[m], micro)
                mini.update({k: float(all_reduce(getattr(sums, k))) for k in VALUE_METRICS})
                mini["value_grads"] = full_grads(critic.model)
                critic.optimizer.zero_grad(set_to_none=True)
            res["minis"].append(mini)
    return out


# ----------------------------------------------------------------------------- comparisons

def _rel(a: dict[int, list[float]], b: dict[int, list[float]]) -> float:
    """Largest |a - b| over every token, relative to a's largest entry."""
    assert a.keys() == b.keys()
    ta = torch.tensor([x for k in sorted(a) for x in a[k]])
    tb = torch.tensor([x for k in sorted(a) for x in b[k]])
    assert ta.shape == tb.shape
    return float((ta - tb).abs().max() / ta.abs().max().clamp(min=1e-12))


def _assert_same(ref: dict, got: dict, context: str, rel: float = 1e-5) -> None:
    """`got` computed what `ref` computed: per-token outputs, metric sums and gradients."""
    for key in ("lp", "entropy", "ref", "values"):
        if key in ref:
            err = _rel(ref[key], got[key])
            assert err <= rel, (context, key, err)
    assert len(ref["minis"]) == len(got["minis"]), context
    for m, (r, g) in enumerate(zip(ref["minis"], got["minis"])):
        for key, value in r.items():
            if key.endswith("grads"):
                assert_grads_close(value, g[key], rel, (context, m, key))
            elif key in COUNTS:
                assert value == g[key], (context, m, key, value, g[key])
            else:
                assert abs(value - g[key]) <= rel * abs(value) + 1e-9, (context, m, key, value, g[key])


def test_packed_rows_equal_padded_rows_on_one_and_two_ranks(tiny_model_dir, cases):
    runs = {world: run_distributed(_worker, world, tiny_model_dir, cases) for world in (1, 2)}
    assert runs[1].pop("installed_padded_equal")
    for name, (cfg, opts) in cases.items():
        for world, run in runs.items():
            on, off = run[name]["on"], run[name]["off"]
            _assert_same(off, on, f"{name}, {world} rank(s): packed vs padded")
            # the packed path really packed: packed rows only, every row once, fewer tokens
            assert all(r["kinds"] == ["PackedRows"] for r in on["plan"] if r["micro"]), (name, on["plan"])
            assert all(r["kinds"] == ["TokenBatch"] for r in off["plan"] if r["micro"]), (name, off["plan"])
            assert all(r["placed_once"] for r in on["plan"] + off["plan"]), name
            packed, padded = (sum(r["tokens"] for r in x["plan"]) for x in (on, off))
            assert packed < padded, (name, world, packed, padded)
            # and nothing was trivially zero
            for mini in on["minis"]:
                assert mini["loss"] != 0.0 and mini["entropy"] > 0, (name, mini["loss"])
                assert (mini["kl"] > 0) == (cfg.algorithm.kl_coef > 0), (name, mini["kl"])
                assert mini["clip_low"] + mini["clip_high"] > 0, (name, "no clip was active")
                for key in ("grads", "value_grads"):
                    for param, grad in mini.get(key, {}).items():
                        assert float(grad.abs().max()) > 0, (name, key, param)
        # one rank of padded rows computes what two ranks of packed rows compute
        _assert_same(runs[1][name]["off"], runs[2][name]["on"], f"{name}: 2 ranks packed vs 1 rank padded")
    # the loss saw the generated tokens only (not the observations), DAPO's without the truncated
    # samples; the empty rank had no micro-batch of its own
    samples = [s for g in _groups() for s in g]
    trained = {name: sum(m["tokens"] for m in runs[1][name]["on"]["minis"]) for name in ("grpo", "dapo")}
    assert trained["grpo"] == sum(s.generated for s in samples) < sum(len(s.response_ids) for s in samples)
    assert trained["dapo"] == sum(s.generated for s in samples if not s.truncated) < trained["grpo"]
    assert runs[2]["empty_rank"]["on"]["plan"][1]["micro"] == 0


# ----------------------------------------------------------------------------- the plan, in-process

def _tokens(groups: list[list[Sample]]) -> TokenBatch:
    return TokenBatch.from_samples([s for g in groups for s in g], 0, CPU)


def test_the_plan_shares_prompts_and_splits_a_group_over_the_budget(cases):
    """What the distributed test's cases plan (no process group needed: one rank's plan)."""
    groups = _groups()
    tokens = _tokens(groups)
    group_of = [i // G for i in range(len(tokens))]
    for name in ("grpo", "dapo"):
        cfg = cases[name][0]
        on, off = Updater(_with(cfg, "on"), 0), Updater(_padded(cfg), 0)
        micro = on.micro_batches(tokens, list(range(len(tokens))))
        assert all(isinstance(mb.inputs, PackedRows) and mb.real for mb in micro)
        assert sorted(i for mb in micro for i in mb.rows) == list(range(len(tokens)))
        padded = off.micro_batches(tokens, list(range(len(tokens))))
        packed_tokens = sum(mb.inputs.input_ids.numel() for mb in micro)
        assert packed_tokens < sum(mb.inputs.input_ids.numel() for mb in padded)
        # each micro-batch holds whole prompts: a prompt's tokens are there once per unit
        for mb in micro:
            lay = mb.inputs.layout
            assert lay.prompt_idx.shape[0] == len({group_of[i] for i in mb.rows}) or name == "dapo"
        if name == "grpo":  # groups of different prompt lengths share a row
            assert any(len(set(mb.inputs.layout.prompt_valid.sum(1).tolist())) > 1 for mb in micro)
            assert len(micro) < len(groups)
        else:  # a budget below a group: more micro-batches than groups, a group across micro-batches
            assert all(mb.inputs.input_ids.numel() <= BUDGET for mb in micro)
            assert len(micro) > len(groups)
            spread = {g: {k for k, mb in enumerate(micro) if any(group_of[i] == g for i in mb.rows)}
                      for g in range(len(groups))}
            assert any(len(ks) >= 2 for ks in spread.values()), spread
            # the prompt is computed once per unit: as many prompts in the plan as units
            units = group_chunks(row_tokens(tokens), list(range(len(tokens))), BUDGET)
            assert sum(mb.inputs.layout.prompt_idx.shape[0] for mb in micro) == len(units) > len(groups)


# ----------------------------------------------------------------------------- planner and packer

A, B, C, D, E, F_ = 10, 11, 12, 13, 14, 15


def test_pack_hand_checked():
    """Prompt [a, b, c], responses [d, e] and [f]: one row a b c d e f, positions restart after
    the prompt, the predictor of d and of f is c, of e is d. A second unit (prompt [x, y], an
    empty response and [u, v, w]) follows in the same row."""
    X, Y, U, V, W = 20, 21, 22, 23, 24
    samples = [RowTokens((A, B, C), [D, E]), RowTokens((A, B, C), [F_]), RowTokens((X, Y), []),
               RowTokens((X, Y), [U, V, W])]
    resp_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    order, rows = pack(samples, [[0, 1]], resp_mask, CPU)
    assert order == [0, 1]
    assert rows.input_ids.tolist() == [[A, B, C, D, E, F_]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    assert rows.keep_positions.tolist() == [2, 3]  # c, d
    assert rows.window_index.tolist() == [[0, 1], [0, 0]]  # d <- c, e <- d; f <- c (and padding)
    assert rows.targets.tolist() == [[D, E], [F_, 0]]
    assert rows.resp_len.tolist() == [2, 1]
    assert rows.resp_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert rows.attention_mask.tolist() == [[1] * 6]
    out = torch.arange(6.0)[None, :, None]  # a model output that is its own position
    assert rows.select_full(out)[..., 0].tolist() == [[2.0, 3.0], [2.0, 2.0]]
    assert rows.select(out[:, rows.keep_positions])[..., 0].tolist() == [[2.0, 3.0], [2.0, 2.0]]
    lay = rows.layout
    assert lay.prompt_idx.tolist() == [[0, 1, 2]]
    assert lay.resp_idx.tolist() == [[3, 4], [5, 0]] and lay.resp_valid.tolist() == [[True, True], [True, False]]
    assert lay.kv_idx.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 0]]
    assert lay.response_mask(None)[:, 0].tolist() == [
        [[True, True, True, True, False], [True, True, True, True, True]],  # d sees a b c d; e sees a b c d e
        [[True, True, True, True, False], [True, True, True, True, False]],  # f sees a b c f (its padding likewise)
    ]

    order, rows = pack(samples, [[2, 3], [0, 1]], resp_mask, CPU)
    assert order == [2, 3, 0, 1]
    assert rows.input_ids.tolist() == [[X, Y, U, V, W, A, B, C, D, E, F_]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 3]]
    assert rows.keep_positions.tolist() == [1, 2, 3, 7, 8]  # y u v | c d
    assert rows.window_index.tolist() == [[0, 0, 0], [0, 1, 2], [3, 4, 0], [3, 0, 0]]
    assert rows.targets.tolist() == [[0, 0, 0], [U, V, W], [D, E, 0], [F_, 0, 0]]
    assert rows.resp_len.tolist() == [0, 3, 2, 1]
    assert rows.resp_mask.tolist() == [[0, 0, 0], [1, 0, 1], [1, 1, 0], [1, 0, 0]]  # rows in output order
    assert rows.layout.prompt_idx.tolist() == [[0, 1, 0], [5, 6, 7]]  # right-padded to the longest prompt
    assert rows.layout.prompt_valid.tolist() == [[True, True, False], [True, True, True]]


def test_group_chunks_and_plan_hand_checked():
    """Budget 8: prompt A (3 tokens) with responses of 4, 0, 5, 2 tokens is cut into [4, 0] (7),
    [5] (8), [2] (5); prompt B (2 tokens) with 1, 1 stays whole; a response longer than the
    budget is a unit of its own."""
    pa, pb = (1, 2, 3), (4, 5)
    samples = [RowTokens(pa, [9] * 4), RowTokens(pa, []), RowTokens(pa, [9] * 5), RowTokens(pa, [9] * 2),
               RowTokens(pb, [9]), RowTokens(pb, [9]), RowTokens(pb, [9] * 12)]
    assert group_chunks(samples, list(range(6)), 8) == [[0, 1], [2], [3], [4, 5]]
    assert group_chunks(samples, list(range(7)), 8) == [[0, 1], [2], [3], [4, 5], [6]]
    assert group_chunks(samples, [3, 1, 0], 8) == [[3, 1], [0]]  # rows keep the order they are given
    assert unit_tokens(samples, [6]) == 14
    # first-fit decreasing: 14 (alone, over budget), 8, 7, 5 + 4 ... within 9 tokens
    assert plan_packed(samples, list(range(7)), 9) == [[[6]], [[2]], [[0, 1]], [[3], [4, 5]]]


@pytest.mark.parametrize("seed", range(20))
def test_plan_places_every_row_once_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist())
               for _ in range(5)]
    samples = [RowTokens(prompts[int(torch.randint(0, 5, (1,), generator=g))],
                         [7] * int(torch.randint(0, 15, (1,), generator=g))) for _ in range(30)]
    rows = sorted(torch.randperm(30, generator=g)[:int(torch.randint(1, 31, (1,), generator=g))].tolist())
    budget = int(torch.randint(1, 60, (1,), generator=g))
    plan = plan_packed(samples, rows, budget)
    placed = [i for mb in plan for unit in mb for i in unit]
    assert sorted(placed) == rows  # every row exactly once
    for mb in plan:
        size = sum(unit_tokens(samples, unit) for unit in mb)
        assert size <= budget or len(mb) == 1, (size, budget, mb)
        for unit in mb:
            assert len({samples[i].prompt for i in unit}) == 1  # a unit shares one prompt
            assert unit == sorted(unit)  # in the order given
            assert unit_tokens(samples, unit) <= budget or len(unit) == 1
    # a packed micro-batch's outputs line up with the padded batch's rows
    tokens = TokenBatch.from_samples([Sample(list(s.prompt), s.response, [0.0] * len(s.response), False)
                                      for s in samples], 0, CPU)
    for mb in plan:
        order, packed = pack(row_tokens(tokens), mb, tokens.resp_mask, CPU)
        padded = tokens.rows(order)
        width = packed.targets.shape[1]
        assert torch.equal(packed.targets * packed.resp_mask, (padded.targets * padded.resp_mask)[:, :width])
        assert torch.equal(packed.resp_len, padded.resp_len)


# ----------------------------------------------------------------------------- attention

def _dense_reference(samples, units, rows, q, k, v, window, softcap):
    """Attention over the whole packed row with a dense [L, L] mask: a prompt token sees its
    prompt's earlier tokens; a response token its prompt and its own earlier tokens; within
    `window` positions when given."""
    owner, span = [], []  # per token: its unit, and which span (-1: the prompt) it is in
    for u, unit in enumerate(units):
        owner += [u] * len(samples[unit[0]].prompt)
        span += [-1] * len(samples[unit[0]].prompt)
        for j, i in enumerate(unit):
            owner += [u] * len(samples[i].response)
            span += [j] * len(samples[i].response)
    owner, span = torch.tensor(owner), torch.tensor(span)
    n = len(owner)
    idx = torch.arange(n)
    same_unit = owner[:, None] == owner[None, :]
    allowed = same_unit & (span[None, :] == -1) & ((span[:, None] != -1) | (idx[None, :] <= idx[:, None]))
    allowed |= same_unit & (span[:, None] == span[None, :]) & (idx[None, :] <= idx[:, None])
    if window is not None:
        pos = rows.position_ids[0]
        allowed &= (pos[:, None] - pos[None, :]) < window
    groups = q.shape[1] // k.shape[1]
    kk, vv = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(1, 2)  # [1, L, H, D]


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0), (4, 5.0)])
def test_attention_equals_dense_attention_over_the_row(window, softcap):
    g = torch.Generator().manual_seed(5)
    pa, pb, pc = (1, 2, 3, 4, 5), (6, 7), (8,)
    samples = [RowTokens(pa, [9] * 6), RowTokens(pa, []), RowTokens(pa, [9] * 2), RowTokens(pb, [9] * 7),
               RowTokens(pb, [9]), RowTokens(pc, [9] * 3)]
    units = [[0, 1, 2], [3, 4], [5]]
    _, rows = pack(samples, units, torch.ones(6, 7), CPU)
    length, heads, kv_heads, dim = rows.input_ids.shape[1], 4, 2, 8
    q = torch.randn(1, heads, length, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=g) for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads)
    got, _ = shared_prefix_attention(module, q, k, v, None, shared_prefix=rows.layout, sliding_window=window,
                                     softcap=softcap)
    ref = _dense_reference(samples, units, rows, q, k, v, window, softcap)
    assert got.shape == ref.shape == (1, length, heads, dim)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_masks_scale_with_the_responses_not_the_packed_row():
    """One packed row of a 512-token prompt and 4 responses of 2048: the masks are responses x
    (prompt + response), as padded rows' attention is, never [L, L] over the row of 8704; and
    building them (a sliding window's too) allocates nothing larger than the mask itself."""
    p, g, r, window = 512, 4, 2048, 1024
    samples = [RowTokens(tuple(range(p)), [7] * r) for _ in range(g)]
    _, rows = pack(samples, [list(range(g))], torch.ones(g, r), CPU)
    length = p + g * r
    assert rows.input_ids.shape == (1, length)
    lay = rows.layout
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        masks = [lay.response_mask(None), lay.response_mask(window), lay.prompt_mask(window)]
    assert max(e.cpu_memory_usage for e in prof.events()) <= g * r * (p + r)  # bytes: one bool mask
    assert lay.prompt_mask(None) is None  # plain causal attention over the prompts
    assert masks[2].shape == (1, 1, p, p)
    for mask in masks[:2]:
        assert mask.dtype == torch.bool and mask.shape == (g, 1, r, p + r)
    held = [t for t in vars(lay).values() if isinstance(t, torch.Tensor)] + list(lay._masks.values())
    assert 3 * max(t.numel() for t in held) < length * length
    assert sum(t.numel() for t in held) < 3 * g * r * (p + r)
