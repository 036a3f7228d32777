"""Replicas' gradient all-reduce in buckets, overlapped with the rest of backward.

With replicated parameters (model.shard_ranks=1) FSDP2's native HSDP all-reduces each block's
gradients inside that block's post-backward and waits for it before backward goes on: on CPU
(gloo, no streams) the whole transfer sits on the critical path, one block at a time. Here,
as torch's DDP reducer does, each model is sharded over a one-rank mesh (FSDP2 still gathers
and frees parameters block by block, and keeps its mixed precision) and this reducer owns the
traffic between replicas: a hook on every parameter sees its gradient land (FSDP2 calls
post-accumulate-grad hooks once it has written `.grad`), parameters are grouped into
fixed-size buckets in the order backward finishes them (the last decoder block first, the root's
embeddings and norm last), and a bucket whose gradients are all final is all-reduced in place,
asynchronously, while backward carries on. At the end of that backward (a callback queued in
autograd's engine, after FSDP2's own final callback) `finish()` waits for the buckets, so
`.backward()` returns with averaged gradients, as with DDP.

Only the micro-batch that ends a mini-batch all-reduces: the trainer turns `enabled` off for the
others, which accumulate locally, as with the native path (any other backward averages).
Buckets are launched strictly in order on every rank (a bucket that is ready early waits for the
ones before it), so collectives match across ranks whatever the timing; a parameter that
received no gradient is reduced as zeros at `finish()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distflow.distributed import complete, waiting


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def plan_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` (in readiness order) of at least `bucket_bytes` each (the
    last may be smaller); a parameter is never split."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        buckets[-1].append(p)
        size += _local(p).numel() * _local(p).element_size()
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


class ReplicaGradReducer:
    """Averages the gradients of `params` over the ranks of `group`, bucket by bucket, during
    backward. `params` in the order their gradients become final; each appears once."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int,
                 coalesce: bool | None = None):
        params = [p for p in params if p.requires_grad]
        nccl = dist.get_backend(group) == "nccl"
        # coalesce (default: on NCCL) one call per bucket and dtype; NCCL averages itself, gloo has no AVG
        self.coalesce = nccl if coalesce is None else coalesce
        self._averages = nccl  # the call itself averages; gloo sums, and the sums are divided here
        self._op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter is listed twice")
        self.group, self.world = group, dist.get_world_size(group)
        self.buckets = plan_buckets(params, bucket_bytes)
        self._bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        # As FSDP2's requires_all_reduce: every backward averages unless told not to (the
        # micro-batches that only accumulate), so replicas never drift apart by default.
        self.enabled = True
        # per bucket of the last synchronising backward: how many parameters had their final
        # gradient when it was sent (fewer than all: it went out while backward was still running)
        self.ready_at_launch: list[int] = []
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the first bucket not launched yet
        # (gradients, their flat copies when coalesced, the calls)
        self._inflight: list[tuple[list[torch.Tensor], list[torch.Tensor], list[dist.Work]]] = []
        self._armed = False  # finish() is queued for the end of the backward in flight

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._armed:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._armed, self.ready_at_launch = True, []
        self._ready[self._bucket_of[id(p)]] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch_next()
        self._drain(block=False)  # buckets whose sums have arrived are averaged now, not all at the end

    def _launch_next(self) -> None:
        """All-reduce the next bucket's gradients, asynchronously. Per tensor, in place (gloo): no
        flat copy in and out (on a 2-core machine the copies cost more than the overlap saves),
        and gloo runs the calls back to back in its own thread. Coalesced (NCCL): one flat buffer
        per dtype and one call, averaged by NCCL itself, as one kernel launch per bucket is what
        NCCL's bandwidth wants."""
        grads = []
        for p in self.buckets[self._next]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        self.ready_at_launch.append(sum(self._ready))
        if self.coalesce:
            flats = [torch.cat([g.reshape(-1) for g in grads if g.dtype == dtype])
                     for dtype in dict.fromkeys(g.dtype for g in grads)]
            works = [dist.all_reduce(f, op=self._op, group=self.group, async_op=True) for f in flats]
        else:
            flats, works = [], [dist.all_reduce(g, op=self._op, group=self.group, async_op=True) for g in grads]
        self._inflight.append((grads, flats, works))
        self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is left and wait for every bucket: the gradients are then averages (a
        parameter without one gets one). Runs at the end of a synchronising backward."""
        while self._next < len(self.buckets):
            self._launch_next()
        self._drain(block=True)
        self._reset()

    @torch.no_grad()
    def _drain(self, block: bool) -> None:
        """Turn the sums of the buckets in flight into averages, oldest first: all of them (block),
        or those whose all-reduces have already completed. Their gradients are final: backward no
        longer touches them."""
        while self._inflight and (block or all(w.is_completed() for w in self._inflight[0][2])):
            grads, flats, works = self._inflight.pop(0)
            with waiting():  # the rank that finished backward first waits here for the others
                complete(works)
            if not self._averages:
                torch._foreach_div_(flats or grads, float(self.world))
            for flat in flats:  # coalesced: the averages go back into the gradients of that dtype
                same = [g for g in grads if g.dtype == flat.dtype]
                torch._foreach_copy_(same, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in same]), same)])

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
