"""LoRA adapters on the FSDP2 policy (distflow.train.lora): only the adapters train and the base stays
bit-identical; loss and adapter gradients are the same on 1 and 2 real gloo ranks (FSDP and
replicas); the reference with adapters off equals a separately loaded frozen base; the exported
PEFT folder loads with PEFT and gives the live policy's logits; PEFT's own merge equals the merged
weights the engine gets; bad settings fail with one line before any weights load."""

import dataclasses

import pytest
import torch

from dist_helpers import run_distributed
from grad_helpers import assert_grads_close, update_batch
from grad_helpers import fixed_batch
from config_helpers import fp32_config
from distflow.train.batch import TokenBatch
from distflow.config import ConfigError
from distflow.checkpoint.export import export_live
from distflow.distributed.layout import ParallelLayout
from distflow.train.lora import adapters_disabled, file_key, merged_parameters
from distflow.train.policy import Policy, check_model_options
from distflow.train.update import Updater

RANK, ALPHA = 4, 8.0


def _cfg(shard_ranks=-1, **lora):
    cfg = fp32_config()
    cfg.task.path = "data.jsonl"  # a task with data: only the model's settings are under test
    cfg.model.shard_ranks = shard_ranks
    cfg.model.lora = dataclasses.replace(cfg.model.lora, **{"enabled": True, "rank": RANK, "alpha": ALPHA, **lora})
    cfg.optim.micro_batch_size, cfg.optim.lr = 3, 1e-2
    return cfg


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_two_steps(rank, world, model_dir, cfg):
    """Two optimizer steps on this rank's share of a fixed batch; the second step's loss sums and
    adapter gradients (the first leaves B = 0, so only the second moves A as well)."""
    torch.manual_seed(0)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    samples, adv, _ = fixed_batch()
    per = len(samples) // world
    batch = update_batch(samples[rank * per:(rank + 1) * per], adv[rank * per:(rank + 1) * per])
    base = {n: _full(p).clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    for _ in range(2):
        sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
        grads = {n: _full(p.grad).clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        assert all(p.grad is None for p in policy.model.parameters() if not p.requires_grad)
        policy.step(1.0)
    loss = torch.tensor([sums.loss])
    torch.distributed.all_reduce(loss)
    return policy, base, grads, float(loss)


def _worker(rank, world, model_dir, export_to):
    runs = {}
    for shard_ranks in ([-1] if world == 1 else [-1, 1]):  # 2 ranks: FSDP shards, and replicas (bucketed)
        cfg = _cfg(shard_ranks)
        policy, base, grads, loss = _train_two_steps(rank, world, model_dir, cfg)
        trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable), trainable
        assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in each of 2 blocks
        assert sum(len(g["params"]) for g in policy.optimizer.param_groups) == len(trainable)
        after = {n: _full(p) for n, p in policy.model.named_parameters() if not p.requires_grad}
        assert base.keys() == after.keys() and all(torch.equal(base[n], after[n]) for n in base)
        assert all(float(g.abs().max()) > 0 for g in grads.values())  # A and B both learn by step 2
        runs[shard_ranks] = {"grads": grads, "loss": loss}
    cfg = _cfg()
    samples, _, _ = fixed_batch()
    tokens = TokenBatch.from_samples(samples, 0, torch.device("cpu"))
    with torch.no_grad():
        live = policy.logprobs(tokens)
        ref = policy.base().logprobs(tokens)
        frozen = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model), trainable=False)
        assert not frozen.lora  # a frozen reference is never adapted
        separate = frozen.logprobs(tokens)
        merged = {n: t.clone() for n, t in merged_parameters(policy.model, torch.float32)}
    assert torch.allclose(ref, separate, atol=1e-6, rtol=0), float((ref - separate).abs().max())
    assert float((live - ref).abs().max()) > 1e-3  # the adapters do change the policy
    # the reference pass left the adapters on and trainable: a training pass still reaches them
    assert all(p.requires_grad for n, p in policy.model.named_parameters() if "lora_" in n)
    # logits of the live policy on one sequence, for the exported folder to match
    ids = torch.tensor([samples[0].prompt_ids + samples[0].response_ids])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits
    policy.model.reshard()
    export_live(policy.model, model_dir, f"{export_to}/hf", rank == 0, policy.adapter_config, f"{export_to}/adapter")
    _dropout_is_off_without_grad(model_dir, tokens)
    _bf16_base_and_fp32_adapters(model_dir, rank, world)
    return {"runs": runs, "logits": logits, "ids": ids, "merged": merged}


def _dropout_is_off_without_grad(model_dir, tokens):
    cfg = _cfg(dropout=0.5)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    with torch.no_grad():  # B = 0 makes dropout invisible: give the adapters a value first
        for n, p in policy.model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.full_like(p, 0.05))
        a, b = policy.logprobs(tokens), policy.logprobs(tokens)
    assert torch.equal(a, b)  # logprob passes are deterministic
    torch.manual_seed(1)
    c = policy.logprobs(tokens)  # with grad: the update's forward drops
    assert float((c.detach() - a).abs().max()) > 1e-4


