"""The trainable policy: an HF causal LM sharded with FSDP2, its optimizer and LR schedule.
(`ShardedModel` is the part it shares with the PPO critic, distflow.train.critic.)

`fully_shard` wraps each decoder block and then the root, so parameters live as DTensor shards
and are all-gathered one block at a time in forward/backward. Gradients are averaged over
ranks by FSDP (or, for replicas, by distflow.train.grad_sync); the loss code compensates with a global
normaliser (see algorithms.losses).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from distflow.config import ModelConfig, OptimConfig
from distflow.distributed import all_reduce
from distflow.distributed.devices import compute_dtype, concrete
from distflow.distributed.layout import ParallelLayout
from distflow.models.anatomy import decoder_blocks, experts_of, skeleton
from distflow.train.shared_prefix import Batch, install
from distflow.train.shared_prefix import PackedRows
from distflow.train.grad_sync import ReplicaGradReducer
from distflow.train.lm_head import chunked_stats, head_replaced, logit_softcap, output_head, token_stats
from distflow.train.lora import (
    adapters_disabled,
    add_adapters,
    dropout_off,
    has_adapters,
    peft_config,
    trainable_parameters,
)
from distflow.train.model_init import initial_model, is_meta, materialize
from distflow.train.router import RouterStats, aux_loss_coef, router_stats


def _backward_order(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The trainable parameters in the order FSDP2 finishes their gradients: the last decoder
    block's first, the root's own (embeddings, final norm, a head) last, in its final
    post-backward callback."""
    in_blocks = [p for b in reversed(blocks) for p in b.parameters()]
    seen = {id(p) for p in in_blocks}
    return [p for p in in_blocks + [p for p in model.parameters() if id(p) not in seen] if p.requires_grad]


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up reaching the full rate at optimizer step `warmup_steps` - 1, then constant
    (HF's constant_with_warmup starts at 0, a step behind)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0)


class ShardedModel:
    """An HF model sharded with FSDP2 (each decoder block, then the root), its AdamW optimizer
    and linear-warm-up LR schedule. trainable=False freezes it and builds no optimizer.

    `model` is either the loaded model or a meta-device skeleton (distflow.train.model_init); a skeleton
    is allocated after sharding and filled with `load_full()`, which only global rank 0 calls.

    offload=True (frozen models only) keeps the shards in host memory (pinned on CUDA) between uses:
    FSDP2's CPUOffloadPolicy copies a block's shard to the device just before gathering it, so the
    device holds about two gathered blocks of the model while it runs, and none of it otherwise."""

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, optim: OptimConfig, layout: ParallelLayout,
                 trainable: bool = True, lr: float | None = None, warmup_steps: int | None = None,
                 load_full: Callable[[], torch.nn.Module] | None = None, offload: bool = False):
        assert not (offload and trainable), "only a frozen model is offloaded (its optimizer would stay behind)"
        self.device = device = layout.device
        # concrete values only: the start-up plan resolved every "auto" (refused here, before any mesh)
        compute = compute_dtype(model_cfg.dtype)
        packs = concrete("optim.shared_prefix", optim.shared_prefix) == "on"
        model.config.use_cache = False
        mesh = layout.fsdp_mesh
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != torch.float32 else MixedPrecisionPolicy()
        if model_cfg.activation_checkpointing and trainable:
            # transformers' per-block checkpointing runs inside each block's __call__, so FSDP2's
            # hooks stay on the blocks themselves (it skips them during the recompute) and no
            # wrapper module renames the parameters that checkpoints and the engine sync use.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.logprob_chunk_tokens = model_cfg.logprob_chunk_tokens
        self.head_dtype = torch.float32 if model_cfg.logprob_head_float32 else None
        # The LM head the chunked logprob path stands in for, found (and refused if it cannot) here,
        # not mid-run; fully_shard keeps the module, so it stays valid after sharding.
        self.head = output_head(model) if self.logprob_chunk_tokens and model.get_output_embeddings() is not None \
            else None
        blocks = decoder_blocks(model)
        if packs:
            install(model)  # packed rows attend through it; padded rows keep the model's own
        self.lora = has_adapters(model)
        if compute != torch.float32 and (self.lora or not trainable):
            # frozen weights (a LoRA base, the KL reference) need no fp32 master copy: stored in
            # the compute dtype they are what the per-forward cast would give, in half the memory
            for p in model.parameters():
                if not (trainable and p.requires_grad):
                    p.data = p.data.to(compute)
        # pinned host memory makes the copies asynchronous; there is none to pin without CUDA
        placement = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=placement)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=placement)
        if is_meta(model):  # (offloaded shards move to pinned host memory at the first forward)
            self.model = materialize(model, device, load_full)
        else:  # fully_shard put the buffers on the device, and offloaded shards in host memory
            self.model = model if offload else model.to(device)
        self.model.train()
        self.reducer: ReplicaGradReducer | None = None
        if not trainable:
            self.model.requires_grad_(False)
            self.optimizer = self.scheduler = None
            return
        if layout.bucketed_replicas:
            self.reducer = ReplicaGradReducer(_backward_order(self.model, blocks), layout.replica_group,
                                              int(model_cfg.grad_bucket_mib * 2**20))
        # fused: one kernel over all parameters, about 2x faster than foreach for SmolLM2-135M on
        # CPU (bench/update.py); works on DTensor shards and on CUDA alike.
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(self.model),  # with LoRA, the adapters only
            lr=optim.lr if lr is None else lr,
            betas=(optim.beta1, optim.beta2),
            weight_decay=optim.weight_decay,
            fused=True,
        )
        self.scheduler = warmup_schedule(self.optimizer, optim.warmup_steps if warmup_steps is None else warmup_steps)
        self.max_grad_norm = optim.max_grad_norm
        self.skip_zero_gradient = optim.skip_zero_gradient

    def _reshard_if_no_grad(self) -> None:
        # FSDP2 keeps the root unsharded after forward in anticipation of backward; with no
        # backward coming, reshard so parameters are DTensor shards again (optimizer, sync).
        if not torch.is_grad_enabled():
            self.model.reshard()

    def all_reduce_gradients(self, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients across replicas (HSDP's replicate
        dimension, or the bucketed reducer's buckets). Off for all but a mini-batch's last
        micro-batch: gradients accumulate locally and cross the link once per optimizer step,
        not once per micro-batch. Shards are still reduce-scattered every pass, so memory does
        not grow; on a plain FSDP mesh there is no replicate dimension and this changes nothing."""
        if self.reducer is not None:
            self.reducer.enabled = enabled
        else:
            self.model.set_requires_all_reduce(enabled, recurse=True)

    def step(self, loss: float) -> tuple[float, str]:
        """Clip gradients and take one optimizer step, unless this rank's `loss` or the global
        gradient norm is not finite on ANY rank (one all_reduce decides, so every rank agrees):
        then the gradients are dropped and the weights, optimizer and schedule stay untouched.
        So too, with `skip_zero_gradient`, when the global gradient is exactly zero: Adam's stale
        moments would move the weights with no signal in the batch. Returns the pre-clip global
        grad norm and what happened: "taken", "nonfinite" or "zero_gradient"."""
        norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), self.max_grad_norm)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        bad = not (math.isfinite(loss) and math.isfinite(norm))
        worst = all_reduce(torch.tensor([float(bad), float(norm != 0.0)]), "max")
        outcome = ("nonfinite" if worst[0] > 0 else
                   "zero_gradient" if self.skip_zero_gradient and worst[1] == 0 else "taken")
        if outcome == "taken":
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, outcome

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def check_model_options(model_path: str, model_cfg: ModelConfig, config=None) -> None:
    """The model options that depend on the model itself, checked before any weights load, with one
    line on every rank: a router loss weight for a model without experts, and LoRA targets (a
    meta-device skeleton is adapted as the policy will be: a target that matches nothing or a layer
    PEFT cannot adapt is refused). Costs no memory and draws nothing from the RNG. `config`: the
    folder's HF config when the caller has read it already (the start-up plan)."""
    if config is None:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=model_cfg.trust_remote_code)
    aux_loss_coef(config, model_cfg.router_aux_loss_coef)
    if not model_cfg.lora.enabled:
        return
    model = skeleton(AutoModelForCausalLM, config, model_cfg.trust_remote_code)
    _adapt_skeleton(model, peft_config(model_cfg.lora, decoder_blocks(model)))


def _adapt_skeleton(model: torch.nn.Module, config) -> None:
    """Meta-device adapters on a meta skeleton: no memory, no RNG draws (a full load draws them)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        add_adapters(model, config)


class Policy(ShardedModel):
    """The causal LM being trained; trainable=False builds a frozen KL reference. With
    model.lora the model carries adapters (distflow.train.lora), and `base()` is its reference."""

    def __init__(self, model_path: str, model_cfg: ModelConfig, optim: OptimConfig, layout: ParallelLayout,
                 trainable: bool = True, offload: bool = False):
        # fp32 master weights always; bf16/fp16 only as FSDP's compute dtype.
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=model_cfg.trust_remote_code)
        self.router_aux_loss_coef = aux_loss_coef(config, model_cfg.router_aux_loss_coef)  # refused before loading
        model, load = initial_model(AutoModelForCausalLM, model_path, config, model_cfg.meta_device_init,
                                    model_cfg.trust_remote_code)
        self.adapter_config = None  # PEFT's LoraConfig of the adapters, when there are any
        if model_cfg.lora.enabled and trainable:
            config = self.adapter_config = peft_config(model_cfg.lora, decoder_blocks(model), model_path)
            if is_meta(model):  # the skeleton gets meta adapters; rank 0's load fills them
                _adapt_skeleton(model, config)
            else:
                add_adapters(model, config)
            load = (lambda full=load: add_adapters(full(), config))
        super().__init__(model, model_cfg, optim, layout, trainable, load_full=load, offload=offload)
        self.experts = experts_of(self.model.config)  # (experts, top-k) of a mixture-of-experts model
        self.router: RouterStats | None = None  # the last forward's (distflow.train.router)

    def base(self) -> "FrozenBase":
        """The policy with its adapters off: a LoRA run's KL reference, without a second model."""
        assert self.lora, "base() is the reference of a policy with adapters"
        return FrozenBase(self)

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """log p(response token | prefix) at `temperature`, shape [B, R] (0 beyond each response)."""
        return self.forward(batch, temperature)[0]

    def forward(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False):
        """(logprobs [B, R], entropy [B, R] or None) of the response tokens at `temperature`, for
        padded rows or a packed row (distflow.train.shared_prefix) alike."""
        targets = batch.targets
        inputs = dict(batch.model_inputs(), logits_to_keep=batch.logits_to_keep)
        if self.experts:
            inputs["output_router_logits"] = True
        # logprob passes (no grad) run without the adapters' dropout: deterministic, as the engine
        quiet = dropout_off(self.model) if self.lora and not torch.is_grad_enabled() else contextlib.nullcontext()
        if self.logprob_chunk_tokens > 0:  # the head runs chunk by chunk (distflow.train.lm_head)
            softcap = logit_softcap(self.model.config)  # read before head_replaced turns the model's own off

            def chunked_head(hidden: torch.Tensor) -> torch.Tensor:
                return chunked_stats(batch.select(hidden), self.head, targets, batch.resp_mask, temperature,
                                     self.logprob_chunk_tokens, with_entropy, self.head_dtype, softcap)

            with head_replaced(self.model, self.head, chunked_head), quiet, batch.forward_context():
                out = self.model(**inputs)
            stats = out.logits  # [B, R, 1 or 2]
            lp, entropy = stats[..., 0], (stats[..., 1] if with_entropy else None)
        else:  # [B, R, V] logits for the whole micro-batch
            with quiet, batch.forward_context():
                out = self.model(**inputs)
            lp, entropy = token_stats(batch.select(out.logits), targets, temperature, with_entropy)
            lp = lp * batch.resp_mask
            entropy = entropy * batch.resp_mask if with_entropy else None
        self.router = router_stats(out, batch.attention_mask, *self.experts) if self.experts else None
        self._reshard_if_no_grad()
        return lp, entropy


class FrozenBase:
    """A LoRA policy seen with its adapters off: the frozen base model, which is what a separate
    reference loaded from model.path would compute. Only the logprob pass the trainer asks of a
    reference (distflow.train.update.Updater.logprobs)."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        with adapters_disabled(self.policy.model):
            return self.policy.logprobs(batch, temperature)
