"""Rewards computed by models: reward models (Hugging Face sequence classifiers with one label) and
LLM judges (a causal LM's P(yes) / (P(yes) + P(no)) at the next token after a question about the
sample). Each is one more frozen model's forward over the rank's own samples, as the KL reference
is: built and sharded with FSDP2 by the same layout (distflow.train.policy.ShardedModel), run
without gradients in token-budget micro-batches, in its compute dtype.

Each model reads the conversation through its own tokenizer and chat template, not the policy's:
a reward model sees the prompt's messages and the response as the assistant's turn; a judge sees
its template filled with the question (the prompt's last user message), the answer (the response
text) and the reference answer, as one user turn with the generation prompt. Sequences longer
than a model's max_tokens keep their last max_tokens tokens (where a classifier reads its score
and a judge its next token), counted in the metrics.

The forward passes are collectives (FSDP2 gathers each block): every rank runs as many passes as
the rank with the most, padding with a one-token pass, so ranks with fewer samples (or none) keep
step. Rows are left-padded with explicit position ids, so the last position of every row is its
last real token and a padded row computes what the sequence alone computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from distflow.config import ConfigError, DistflowConfig, ModelConfig, OptimConfig
from distflow.config.task import JudgeSpec, RewardModelSpec
from distflow.distributed import all_reduce
from distflow.distributed.layout import ParallelLayout
from distflow.sample import Sample
from distflow.tasks.prompts import PromptItem
from distflow.train.model_init import initial_model
from distflow.train.policy import ShardedModel
from distflow.train.update import plan_micro_batches


def conversation(item: PromptItem, sample: Sample, response_text: str) -> list[dict]:
    """The prompt's messages and what the policy answered: its response as the assistant's turn,
    or a multi-turn episode's turns and observations."""
    prompt = item.messages or [{"role": "user", "content": item.prompt_text}]
    turns = sample.episode.transcript if sample.episode is not None else \
        [{"role": "assistant", "content": response_text}]
    return [*prompt, *turns]


def question_of(item: PromptItem) -> str:
    """What a judge is told the question was: the prompt's last user message."""
    users = [m["content"] for m in item.messages if m.get("role") == "user"]
    return users[-1] if users else item.prompt_text


def check_reward_model_config(config, where: str) -> None:
    """A reward model must be a sequence classifier with one label (its score), one line otherwise."""
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(f"{where} is not a sequence classifier (its config.json names {architectures}): a reward "
                          "model is an AutoModelForSequenceClassification with one label; a causal LM can score "
                          "as a judge (task.judges)")
    if config.num_labels != 1:
        raise ConfigError(f"{where} is a classifier with {config.num_labels} labels: a reward model has one (its "
                          "score)")


def judge_token_ids(tokenizer, spec: JudgeSpec, where: str) -> tuple[int, int]:
    """The ids of the judge's yes and no words, each one token of its vocabulary, or one line."""
    ids = []
    for word in (spec.yes, spec.no):
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise ConfigError(f"{where}: {word!r} is {len(pieces)} tokens in the judge's vocabulary "
                              f"({pieces}), not one; choose yes/no words the judge writes as one token")
        ids.append(pieces[0])
    if ids[0] == ids[1]:
        raise ConfigError(f"{where}: yes {spec.yes!r} and no {spec.no!r} are the same token")
    return ids[0], ids[1]


class ScoringModel:
    """A frozen model that scores token sequences in agreed, left-padded micro-batches."""

    def __init__(self, auto_cls, spec, model_cfg: ModelConfig, optim: OptimConfig, layout: ParallelLayout,
                 path: str):
        self.spec, self.device = spec, layout.device
        trust = model_cfg.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else int(pad)
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = self.pad_id  # a classifier reads its score at the last non-pad token
        model, load = initial_model(auto_cls, path, config, model_cfg.meta_device_init, trust)
        own = dataclasses.replace(model_cfg, dtype=spec.dtype or model_cfg.dtype, logprob_chunk_tokens=0,
                                  activation_checkpointing=False)
        self.net = ShardedModel(model, own, dataclasses.replace(optim, shared_prefix="off"), layout,
                                trainable=False, load_full=load, offload=spec.offload)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> tuple[list[int], bool]:
        """(ids, truncated): a rendered chat (its special tokens written in the text) or plain text
        (the tokenizer's own special tokens added), cut to its last max_tokens tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=not self.templated)
        cut = len(ids) > self.spec.max_tokens
        return (ids[-self.spec.max_tokens:] if cut else ids), cut

    def render(self, item: PromptItem, sample: Sample, text: str) -> str:
        """What this model reads about one sample, as text."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def scores(self, seqs: list[list[int]]) -> torch.Tensor:
        """[len(seqs)] float32 scores (a collective: every rank calls it, with any number of sequences)."""
        plan = plan_micro_batches([len(s) for s in seqs], 1, self.spec.batch_tokens) if seqs else []
        passes = int(all_reduce(torch.tensor(float(len(plan))), "max"))
        out = torch.zeros(len(seqs), dtype=torch.float32)
        for k in range(passes):
            rows = plan[k] if k < len(plan) else []
            batch = [seqs[i] for i in rows] or [[self.pad_id]]  # a rank with nothing left keeps step
            width = max(len(s) for s in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(s)) + s for s in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in batch], device=self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            values = self.forward(ids, mask, positions).float().cpu()
            if rows:
                out[rows] = values
        self.net._reshard_if_no_grad()
        return out


