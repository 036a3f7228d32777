"""The optim section: the policy's AdamW, its learning-rate warm-up and clipping, and how each
rollout batch is split into mini-batches and micro-batches."""

from __future__ import annotations

import math
from typing import Literal

from distflow.config.fields import knob, section


@section
class OptimConfig:
    lr: float = knob(1e-5, "AdamW's learning rate for the policy.")
    weight_decay: float = knob(0.0, "AdamW's decoupled weight decay.")
    beta1: float = knob(0.9, "AdamW's beta1.")
    beta2: float = knob(0.999, "AdamW's beta2.")
    warmup_steps: int = knob(0, "Linear learning-rate warm-up over this many optimizer steps.")
    max_grad_norm: float = knob(1.0, "Gradients are clipped to this global norm.")
    skip_zero_gradient: bool = knob(
        True, "An optimizer step whose global gradient is exactly zero (every group's rewards equal and no KL or "
        "entropy term) is not taken, as torch.optim skips a parameter without a gradient: AdamW's moments would "
        "otherwise keep moving every weight along the last non-zero gradient, by about 0.67, 0.52, 0.42, ... "
        "x lr on the steps after it (docs/performance.md, the demo over sixteen seeds). false: step anyway, as "
        "TRL and verl do.")
    mini_batches: int = knob(1, "Optimizer steps per rollout batch (per PPO epoch).")
    micro_batch_size: int = knob(8, "Sequences per forward/backward pass.", operational=True)
    micro_batch_tokens: int = knob(
        0, "> 0: micro-batches by token budget instead (sequences x longest, padding included); either way sequences "
        "of similar length are batched together. With a shared prefix: packed tokens per micro-batch (0: "
        "micro_batch_size x the batch's longest sequence, the padded path's largest micro-batch).", operational=True)
    shared_prefix: Literal["auto", "on", "off"] = knob(
        "auto", "Packed rows that compute each group's prompt once (each response attends to it) in every "
        "forward over the batch: the same logprobs and gradients as padded rows, for fewer tokens. auto: on "
        "whenever algorithm.group_size > 1 or a harness's episodes train their branches (task.agent, agent.rows="
        "every); off: one padded row per sample.", operational=True)

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.micro_batch_size >= 1 and self.mini_batches >= 1,
             "optim.micro_batch_size and optim.mini_batches must be >= 1"),
            (self.micro_batch_tokens >= 0, f"optim.micro_batch_tokens must be >= 0 (0 = off), got {self.micro_batch_tokens}"),
            # AdamW's own rules, checked here so a mistake stops before any weights load
            (0 <= self.lr < math.inf, f"optim.lr must be >= 0, got {self.lr}"),
            (0 <= self.weight_decay < math.inf, f"optim.weight_decay must be >= 0, got {self.weight_decay}"),
            (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
             f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}"),
            (self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}"),
            (0 < self.max_grad_norm < math.inf, f"optim.max_grad_norm must be > 0, got {self.max_grad_norm}"),
        ]
