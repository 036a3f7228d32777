"""transformers models as a step-wise rollout engine: slower than vLLM, but runs wherever torch runs.

It keeps its own unsharded copy of the model on the rank's device; weight sync copies the
streamed full parameters into that copy. Every running sample is one row of a single batch
(distflow.rollout.hf_decoder): a step prefills what was submitted since the last one, joins it to
the running rows and decodes one token for all of them, so a step costs one forward (two when
requests join) however many requests run. A request samples from its own generator, seeded with
its seed, its running rows drawing in row order, so its samples do not depend on what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.config import ModelConfig, RolloutConfig
from distflow.distributed.devices import compute_dtype
from distflow.rollout.base import Request, generate_by_steps
from distflow.rollout.hf_decoder import RowBatch, warp
from distflow.rollout.precision import Float32Head
from distflow.sample import Sample


@dataclass
class _Row:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the engine's version as each token was sampled
    done: bool = False
    truncated: bool = True  # until an end-of-sequence token ends it


@dataclass
class _Running:
    request: Request
    max_tokens: int
    generator: torch.Generator | None  # None: greedy
    rows: list[_Row]

    def samples(self) -> list[Sample]:
        """Each row so far, each token tagged with the version that sampled it; truncated unless an
        end-of-sequence token ended it."""
        prompt = list(self.request.prompt_ids)
        return [Sample(prompt, r.tokens, r.logprobs, r.truncated, versions=list(r.versions)) for r in self.rows]


class HFEngine:
    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, device: torch.device):
        self.cfg = rollout
        self.device = device
        self.version = 0
        dtype = compute_dtype(model.dtype)  # concrete: the start-up plan resolved "auto"
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=model.trust_remote_code
        ).to(device).eval()
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
        self._queued: dict[str, Request] = {}
        self._running: dict[str, _Running] = {}
        self._rows: list[tuple[str, int]] = []  # (request id, sample index) of each batch row, in batch order
        self._batch = RowBatch(self.model, device, self.pad_id)
        # The trainer's float32 head, matched here (distflow.rollout.precision): the same logits'
        # precision on both sides, so bf16 leaves only the body's kernels between them
        self.head32 = Float32Head(self.model) if model.head_float32 and dtype != torch.float32 else None

    def submit(self, request: Request) -> None:
        if request.request_id in self._queued or request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r} is already pending")
        if not request.prompt_ids or request.n < 1 or (request.max_tokens is not None and request.max_tokens < 1):
            raise ValueError(f"request {request.request_id!r} needs a prompt, n >= 1 and max_tokens >= 1")
        self._queued[request.request_id] = request

    def pending(self) -> int:
        return len(self._queued) + len(self._running)

    def running_samples(self) -> int:
        """Samples the next step decodes: one batch row each (a benchmark's emulated engine time)."""
        return len(self._rows) + sum(r.n for r in self._queued.values())

    @torch.no_grad()
    def step(self) -> list[tuple[str, list[Sample]]]:
        if self._queued:
            self._join(list(self._queued.values()))
            self._queued.clear()
        if not self._rows:
            return []
        tokens, logprobs = self._sample(self._batch.decode())
        self._batch.feed = tokens
        keep, touched = [], {}
        for b, ((rid, i), tok, lp) in enumerate(zip(self._rows, tokens.tolist(), logprobs.tolist())):
            run = touched.setdefault(rid, self._running[rid])
            row = run.rows[i]
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            if tok in self.eos_ids and not run.request.ignore_eos:
                row.done, row.truncated = True, False
            elif len(row.tokens) >= run.max_tokens:
                row.done = True
            else:
                keep.append(b)
        if len(keep) < len(self._rows):
            self._batch.keep(keep)
            self._rows = [self._rows[b] for b in keep]
        finished = [rid for rid, run in touched.items() if all(r.done for r in run.rows)]
        return [(rid, self._running.pop(rid).samples()) for rid in finished]

    def abort(self, request_ids: list[str]) -> dict[str, list[Sample]]:
        out = {}
        for rid in request_ids:
            if rid in self._queued:
                request = self._queued.pop(rid)
                out[rid] = [Sample(list(request.prompt_ids), [], [], True, versions=[]) for _ in range(request.n)]
            elif rid in self._running:
                out[rid] = self._running.pop(rid).samples()
        if out and any(rid in out for rid, _ in self._rows):
            keep = [b for b, (rid, _) in enumerate(self._rows) if rid not in out]
            self._batch.keep(keep)
            self._rows = [self._rows[b] for b in keep]
        return out

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        return generate_by_steps(self, prompts, n, seeds, greedy)

    def _join(self, requests: list[Request]) -> None:
        self._batch.join([r.prompt_ids for r in requests for _ in range(r.n)])
        for r in requests:
            generator = None
            if not r.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(r.seed)
            self._running[r.request_id] = _Running(r, r.max_tokens or self.cfg.max_new_tokens, generator,
                                                   [_Row() for _ in range(r.n)])
            self._rows += [(r.request_id, i) for i in range(r.n)]

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its logprob under the scores it was drawn from (greedy: the raw
        logits' argmax; sampled: temperature and top-p, as `generate`'s output_scores were)."""
        greedy = [self._running[rid].generator is None for rid, _ in self._rows]
        tokens = logits.argmax(-1)
        if all(greedy):
            return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        scores = warp(logits, self.cfg.temperature, self.cfg.top_p)
        if any(greedy):
            scores = torch.where(torch.tensor(greedy, device=logits.device)[:, None], logits, scores)
        probs = scores.softmax(-1)
        start = 0
        while start < len(self._rows):  # a request's running rows are consecutive in the batch
            rid, end = self._rows[start][0], start + 1
            while end < len(self._rows) and self._rows[end][0] == rid:
                end += 1
            generator = self._running[rid].generator
            if generator is not None:
                tokens[start:end] = torch.multinomial(probs[start:end], 1, generator=generator).squeeze(1)
            start = end
        return tokens, scores.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)

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
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     keep_running: bool = False) -> None:
        """In place; running rows go on with their KV cache (`keep_running` or not: nothing here needs it)."""
        params = dict(self.model.named_parameters())
        for name, t in weights:
            params[name].copy_(t)
        if self.head32 is not None:
            self.head32.refresh()
        if version is not None:
            self.version = version

    def sleep(self) -> None:
        """Nothing to free: the copy is the rollout model itself."""

    def shutdown(self) -> None:
        del self.model, self._batch
