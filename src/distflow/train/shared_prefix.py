"""Packed, shared-prefix forward passes: each group's prompt is computed once per micro-batch.

A group's G samples share their prompt. Instead of G padded rows that each carry the prompt, a
packed row lays groups end to end, each written once as prompt + response 1 + ... + response G,
with no padding at all (a micro-batch is one packed row). Position ids restart after the prompt
for every response, so each response sees the positions it had in the engine, and attention is
restricted so each response sees its group's prompt and its own earlier tokens. The prompt's
activations then receive the sum of its G responses' gradients: the same logprobs, values and
gradients as the padded rows, for the prompt's share of the FLOPs divided by G.

The restriction lives in one attention function registered with transformers'
`AttentionInterface` (`install`). Per layer it runs two batched SDPA calls over gathered
queries, keys and values: the prompts (causal, right-padded to the longest prompt) and the
responses (each against its prompt's keys and its own, causal). Memory is that of the padded
rows' attention (responses x (prompt + response) scores), never a dense mask over the packed row.
Without a packed layout in its arguments the function is the model's own attention, unchanged,
so one model serves padded batches (the engine probe, `optim.shared_prefix=off`) as well.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from distflow.train.batch import TokenBatch

IMPLEMENTATION = "distflow_shared_prefix"
_BASE: dict[int, str] = {}  # id(config) -> the attention implementation the model had
_PACKED = {"active": False}  # set while a packed forward builds its masks (none is needed)


class PrefixLayout:
    """Where each group's prompt and each response sit in one packed row (index tensors on the
    row's device), and the masks their attention needs, built once and shared by every layer.

    A plain class, not a dataclass: FSDP2's input casting and checkpointing pass it through
    untouched as one opaque argument."""

    def __init__(self, prompts: list[list[int]], responses: list[list[int]], owner: list[int],
                 positions: torch.Tensor):
        device = positions.device
        self.positions = positions  # [L] position id of every token of the row
        self.prompt_idx, self.prompt_valid = _padded(prompts, device)  # [Np, Pmax]
        self.resp_idx, self.resp_valid = _padded(responses, device)  # [Nr, Rmax]
        owner_t = torch.tensor(owner, dtype=torch.long, device=device)
        # each response's keys: its prompt's, then its own
        self.kv_idx = torch.cat([self.prompt_idx[owner_t], self.resp_idx], 1)  # [Nr, Pmax + Rmax]
        self.kv_valid = torch.cat([self.prompt_valid[owner_t], self.resp_valid], 1)
        self._masks: dict = {}

    def response_mask(self, window: int | None) -> torch.Tensor:
        """[Nr, 1, Rmax, Pmax + Rmax]: a response token attends to its prompt and to its own
        earlier tokens (within `window` positions when the layer slides). Padded query rows see
        the prompt, so no row is empty."""
        key = ("resp", window)
        if key not in self._masks:
            p, r = self.prompt_idx.shape[1], self.resp_idx.shape[1]
            own = torch.ones((r, r), dtype=torch.bool, device=self.resp_idx.device).tril()
            causal = torch.cat([torch.ones((r, p), dtype=torch.bool, device=own.device), own], 1)
            mask = causal[None] & self.kv_valid[:, None, :]
            if window is not None:  # q - k < window, compared without an int64 [Nr, Rmax, Pmax + Rmax] difference
                q, k = self.positions[self.resp_idx], self.positions[self.kv_idx]
                mask = mask & (k[:, None, :] > q[:, :, None] - window)
            self._masks[key] = mask[:, None]
        return self._masks[key]

    def prompt_mask(self, window: int | None) -> torch.Tensor | None:
        """None (plain causal attention over right-padded prompts) unless the layer slides."""
        if window is None:
            return None
        key = ("prompt", window)
        if key not in self._masks:
            q = self.positions[self.prompt_idx]
            k, q = q[:, None, :], q[:, :, None]
            self._masks[key] = ((k <= q) & (k > q - window) & self.prompt_valid[:, None, :])[:, None]
        return self._masks[key]

    def additive(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as SDPA's additive float mask (0 or the dtype's lowest), built once per dtype.
        Handed a boolean mask, SDPA makes and keeps such a copy for backward in every layer; one
        copy that every layer shares keeps that memory at one layer's."""
        if mask is None:
            return None
        key = ("additive", id(mask), dtype)
        if key not in self._masks:
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            self._masks[key] = torch.where(mask, zero, torch.finfo(dtype).min)
        return self._masks[key]