def _bf16_base_and_fp32_adapters(model_dir, rank, world):
    """In bf16 the frozen base is kept in bf16 (no fp32 master copy); the adapters stay fp32, as
    their gradients and AdamW state, and a step trains them."""
    cfg = _cfg()
    cfg.model.dtype = "bfloat16"
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    dtypes = {p.requires_grad: set() for p in policy.model.parameters()}
    for p in policy.model.parameters():
        dtypes[p.requires_grad].add(p.dtype)
    assert dtypes == {False: {torch.bfloat16}, True: {torch.float32}}, dtypes
    samples, adv, _ = fixed_batch()
    per = len(samples) // world
    batch = update_batch(samples[rank * per:(rank + 1) * per], adv[rank * per:(rank + 1) * per])
    for _ in range(2):
        Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
        assert all(p.grad.dtype == torch.float32 for p in policy.model.parameters() if p.requires_grad)
        norm, taken = policy.step(1.0)
    assert taken and norm > 0
    # the frozen KL reference in bf16 keeps bf16 weights, and computes what the trainable policy
    # (fp32 masters cast to bf16 at each forward) computes from the same weights
    cfg.model.lora.enabled = False
    tokens = TokenBatch.from_samples(samples, 0, torch.device("cpu"))
    layout = ParallelLayout.current(cfg.model)
    reference = Policy(model_dir, cfg.model, cfg.optim, layout, trainable=False)
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    trained = Policy(model_dir, cfg.model, cfg.optim, layout)
    assert {p.dtype for p in trained.model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(reference.logprobs(tokens), trained.logprobs(tokens))


def test_lora_trains_only_adapters_and_is_sharding_invariant(tiny_model_dir, tmp_path):
    one, two = tmp_path / "w1", tmp_path / "w2"
    r1, r2 = (run_distributed(_worker, world, tiny_model_dir, str(out)) for world, out in ((1, one), (2, two)))
    single = r1["runs"][-1]
    for shard_ranks, run in r2["runs"].items():
        assert abs(run["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"]), (shard_ranks, run["loss"], single["loss"])
        assert_grads_close(single["grads"], run["grads"], 1e-5, f"1 vs 2 ranks, shard_ranks={shard_ranks}")

    # The exported adapter folder is a PEFT folder: PEFT loads it on the base, with the live logits.
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), f"{two}/adapter")
    with torch.no_grad():
        logits = peft_model(input_ids=r2["ids"]).logits
    assert torch.allclose(logits, r2["logits"], atol=1e-5, rtol=0), float((logits - r2["logits"]).abs().max())
    # PEFT's own merge equals what the engine gets (merged_parameters) and the merged export
    merged_by_peft = peft_model.merge_and_unload().state_dict()
    exported = load_file(f"{two}/hf/model.safetensors")
    for name, t in r2["merged"].items():
        assert torch.allclose(merged_by_peft[name], t, atol=1e-6, rtol=0), name
        assert torch.equal(exported[name], t), name
    adapter = load_file(f"{two}/adapter/adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in adapter)


def test_adapter_file_names_are_peft_names():
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert file_key(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("lora,needle", [
    (dict(rank=0), "model.lora.rank must be >= 1"),
    (dict(alpha=0.0), "model.lora.alpha"),
    (dict(dropout=1.0), "model.lora.dropout"),
    (dict(resync="sometimes"), "model.lora.resync must be one of merged, adapter; got 'sometimes'"),
])
def test_bad_lora_settings_fail_validation(lora, needle):
    cfg = _cfg(**lora)
    with pytest.raises(ConfigError, match=needle):
        cfg.validate()


def test_adapter_resync_needs_vllm_without_tensor_parallelism():
    cfg = _cfg(resync="adapter")
    cfg.rollout.engine = "hf"
    with pytest.raises(ConfigError, match="needs rollout.engine=vllm"):
        cfg.validate()
    cfg.rollout.engine, cfg.rollout.tensor_parallel_size = "vllm", 2
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 is not supported"):
        cfg.validate()
    cfg.model.lora.enabled = False  # none of it matters without LoRA
    cfg.validate()


@pytest.mark.parametrize("targets,needle", [
    (["no_such_proj"], "no_such_proj"),  # matches nothing
    (["input_layernorm"], "not supported"),  # a layer type PEFT cannot adapt
])
def test_bad_targets_fail_on_a_meta_skeleton(tiny_model_dir, targets, needle):
    cfg = _cfg(target_modules=targets)
    with pytest.raises(ConfigError, match=needle) as info:
        check_model_options(tiny_model_dir, cfg.model)
    assert "\n" not in str(info.value) and "model.lora.target_modules" in str(info.value)
    check_model_options(tiny_model_dir, _cfg().model)  # the default targets are fine


def test_adapters_disabled_restores_the_flags_on_error():
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), torch.nn.Sequential(torch.nn.Linear(3, 3)))
    with pytest.raises(RuntimeError), adapters_disabled(model):
        assert model[0].disable_adapters
        raise RuntimeError
    assert not model[0].disable_adapters
