"""Chunked logprobs/entropy and activation checkpointing change memory, never results.

`chunked_stats` is checked against an independent reference (log_softmax over full logits) for
chunk sizes that do and do not divide the response width, chunks longer than it, and empty
responses, values and gradients. Then the real thing: FSDP2 policies (and PPO critics) on 1 and
2 gloo ranks with each lever on and off must give the plain path's logprobs, entropy, loss and
full gradients (rel 1e-6), 1 vs 2 ranks still equal; checkpointing must really recompute and
chunking must really stop whole-micro-batch logits from being kept for backward.
"""

import pytest
import torch

from dist_helpers import run_distributed
from grad_helpers import assert_grads_close, full_grads, update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.train.batch import TokenBatch
from distflow.distributed import all_reduce
from distflow.train.critic import Critic
from distflow.distributed.layout import ParallelLayout
from distflow.train.lm_head import chunked_stats
from distflow.train.policy import Policy, decoder_blocks
from distflow.sample import Sample
from distflow.train.update import Updater

# (logprob_chunk_tokens, activation_checkpointing); the first is the plain path. Chunks of 5 do
# not divide the batch's response tokens, 1000 is longer than all of them together.
LEVERS = [(0, False), (5, False), (1000, False), (0, True), (5, True)]
REL = 1e-6


def _reference(hidden, weight, bias, targets, mask, temperature):
    logp = torch.log_softmax((hidden @ weight.T + bias).double() / temperature, dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp * mask, entropy * mask


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("empty", ["some", "all"])
def test_chunked_stats_equal_full_log_softmax(chunk, empty):
    g = torch.Generator().manual_seed(1)
    B, R, H, V = 4, 6, 8, 50
    hidden = torch.randn(B, R, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V)
    targets = torch.randint(0, V, (B, R), generator=g)
    lengths = [6, 0, 3, 1] if empty == "some" else [0] * B
    mask = (torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]).float()
    weights = torch.randn(B, R, 2, generator=g)

    out = chunked_stats(hidden, head, targets, mask, 0.7, chunk, with_entropy=True)
    (out * weights).sum().backward()
    got = (out[..., 0], out[..., 1], hidden.grad, head.weight.grad, head.bias.grad)

    params = [t.detach().double().requires_grad_() for t in (hidden, head.weight, head.bias)]
    lp, ent = _reference(*params, targets, mask, 0.7)
    (torch.stack([lp, ent], -1) * weights).sum().backward()
    want = (lp, ent, *(p.grad for p in params))
    for name, a, b in zip(("logprobs", "entropy", "d hidden", "d weight", "d bias"), got, want):
        scale = b.detach().abs().max().clamp(min=1e-12)
        assert float((a.detach().double() - b.detach()).abs().max() / scale) <= 1e-6, (name, chunk, empty)
    assert chunked_stats(hidden, head, targets, mask, 1.0, chunk, with_entropy=False).shape == (B, R, 1)


def _config(chunk, checkpointing, dtype="float32"):
    cfg = fp32_config()
    cfg.optim.micro_batch_size = 3
    cfg.model.shard_ranks = -1
    cfg.model.dtype = dtype
    cfg.model.logprob_chunk_tokens, cfg.model.activation_checkpointing = chunk, checkpointing
    cfg.algorithm.entropy_coef = 0.01  # the entropy's gradient goes through the chunked path too
    return cfg


class _SavedBytes:
    """Bytes autograd keeps for backward outside checkpointed regions (which save their own)."""

    def __init__(self):
        self.total = 0

    def __enter__(self):
        def pack(t):
            self.total += t.numel() * t.element_size()
            return t
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float, context) -> None:
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
    assert err <= rel, (context, err)


def _policy_pass(model_dir, cfg, local, adv):
    """One policy built with cfg: its no-grad logprobs and entropy, then one loss pass (loss,
    full gradients, decoder-block forwards per block, bytes kept for backward outside
    checkpoints), then backward through a micro-batch whose only response is empty."""
    torch.manual_seed(0)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    with torch.no_grad():
        lp, entropy = policy.forward(TokenBatch.from_samples(local, 0, torch.device("cpu")), 0.7, with_entropy=True)
    blocks, calls = decoder_blocks(policy.model), []
    hooks = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in blocks]  # (a recompute stops early)
    batch, updater = update_batch(local, adv), Updater(cfg, 0)
    micro = updater.micro_batches(batch.tokens, list(range(len(local))))
    with _SavedBytes() as saved:
        sums = updater.backward_policy(policy, batch, list(range(len(local))), micro)
    for h in hooks:
        h.remove()
    out = dict(lp=lp, entropy=entropy, loss=float(all_reduce(sums.loss)), grads=full_grads(policy.model),
               block_calls=len(calls) / len(blocks), passes=len(micro), saved=saved.total)
    policy.optimizer.zero_grad(set_to_none=True)
    empty = TokenBatch.from_samples([Sample([5, 6, 7], [], [], False)], 0, torch.device("cpu"))
    e_lp, e_ent = policy.forward(empty, 1.0, with_entropy=True)
    (e_lp.sum() + e_ent.sum()).backward()
    assert all(float(g.abs().max()) == 0.0 for g in full_grads(policy.model).values())
    return out


