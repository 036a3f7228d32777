"""The PPO critic: a value head on the policy's architecture, sharded with FSDP2 like the policy.

It is the HF token-classification model with one label (backbone from the critic's model path,
a freshly initialised linear `score` head), as verl and OpenRLHF build theirs, so any causal LM
transformers knows has a critic without distflow code per architecture.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from distflow.config import CriticConfig, ModelConfig, OptimConfig
from distflow.distributed.layout import ParallelLayout
from distflow.train.model_init import initial_model
from distflow.train.policy import ShardedModel
from distflow.train.shared_prefix import Batch


class Critic(ShardedModel):
    def __init__(self, model_path: str, critic: CriticConfig, model_cfg: ModelConfig, optim: OptimConfig,
                 layout: ParallelLayout):
        # No dropout on the head: values must be a deterministic function of the weights.
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=model_cfg.trust_remote_code)
        config.num_labels, config.classifier_dropout = 1, 0.0
        # The head's initial weights come from the global RNG inside from_pretrained; with meta
        # start-up only rank 0 runs it and the head is broadcast (every rank has the same seed).
        model, load = initial_model(AutoModelForTokenClassification, model_path, config, model_cfg.meta_device_init,
                                    model_cfg.trust_remote_code)
        super().__init__(model, model_cfg, optim, layout, lr=critic.lr, warmup_steps=critic.lr_warmup_steps,
                         load_full=load)

    def values(self, batch: Batch) -> torch.Tensor:
        """V(state before each response token), [B, R], 0 beyond each response.

        The state before token t is the prefix ending at the previous token, the same position
        whose logits predict token t, so values and logprobs share one index.
        """
        with batch.forward_context():
            out = self.model(**batch.model_inputs()).logits[..., 0]
        v = batch.select_full(out).float()
        self._reshard_if_no_grad()
        return v * batch.resp_mask