class RewardModel(ScoringModel):
    """A sequence classifier's one logit at the conversation's last token."""

    def __init__(self, spec: RewardModelSpec, model_cfg: ModelConfig, optim: OptimConfig, layout: ParallelLayout,
                 path: str):
        check_reward_model_config(AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code),
                                  f"task.reward_models {path}")
        super().__init__(AutoModelForSequenceClassification, spec, model_cfg, optim, layout, path)

    def render(self, item: PromptItem, sample: Sample, text: str) -> str:
        messages = conversation(item, sample, text)
        if self.templated:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def forward(self, ids, mask, positions):
        return self.net.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0]


class Judge(ScoringModel):
    """P(yes) / (P(yes) + P(no)) of a causal LM's next token after the judge's question."""

    def __init__(self, spec: JudgeSpec, model_cfg: ModelConfig, optim: OptimConfig, layout: ParallelLayout,
                 path: str):
        super().__init__(AutoModelForCausalLM, spec, model_cfg, optim, layout, path)
        self.yes, self.no = judge_token_ids(self.tokenizer, spec, f"task.judges {path}")

    def render(self, item: PromptItem, sample: Sample, text: str) -> str:
        content = self.spec.template.format(question=question_of(item), answer=text, reference=item.answer)
        if self.templated:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                      add_generation_prompt=True, tokenize=False)
        return content

    def forward(self, ids, mask, positions):
        logits = self.net.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
        last = logits[:, -1].float()
        return torch.sigmoid(last[:, self.yes] - last[:, self.no])  # = p_yes / (p_yes + p_no), exactly


class ModelRewards:
    """Every reward model and judge of the run; `__call__` gives their weighted sum per sample."""

    def __init__(self, cfg: DistflowConfig, layout: ParallelLayout, paths: dict[str, str] | None = None,
                 phase: Callable[[str], ContextManager] | None = None):
        """`paths`: each entry's local folder by its path as configured (default: as configured)."""
        paths = paths or {}
        t = cfg.task
        self.models: list[tuple[str, ScoringModel]] = []
        for spec in t.reward_model_specs:
            self.models.append((f"reward_model/{spec.name}", RewardModel(spec, cfg.model, cfg.optim, layout,
                                                                         paths.get(spec.path, spec.path))))
        for spec in t.judge_specs:
            self.models.append((f"judge/{spec.name}", Judge(spec, cfg.model, cfg.optim, layout,
                                                           paths.get(spec.path, spec.path))))
        self.phase = phase or (lambda name: contextlib.nullcontext())

    def __call__(self, items: list[PromptItem], samples: list[Sample], texts: list[str],
                 group_size: int) -> tuple[torch.Tensor, dict[str, float]]:
        """([len(samples)] weighted sum of every model's score, this rank's metric sums: per model the
        raw scores' sum, sum of squares, count and truncated count). `texts`: each response decoded."""
        total = torch.zeros(len(samples), dtype=torch.float32)
        sums: dict[str, float] = {}
        for key, model in self.models:
            seqs, cut = [], 0
            for i, (sample, text) in enumerate(zip(samples, texts)):
                ids, truncated = model.encode(model.render(items[i // group_size], sample, text))
                seqs.append(ids)
                cut += truncated
            with self.phase(f"score_{key.replace('/', '_')}"):
                raw = model.scores(seqs)
            total += model.spec.weight * raw
            sums.update({f"{key}/sum": float(raw.double().sum()), f"{key}/sq": float((raw.double() ** 2).sum()),
                         f"{key}/n": float(len(raw)), f"{key}/truncated": float(cut)})
        return total, sums


def model_reward_metrics(g: dict[str, float], keys: list[str]) -> dict[str, float]:
    """Each model's raw score mean and std over every rank's samples, and its truncated count."""
    out = {}
    for key in keys:
        n = g[f"{key}/n"]
        mean = g[f"{key}/sum"] / n if n else 0.0
        var = max(g[f"{key}/sq"] / n - mean * mean, 0.0) if n else 0.0
        out.update({f"{key}/mean": mean, f"{key}/std": math.sqrt(var), f"{key}/truncated": g[f"{key}/truncated"]})
    return out