def _policy_worker(rank, world, model_dir):
    samples, adv, _ = fixed_batch()
    lo, hi = rank * len(samples) // world, (rank + 1) * len(samples) // world
    local, adv = samples[lo:hi], adv[lo:hi]
    res = {lever: _policy_pass(model_dir, _config(*lever), local, adv) for lever in LEVERS}
    plain = res[(0, False)]
    vocab = plain["grads"]["model.embed_tokens.weight"].shape[0]
    for (chunk, ckpt), r in res.items():
        for key in ("lp", "entropy"):
            _close(r[key], plain[key], REL, (chunk, ckpt, key))
        assert abs(r["loss"] - plain["loss"]) <= REL * abs(plain["loss"]), (chunk, ckpt, r["loss"], plain["loss"])
        assert_grads_close(plain["grads"], r["grads"], REL, (chunk, ckpt))
        # checkpointing recomputes every block in backward; without it each block runs once
        assert r["block_calls"] == (2 * r["passes"] if ckpt else r["passes"]), (chunk, ckpt, r["block_calls"])
    # chunking keeps no fp32 logits for backward (the plain path keeps at least one [b, r, V]
    # tensor per micro-batch); checkpointing keeps less again (block inputs only)
    response_tokens = sum(len(s.response_ids) for s in local)
    assert plain["saved"] - res[(5, False)]["saved"] >= 4 * vocab * response_tokens, (plain["saved"], res[(5, False)])
    assert res[(0, True)]["saved"] < plain["saved"] and res[(5, True)]["saved"] < res[(5, False)]["saved"]
    if world == 1:  # bf16 compute (FSDP mixed precision): the levers round alike, not bit-alike
        bf = {lever: _policy_pass(model_dir, _config(*lever, dtype="bfloat16"), local, adv)
              for lever in [(0, False), (5, True)]}
        a, b = bf[(0, False)], bf[(5, True)]
        _close(b["lp"], a["lp"], 1e-2, "bf16 lp")
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(a["loss"]), (a["loss"], b["loss"])
        assert_grads_close(a["grads"], b["grads"], 5e-2, "bf16")
    return {k: (r["loss"], r["grads"]) for k, r in res.items()}


def _critic_worker(rank, world, model_dir):
    samples, adv, noise = fixed_batch()
    lo, hi = rank * len(samples) // world, (rank + 1) * len(samples) // world
    local = samples[lo:hi]
    res = {}
    for ckpt in (False, True):
        torch.manual_seed(0)  # the value head's initialisation
        cfg = _config(0, ckpt)
        critic = Critic(model_dir, cfg.critic, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
        batch = update_batch(local, adv[lo:hi], values=noise[lo:hi], returns=[n + 1 for n in noise[lo:hi]])
        sums = Updater(cfg, 0).backward_value(critic, batch, list(range(len(local))))
        res[ckpt] = (float(all_reduce(sums.value_loss)), full_grads(critic.model))
    (l0, g0), (l1, g1) = res[False], res[True]
    assert l0 != 0.0 and abs(l0 - l1) <= REL * abs(l0), (l0, l1)
    assert_grads_close(g0, g1, REL, "critic")


def test_levers_equal_plain_path_on_1_and_2_ranks(tiny_model_dir):
    one, two = (run_distributed(_policy_worker, world, tiny_model_dir) for world in (1, 2))
    for lever in LEVERS:
        (l1, g1), (l2, g2) = one[lever], two[lever]
        assert l1 != 0.0 and abs(l1 - l2) <= 1e-5 * abs(l1), (lever, l1, l2)
        assert_grads_close(g1, g2, 1e-5, lever)


def test_critic_checkpointing_equals_plain_path(tiny_model_dir):
    run_distributed(_critic_worker, 2, tiny_model_dir)
