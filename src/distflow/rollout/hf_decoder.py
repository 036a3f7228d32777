"""The HF engine's running batch: rows that share one transformers `DynamicCache` and decode together.

Rows join (a prefill) and leave (finished or aborted) between decode steps, so rows of different
lengths sit in one cache: each row's real tokens are contiguous at the right end of the cache and
zeros with attention mask 0 fill the columns before them. transformers builds the causal mask from
cache columns and the padding mask, and RoPE takes explicit position ids (the row's real-token
count), so padding changes nothing a row computes beyond float rounding. Columns that are padding
in every row are cut after rows leave, so the cache grows only with the longest running row.

The cache is built without the model's config: every layer is a plain full `DynamicLayer` (a
sliding-window layer's rolling buffer could not be padded); sliding-window models still attend
within their window, since the mask applies it by column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from distflow.sample import left_pad


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The scores transformers' `generate` samples from: temperature, then top-p as its
    TopPLogitsWarper does it (the smallest set whose probability reaches top_p, at least one
    token; the rest -inf). Each warper is skipped where `generate` skips it (1.0)."""
    scores = logits / temperature if temperature != 1.0 else logits
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return scores


class RowBatch:
    """The running rows: their shared cache, padding mask, real-token counts and the token each
    feeds at the next decode (the last prompt token, then each sampled one)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int):
        self.model, self.device, self.pad_id = model, device, pad_id
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # [rows, cache columns]
        self.lens = torch.zeros(0, dtype=torch.long, device=device)  # real tokens in the cache per row
        self.feed = torch.zeros(0, dtype=torch.long, device=device)  # fed at the next decode

    def __len__(self) -> int:
        return self.feed.shape[0]

    def join(self, prompts: list[list[int]]) -> None:
        """Prefill every prompt but its last token in one left-padded forward and append the rows;
        the last token goes in with the next decode, with the running rows' tokens."""
        heads = [p[:-1] for p in prompts]
        fresh = DynamicCache()
        if max(len(h) for h in heads):
            ids, mask = (t.to(self.device) for t in left_pad(heads, self.pad_id))
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=fresh,
                       use_cache=True, logits_to_keep=1)
        else:  # one-token prompts: nothing to prefill
            mask = torch.zeros((len(prompts), 0), dtype=torch.long, device=self.device)
        self._merge(fresh, mask)
        self.lens = torch.cat([self.lens, torch.tensor([len(h) for h in heads], device=self.device)])
        self.feed = torch.cat([self.feed, torch.tensor([p[-1] for p in prompts], device=self.device)])

    def _merge(self, fresh: DynamicCache, mask: torch.Tensor) -> None:
        """Append the rows of `fresh` below the running ones, the narrower side padded on the left."""
        if self.cache is None or not len(self):
            self.cache, self.mask = fresh, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        rows = mask.shape[0]
        for i, layer in enumerate(self.cache.layers):
            joined = fresh.layers[i] if i < len(fresh.layers) else None  # none: nothing was prefilled
            new_keys = joined.keys if joined is not None else _no_columns(layer.keys, rows)
            new_values = joined.values if joined is not None else _no_columns(layer.values, rows)
            layer.keys = torch.cat([_pad_left(layer.keys, width), _pad_left(new_keys, width)])
            layer.values = torch.cat([_pad_left(layer.values, width), _pad_left(new_values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])

    def decode(self) -> torch.Tensor:
        """Feed every row its next token (one forward); the next-token logits [rows, vocab], float32."""
        if self.cache is None:
            self.cache = DynamicCache()
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        out = self.model(input_ids=self.feed[:, None], attention_mask=self.mask, position_ids=self.lens[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.lens = self.lens + 1
        return out.logits[:, -1].float()

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order), dropping the others' cache, and cut the columns that
        are padding in every remaining row."""
        if not rows:
            self.cache = None
            self.mask, self.lens, self.feed = self.mask[:0, :0], self.lens[:0], self.feed[:0]
            return
        index = torch.tensor(rows, device=self.device)
        self.mask, self.lens, self.feed = self.mask[index], self.lens[index], self.feed[index]
        cut = int((self.mask.shape[1] - self.lens).min())
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, cut:], layer.values[index, :, cut:]
        self.mask = self.mask[:, cut:]


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros before the sequence dimension of a [rows, columns] mask or [rows, heads, columns, dim] cache."""
    missing = width - (t.shape[1] if t.dim() == 2 else t.shape[2])
    if not missing:
        return t
    return F.pad(t, (missing, 0)) if t.dim() == 2 else F.pad(t, (0, 0, missing, 0))


def _no_columns(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A [rows, heads, 0, dim] cache tensor shaped like `like`."""
    return like.new_zeros((rows, like.shape[1], 0, like.shape[3]))
