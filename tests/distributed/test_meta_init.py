"""Meta-device start-up gives what every rank reading the full model gave: the same policy,
KL reference and PPO critic (every full parameter and buffer torch.equal, the tied embedding
still one parameter, the critic's fresh head included), the same global RNG state afterwards,
and the same weights after one optimizer step; on 2 real gloo ranks, fully sharded and replicated.
A model rank 0 cannot read stops every rank with rank 0's error."""

from itertools import chain

import torch
from torch.distributed.tensor import DTensor

from dist_helpers import run_distributed
from grad_helpers import update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.config import DistflowConfig
from distflow.train.critic import Critic
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.train.update import Updater


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) as a full tensor."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in chain(model.named_parameters(), model.named_buffers())}


def _tied(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}


def _build(kind: str, meta: bool, model_dir: str, cfg: DistflowConfig, layout: ParallelLayout):
    cfg.model.meta_device_init = meta
    torch.manual_seed(0)  # as the trainer seeds every rank before building its models
    if kind == "critic":
        built = Critic(model_dir, cfg.critic, cfg.model, cfg.optim, layout)
    else:
        built = Policy(model_dir, cfg.model, cfg.optim, layout, trainable=kind == "policy")
    return built, torch.get_rng_state()


def _train_step(kind: str, built, cfg: DistflowConfig, rank: int, world: int) -> None:
    samples, adv, noise = fixed_batch()
    per = len(samples) // world
    lo, hi = rank * per, (rank + 1) * per
    rows = list(range(hi - lo))
    if kind == "critic":
        returns = [adv[lo + i] + 0.3 * noise[lo + i] for i in rows]
        batch = update_batch(samples[lo:hi], values=[0.1 * n for n in noise[lo:hi]], returns=returns)
        sums = Updater(cfg, 0).backward_value(built, batch, rows)
        loss = sums.value_loss
    else:
        sums = Updater(cfg, 0).backward_policy(built, update_batch(samples[lo:hi], adv[lo:hi]), rows)
        loss = sums.loss
    assert built.step(loss)[1] == "taken"


def _worker(rank, world, model_dir):
    checked = []
    for shard in (-1, 1):
        cfg = fp32_config()
        cfg.model.shard_ranks = shard
        cfg.optim.lr = cfg.critic.lr = 1e-3  # a step that moves every weight visibly
        cfg.optim.micro_batch_size = 3
        cfg.algorithm.advantage = "gae"  # with a critic
        layout = ParallelLayout.current(cfg.model)
        for kind in ("policy", "reference", "critic"):
            where = (shard, kind)
            old, rng_old = _build(kind, False, model_dir, cfg, layout)
            new, rng_new = _build(kind, True, model_dir, cfg, layout)
            assert torch.equal(rng_old, rng_new), where
            assert not any(t.is_meta for t in chain(new.model.parameters(), new.model.buffers())), where
            assert _tied(new.model) == _tied(old.model), where
            if kind != "critic":
                assert _tied(new.model) == {"lm_head.weight"}, where  # the tiny model ties its head
                assert new.model.lm_head.weight is new.model.model.embed_tokens.weight, where
            a, b = _full_state(old.model), _full_state(new.model)
            assert a.keys() == b.keys() and any("inv_freq" in k for k in a), where
            for name in a:
                assert torch.equal(a[name], b[name]), (where, name)
            if kind == "critic":  # the fresh head is really random, and the same on every rank
                head = b["score.weight"]
                peers = [torch.empty_like(head) for _ in range(world)]
                torch.distributed.all_gather(peers, head)
                assert head.abs().max() > 0 and all(torch.equal(head, p) for p in peers), where
            if kind != "reference":
                _train_step(kind, old, cfg, rank, world)
                _train_step(kind, new, cfg, rank, world)
                a2, b2 = _full_state(old.model), _full_state(new.model)
                assert any(not torch.equal(a[n], a2[n]) for n in a), where  # the step did move weights
                for name in a2:
                    assert torch.equal(a2[name], b2[name]), (where, name, "after a step")
            checked.append((shard, kind, len(a)))
            del old, new
    return checked


def test_meta_device_start_up_equals_full_load(tiny_model_dir):
    checked = run_distributed(_worker, 2, tiny_model_dir)
    assert [(s, k) for s, k, _ in checked] == [(s, k) for s in (-1, 1) for k in ("policy", "reference", "critic")]
    assert all(n > 10 for _, _, n in checked)


def _unreadable_worker(rank, world, model_dir, out_path):
    cfg = fp32_config()
    if rank == 0:  # only rank 0 reads the weights: break them there
        (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    torch.distributed.barrier()
    try:
        Policy(str(model_dir), cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    except Exception as exc:  # noqa: BLE001
        (out_path / f"rank{rank}.txt").write_text(str(exc))
    else:
        raise AssertionError("a model rank 0 cannot read was built")


def test_weights_rank0_cannot_read_stop_every_rank(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    run_distributed(_unreadable_worker, 2, broken, tmp_path, timeout=120)
    own = (tmp_path / "rank0.txt").read_text()  # rank 0 raises the loader's own error
    assert own and "rank 0 could not" not in own
    assert (tmp_path / "rank1.txt").read_text().startswith("rank 0 could not load the model's weights: ")
    assert own in (tmp_path / "rank1.txt").read_text()
