"""Versioned weights from a trainer to its rollout set: `WeightPublisher` and `WeightReceiver`.

Every trainer gathers the full policy (FSDP's gather is collective over the trainers) and broadcasts
it to its own rollout set over their weight group (distflow.distributed.roles): each rollout rank
receives its bytes once, from one trainer, so a trainer sends |rollout set| x the model per version
whatever the world size. Tensors travel in buckets of one dtype, flattened; before each bucket an
announce message (distflow.pipeline.links) names the version and the bucket's tensors, so the
receiver allocates, joins the broadcast and hands the engine (name, tensor) pairs as they arrive.
The broadcasts are polled against the run's deadline like every wait between the roles.

A rollout rank receives in a thread (`StagedVersions`): each version's buckets into tensors of its own
as soon as its trainer broadcasts them, so a trainer waits for no engine step. A bounded number of
versions wait to be applied (the staged schedule's eta, inflight's one: the weights' memory that many
times more on the rollout rank, on its device, or with pipeline.staging=host in pinned host memory).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from distflow.config.pipeline import BROADCAST_BUCKET_BYTES
from distflow.distributed import waiting
from distflow.pipeline.links import Links, PeerSilent, received

POLL_S = 0.002


def _buckets(weights: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in weights:
        if bucket and (t.dtype != bucket[0][1].dtype or size + t.numel() * t.element_size() > limit):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def _broadcast(flat: torch.Tensor, src: int, group, timeout_s: float, what: str) -> None:
    work = dist.broadcast(flat, src=src, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    with waiting():
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise PeerSilent(f"the broadcast of {what} did not complete within {timeout_s:g} s "
                                 "(run.collective_timeout_s): a rank of its weight group died or hung; stopping")
            time.sleep(POLL_S)
    work.wait()


class WeightPublisher:
    """A trainer's side: announce a version to its rollout set, then broadcast its tensors."""

    def __init__(self, links: Links, rank: int, rollout_set: list[int], group, timeout_s: float,
                 bucket_bytes: int = BROADCAST_BUCKET_BYTES):
        self.links, self.rank, self.rollout_set, self.group = links, rank, rollout_set, group
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.sent_bytes = 0  # weight bytes this trainer broadcast so far

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]] | None, version: int,
                notes: dict[int, dict] | None = None) -> None:
        """Version `version` to the rollout set: `weights` (None: the version without weights, when no
        engine will generate with it); `notes[rank]`: more fields for that rank's announces."""
        def announce(dst: int, **fields) -> None:
            self.links.send(dst, {"kind": "weights", "version": version, **(notes or {}).get(dst, {}), **fields})

        if weights is None:
            for dst in self.rollout_set:
                announce(dst, bucket=None, last=True)
            return
        pending = None  # one bucket of lookahead: the last one is announced as such
        for bucket in _buckets(weights, self.bucket_bytes):
            if pending is not None:
                self._send(pending, version, announce, last=False)
            pending = bucket
        if pending is not None:
            self._send(pending, version, announce, last=True)

    def _send(self, bucket, version: int, announce, last: bool) -> None:
        layout = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        for dst in self.rollout_set:
            announce(dst, bucket=layout, last=last)
        if not self.rollout_set:
            return
        flat = torch.cat([t.detach().reshape(-1) for _, t in bucket])
        _broadcast(flat, self.rank, self.group, self.timeout_s, f"version {version}'s weights")
        self.sent_bytes += flat.numel() * flat.element_size()


class WeightReceiver:
    """A rollout rank's side: the announces and buckets of one version, as (name, tensor) pairs."""

    def __init__(self, links: Links, publisher: int, group, device: torch.device, timeout_s: float):
        self.links, self.publisher, self.group, self.device = links, publisher, group, device
        self.timeout_s = timeout_s

    def announce(self) -> dict:
        """The next message from the publisher (a version's first announce, or a control message)."""
        return self.links.recv(self.publisher, "the next announce of its trainer")

    def tensors(self, first: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """The version `first` announced: its buckets in order, each tensor as it is unflattened."""
        message = first
        while True:
            if message["bucket"] is None:
                return
            layout = message["bucket"]
            numels = [int(torch.Size(shape).numel()) for _, shape, _ in layout]
            flat = torch.empty(sum(numels), dtype=layout[0][2], device=self.device)
            _broadcast(flat, self.publisher, self.group, self.timeout_s, f"version {message['version']}'s weights")
            for (name, shape, _), part in zip(layout, flat.split(numels)):
                yield name, part.view(shape)
            if message["last"]:
                return
            message = self.announce()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A received tensor in pinned host memory (a CPU tensor stays as it is: the host is its device)."""
    if t.device.type == "cpu":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


class StagedVersions:
    """A rollout rank's announces, received by a thread as they come: a version's weights into tensors of
    their own (its bucket broadcasts joined at once while fewer than `ahead` received versions wait to
    be taken, so the trainer waits for no engine step), a control as it is. The rank takes them in
    order: `wait` for the next, or `poll` between engine steps."""

    def __init__(self, receiver: WeightReceiver, steps: int, timeout_s: float, ahead: int = 1, host: bool = False):
        """`host` (pipeline.staging=host): each received tensor moves to pinned host memory at once, so the
        device holds one broadcast bucket at a time instead of `ahead` versions."""
        self.receiver, self.steps, self.timeout_s, self.host = receiver, steps, timeout_s, host
        self.room = threading.Semaphore(ahead)  # versions staged and not yet taken, at most `ahead`
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._receive, name="distflow-versions", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                message = self.receiver.announce()
                if message.get("kind") == "weights":
                    tensors = None
                    if message["bucket"] is not None:
                        self.room.acquire()  # the trainer's broadcast waits here while a version waits to be taken
                        tensors = [(name, _to_host(t) if self.host else t) for name, t in
                                   self.receiver.tensors(message)]
                    self.queue.put((message, tensors))
                    continue
                self.queue.put((message, None))
                if message.get("kind") != "control" or message["halt"] or message["step"] >= self.steps:
                    return  # an abort line, a stop, or the run's last step: nothing follows
        except BaseException as e:  # raised where the rank takes it (a silent trainer: PeerSilent)
            self.queue.put((e, None))

    def _taken(self, item: tuple) -> tuple[dict, list | None]:
        message, tensors = item
        if isinstance(message, BaseException):
            raise message
        if tensors is not None:
            self.room.release()
        return received(message), tensors

    def poll(self) -> list[tuple[dict, list | None]]:
        """What arrived since the last poll, in order (an abort or an error raises here)."""
        out = []
        while True:
            try:
                out.append(self._taken(self.queue.get_nowait()))
            except queue.Empty:
                return out

    def wait(self) -> tuple[dict, list | None]:
        """The next message (the thread's own waits end at the run's deadline with PeerSilent)."""
        try:
            return self._taken(self.queue.get(timeout=self.timeout_s + 60.0))
        except queue.Empty:
            raise PeerSilent(f"no announce arrived within {self.timeout_s:g} s (run.collective_timeout_s) and its "
                             "receiving thread is stuck; stopping") from None

    def close(self) -> None:
        self.thread.join(timeout=5.0)
