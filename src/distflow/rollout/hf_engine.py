"""transformers `generate` as a rollout engine: slower than vLLM, but runs wherever torch runs.

It keeps its own unsharded copy of the model on the rank's device; weight sync copies the
streamed full parameters into that copy.
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.config import ModelConfig, RolloutConfig
from distflow.distributed.devices import compute_dtype
from distflow.sample import Sample
from distflow.sample import left_pad


class HFEngine:
    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, device: torch.device):
        self.cfg = rollout
        self.device = device
        dtype = compute_dtype(model.dtype)  # concrete: the start-up plan resolved "auto"
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=model.trust_remote_code
        ).to(device).eval()
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        groups = []
        for prompt, seed in zip(prompts, seeds):  # one prompt at a time: per-prompt seeds stay reproducible
            torch.manual_seed(seed)
            ids, mask = (t.to(self.device) for t in left_pad([prompt] * n, self.pad_id))
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=not greedy,
                temperature=None if greedy else self.cfg.temperature,
                top_p=None if greedy else self.cfg.top_p,
                top_k=None,
                max_new_tokens=self.cfg.max_new_tokens,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_scores=True,
            )
            new = out.sequences[:, ids.shape[1]:]
            # scores are the processed logits the sampler drew from (temperature, top-p applied)
            logp = torch.stack(out.scores, dim=1).float().log_softmax(-1)
            token_lp = logp.gather(-1, new[:, : logp.shape[1], None]).squeeze(-1)
            group = []
            for row, lps in zip(new.tolist(), token_lp.tolist()):
                end = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
                resp = row[:end] if end else row
                group.append(Sample(list(prompt), resp, lps[: len(resp)], truncated=end is None))
            groups.append(group)
        return groups

    @torch.no_grad()
    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        result = []
        for s in seqs:
            ids = torch.tensor([s], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1].float()
            lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            result.append(lp.tolist())
        return result

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in weights:
            params[name].copy_(t)

    def sleep(self) -> None:
        """Nothing to free: the copy is the rollout model itself."""

    def shutdown(self) -> None:
        del self.model