def _padded(spans: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged index lists as [N, max] (padding points at index 0) and their validity."""
    width = max((len(s) for s in spans), default=0) or 1
    idx = torch.zeros((len(spans), width), dtype=torch.long)
    valid = torch.zeros((len(spans), width), dtype=torch.bool)
    for i, s in enumerate(spans):
        idx[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        valid[i, : len(s)] = True
    return idx.to(device), valid.to(device)


@dataclass(frozen=True)
class PackedRows:
    """One packed micro-batch: samples `b` (the micro-batch's rows of the rank's batch) laid out
    as groups in one row of L tokens. Its outputs are [b, W] per response token, exactly as the
    padded `TokenBatch.rows` of the same samples gives them."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    layout: PrefixLayout
    keep_positions: torch.Tensor  # [K] positions whose output predicts a response token
    window_index: torch.Tensor  # [b, W] into keep_positions: the predictor of response token t
    targets: torch.Tensor  # [b, W] response token t
    resp_len: torch.Tensor  # [b]
    resp_mask: torch.Tensor  # [b, W]

    @property
    def attention_mask(self) -> torch.Tensor:
        """[1, L]: every token is real (a packed row has no padding)."""
        return torch.ones_like(self.input_ids)

    def model_inputs(self) -> dict:
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, shared_prefix=self.layout)

    @property
    def logits_to_keep(self) -> torch.Tensor:
        return self.keep_positions

    def select(self, kept: torch.Tensor) -> torch.Tensor:
        """[1, K, ...] outputs at keep_positions -> [b, W, ...] per response token."""
        return kept[0][self.window_index]

    def select_full(self, out: torch.Tensor) -> torch.Tensor:
        """[1, L, ...] outputs at every position -> [b, W, ...] per response token."""
        return out[0][self.keep_positions[self.window_index]]

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """While the model builds its attention masks: none (the layout is the mask)."""
        _PACKED["active"] = True
        try:
            yield
        finally:
            _PACKED["active"] = False


@dataclass(frozen=True)
class RowTokens:
    """One sample as the packer sees it: its prompt's and response's token ids, on the host."""

    prompt: tuple[int, ...]
    response: list[int]


def row_tokens(tokens: TokenBatch) -> list[RowTokens]:
    """Every row of a left-padded batch, split into prompt and response (one copy to the host)."""
    ids, seq, resp = tokens.input_ids.tolist(), tokens.seq_len.tolist(), tokens.resp_len.tolist()
    width = tokens.input_ids.shape[1]
    return [RowTokens(tuple(row[width - n: width - r]), row[width - r:] if r else [])
            for row, n, r in zip(ids, seq, resp)]


