"""Messages between the two roles of a split run: pickled objects, rank to rank, never a collective.

A message is two point-to-point sends on the gloo link group (its byte count, then its bytes); the
pairs of one sender and one receiver arrive in the order they were sent. Sends return at once (the
buffers stay referenced until gloo is done with them); a receive is waited for until its deadline
(run.collective_timeout_s), and a peer that sends nothing by then stops this rank with a line that
names it: a dead or hung rank of the other role cannot leave this one waiting forever.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from distflow.distributed import one_line, waiting
from distflow.errors import RunAborted

KEEP_SENDS = 64  # sends whose buffers stay referenced before the oldest is waited for



def error_line(rank: int, error: BaseException) -> str:
    """The line a rank forwards to the other role when it stops on an error of its own."""
    return f"rank {rank} raised {type(error).__name__}: {one_line(error)}"


def received(message: dict) -> dict:
    """A message from the other role, or the RunAborted it forwards (a peer stopped on an error)."""
    if message.get("kind") == "abort":
        raise RunAborted(message["line"])
    return message


class PeerSilent(RunAborted):
    """A peer sent nothing before the deadline (it died, hung, or stopped on an error of its own)."""


class Links:
    """This rank's end of the messages to and from the other role's ranks (global rank numbers)."""

    def __init__(self, group, rank: int, timeout_s: float):
        self.group, self.rank, self.timeout_s = group, rank, timeout_s
        self._in_flight: list[tuple[list, list[torch.Tensor]]] = []  # (works, their buffers) not done yet

    def send(self, dst: int, obj: Any) -> int:
        """Start sending `obj` to `dst`; returns its size in bytes."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            works = [dist.isend(size, dst, group=self.group), dist.isend(data, dst, group=self.group)]
        except RuntimeError as e:  # gloo refuses at once once the peer's connection has closed
            raise PeerSilent(f"rank {dst} died or hung: rank {self.rank} could not send to it ({one_line(e)}); "
                             "stopping") from None
        self._in_flight.append((works, [size, data]))
        while len(self._in_flight) > KEEP_SENDS:  # gloo completes a send only in wait(): the oldest, long received
            for w in self._in_flight.pop(0)[0]:
                self._wait(w, dst, "its own message to be received")
        return len(payload)

    def recv(self, src: int, what: str) -> Any:
        """The next object `src` sent here; PeerSilent when none arrives within the deadline. `what`:
        what this rank waits for, for the line."""
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(size, src, group=self.group), src, what)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.irecv(data, src, group=self.group), src, what)
        return pickle.loads(data.numpy().tobytes())

    def _wait(self, work, src: int, what: str) -> None:
        # gloo marks a point-to-point work complete only in wait(), and a wait that times out closes the
        # pair: one wait with the whole deadline, not a poll
        with waiting():
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise PeerSilent(f"rank {src} died or hung: rank {self.rank} waited for {what} (at most "
                                 f"run.collective_timeout_s={self.timeout_s:g} s; {one_line(e)}); stopping") from None

    def abort(self, ranks: list[int], line: str) -> None:
        """Tell `ranks` this rank stops on an error (`line`), skipping any already gone (it may be the one
        that failed), and give the line at most 5 s to leave before this rank does."""
        for dst in ranks:
            try:
                self.send(dst, {"kind": "abort", "line": line})
            except RuntimeError:
                pass
        self.flush(timeout_s=5.0)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (at most `timeout_s`) until gloo is done with every send, so the group can be torn down;
        sends no peer will receive (it stopped on an error, or before its first step) are left behind."""
        timeout = datetime.timedelta(seconds=min(timeout_s, self.timeout_s))
        for works, _ in self._in_flight:
            for w in works:
                try:
                    w.wait(timeout=timeout)
                except RuntimeError:
                    return
        self._in_flight = []