def group_chunks(samples: list[RowTokens], rows: list[int], budget: int) -> list[list[int]]:
    """`rows` (indices into `samples`) as packing units: the rows of one prompt, in order, split
    so that prompt + responses fits `budget` tokens (a unit of one response may exceed it).
    Each unit computes its prompt once; a group split in k units computes it k times."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        by_prompt.setdefault(samples[i].prompt, []).append(i)
    units: list[list[int]] = []
    for prompt, members in by_prompt.items():
        unit, size = [], len(prompt)
        for i in members:
            n = len(samples[i].response)
            if unit and size + n > budget:
                units.append(unit)
                unit, size = [], len(prompt)
            unit.append(i)
            size += n
        units.append(unit)
    return units


def unit_tokens(samples: list[RowTokens], unit: list[int]) -> int:
    return len(samples[unit[0]].prompt) + sum(len(samples[i].response) for i in unit)


def plan_packed(samples: list[RowTokens], rows: list[int], budget: int) -> list[list[list[int]]]:
    """Micro-batches of packing units, each within `budget` packed tokens (a unit larger than the
    budget gets its own): units in order of size, largest first, each into the first micro-batch
    with room (first-fit decreasing)."""
    units = sorted(group_chunks(samples, rows, budget), key=lambda u: (-unit_tokens(samples, u), u[0]))
    plan: list[list[list[int]]] = []
    room: list[int] = []
    for unit in units:
        n = unit_tokens(samples, unit)
        k = next((j for j, r in enumerate(room) if r >= n), None)
        if k is None:
            plan.append([unit])
            room.append(budget - n)
        else:
            plan[k].append(unit)
            room[k] -= n
    return plan


def pack(samples: list[RowTokens], units: list[list[int]], resp_mask: torch.Tensor,
         device: torch.device) -> tuple[list[int], PackedRows]:
    """The packed row of `units`; returns (the rows in output order, the row). `resp_mask` is
    the rank's [B, R] response mask (observation tokens masked), cut to the rows' width."""
    ids: list[int] = []
    pos: list[int] = []
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    owner: list[int] = []
    order: list[int] = []
    predictors: list[list[int]] = []
    for unit in units:
        prompt = samples[unit[0]].prompt
        start = len(ids)
        ids.extend(prompt)
        pos.extend(range(len(prompt)))
        prompts.append(list(range(start, start + len(prompt))))
        for i in unit:
            response = samples[i].response
            first = len(ids)
            ids.extend(response)
            pos.extend(range(len(prompt), len(prompt) + len(response)))
            span = list(range(first, first + len(response)))
            if span:
                responses.append(span)
                owner.append(len(prompts) - 1)
            # token t is predicted by the prompt's last position (t = 0) or by token t - 1
            predictors.append([start + len(prompt) - 1] + span[:-1] if span else [])
            order.append(i)
    width = max(1, max(len(p) for p in predictors))
    flat = sorted({p for ps in predictors for p in ps}) or [0]
    where = {p: k for k, p in enumerate(flat)}
    window = torch.zeros((len(order), width), dtype=torch.long)
    targets = torch.zeros((len(order), width), dtype=torch.long)
    for row, (i, ps) in enumerate(zip(order, predictors)):
        window[row, : len(ps)] = torch.tensor([where[p] for p in ps], dtype=torch.long)
        targets[row, : len(ps)] = torch.tensor(samples[i].response, dtype=torch.long)
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    layout = PrefixLayout(prompts, responses, owner, positions)
    lens = torch.tensor([len(samples[i].response) for i in order], dtype=torch.long, device=device)
    rows = PackedRows(torch.tensor([ids], dtype=torch.long, device=device), positions[None], layout,
                      torch.tensor(flat, dtype=torch.long, device=device), window.to(device), targets.to(device),
                      lens, resp_mask[order, :width])
    return order, rows


Batch = Union[TokenBatch, PackedRows]  # what a forward pass takes


# --- the attention function ---------------------------------------------------------------

def _attend(q, k, v, mask, causal: bool, scaling, dropout: float, softcap) -> torch.Tensor:
    """SDPA, or the eager formula when the model soft-caps its attention scores (Gemma 2).

    Grouped-query keys and values reach SDPA unrepeated wherever its kernel takes them: always
    without a mask, and with one on CPU, whose flash kernel takes both. CUDA's masked kernels do
    not, and SDPA would fall back to the math kernel that materializes the scores, so there they
    are repeated to every head as transformers does."""
    rep = q.shape[1] // k.shape[1]
    grouped = rep > 1 and softcap is None and (mask is None or q.device.type == "cpu")
    if rep > 1 and not grouped:
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=causal and mask is None, scale=scaling,
                                              enable_gqa=grouped)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.tanh(q @ k.transpose(-1, -2) * scaling / softcap) * softcap
    if mask is None and causal:
        n = q.shape[-2]
        mask = torch.ones((n, n), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(scores.softmax(-1, dtype=torch.float32).to(q.dtype), p=dropout, training=dropout > 0)
    return probs @ v


def shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prefix: PrefixLayout | None = None, **kwargs):
    """[1, H, L, D] queries of a packed row -> ([1, L, H, D], None), as transformers' attention
    functions return; without a layout, the model's own attention function."""
    if shared_prefix is None:
        return _base_attention(module)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       **kwargs)
    lay, window, softcap = shared_prefix, kwargs.get("sliding_window"), kwargs.get("softcap")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [L, heads, D]

    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x[idx].permute(0, 2, 1, 3)  # [N, heads, n, D]

    def mask(m: torch.Tensor | None) -> torch.Tensor | None:  # the soft-capped formula takes booleans
        return m if softcap is not None else lay.additive(m, query.dtype)

    prompt_out = _attend(gather(q, lay.prompt_idx), gather(k, lay.prompt_idx), gather(v, lay.prompt_idx),
                         mask(lay.prompt_mask(window)), True, scaling, dropout, softcap)
    out = q.new_zeros(q.shape)
    out = out.index_copy(0, lay.prompt_idx[lay.prompt_valid], prompt_out.transpose(1, 2)[lay.prompt_valid])
    if lay.resp_idx.shape[0]:
        resp_out = _attend(gather(q, lay.resp_idx), gather(k, lay.kv_idx), gather(v, lay.kv_idx),
                           mask(lay.response_mask(window)), False, scaling, dropout, softcap)
        out = out.index_copy(0, lay.resp_idx[lay.resp_valid], resp_out.transpose(1, 2)[lay.resp_valid])
    return out[None], None


def _base_attention(module):
    """The attention function the model had: a registered one (sdpa, flash), or "eager", which
    transformers leaves to each model file's own `eager_attention_forward` (Gemma 2's soft cap)."""
    name = _BASE[id(module.config)]
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward")


def _mask(*args, config=None, **kwargs):
    """The model's own mask for padded batches; none for a packed row (its layout is the mask)."""
    base = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(_BASE[id(config)])
    if _PACKED["active"] or base is None:
        return None
    return base(*args, config=config, **kwargs)


AttentionInterface.register(IMPLEMENTATION, shared_prefix_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def install(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `shared_prefix_attention` (before sharding). Padded
    batches still run the model's own implementation, so nothing else changes."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        base = getattr(config, "_attn_implementation", None)
        if base is None or base == IMPLEMENTATION:
            continue
        _BASE[id(config)] = base
        config._attn_implementation = IMPLEMENTATION
