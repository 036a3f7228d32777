"""Cross-rank length balancing of rollout groups, without a coordinator.

After rollout, ranks hold different numbers of tokens, and the FSDP update is as slow as the
rank with the most. Every rank gathers the per-group token costs, computes the same
deterministic assignment of whole groups to ranks (a group's samples must stay together for
group-relative advantages), then ships groups peer to peer: each byte goes only to the rank
that needs it, never through an all-gather of the payload.

Collectives are looked up as `dist.<name>` at call time (not bound at import) so wrappers
installed on torch.distributed, such as the communication benchmark's counters, see them.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from distflow import distributed as dd

Assignment = list[list[tuple[int, int]]]


def _identity(costs: list[list[int]]) -> Assignment:
    return [[(r, i) for i in range(len(c))] for r, c in enumerate(costs)]


def balanced_assignment(costs: list[list[int]]) -> Assignment:
    """For each destination rank, the sorted (source_rank, group_index) pairs it will own.

    costs[r][i] is the token cost of group i now on rank r. Greedy longest-processing-time
    (within 4/3 of the optimal max load) builds the partitions; each partition then goes to the
    rank already holding most of it, to keep traffic low. Pure and deterministic, so every rank
    computes the same answer from the same gathered costs. If LPT would not strictly lower the
    max load, nothing moves: rebalancing must never make the slowest rank slower.
    """
    world = len(costs)
    if any(c < 0 for row in costs for c in row):
        raise ValueError("group costs must be non-negative")
    current = [sum(row) for row in costs]
    if world <= 1:
        return _identity(costs)

    items = sorted(((c, r, i) for r, row in enumerate(costs) for i, c in enumerate(row)),
                   key=lambda t: (-t[0], t[1], t[2]))
    loads, parts = [0] * world, [[] for _ in range(world)]
    for c, r, i in items:
        p = min(range(world), key=lambda q: (loads[q], q))
        loads[p] += c
        parts[p].append((r, i))
    if max(loads) >= max(current):
        return _identity(costs)

    # Greedy max-weight matching of partitions to ranks: weight = (tokens, groups) already on that
    # rank, so zero-cost groups also prefer to stay put.
    share: dict[tuple[int, int], list[int]] = {}
    for p, members in enumerate(parts):
        for r, i in members:
            w = share.setdefault((p, r), [0, 0])
            w[0] += costs[r][i]
            w[1] += 1
    owner: dict[int, int] = {}
    taken: set[int] = set()
    for (p, r), (tok, n) in sorted(share.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0])):
        if p not in owner and r not in taken:
            owner[p] = r
            taken.add(r)
    free = iter(r for r in range(world) if r not in taken)
    for p in range(world):
        if p not in owner:
            owner[p] = next(free)

    out: Assignment = [[] for _ in range(world)]
    for p, members in enumerate(parts):
        out[owner[p]] = sorted(members)
    return out


def exchange(outgoing: list[list[Any]], device: torch.device = torch.device("cpu")) -> list[list[Any]]:
    """Collective: send outgoing[d] to rank d; return incoming[s], the list rank s sent here.

    Objects are pickled into one uint8 buffer and moved with two all_to_all_single calls (byte
    counts, then payload with uneven splits), so each rank only sends what its peers need. The
    list for this rank itself is passed through without pickling. `device` is where the byte
    tensors live: cpu for gloo, this rank's cuda device for nccl.
    """
    rank, world = dd.rank_and_world()  # within the role's group when the ranks took roles
    if world == 1:
        if len(outgoing) != 1:
            raise ValueError(f"expected 1 outgoing list, got {len(outgoing)}")
        return [list(outgoing[0])]
    if len(outgoing) != world:
        raise ValueError(f"expected {world} outgoing lists, got {len(outgoing)}")

    blobs = [b"" if d == rank or not objs else pickle.dumps(list(objs), protocol=pickle.HIGHEST_PROTOCOL)
             for d, objs in enumerate(outgoing)]
    send_sizes = [len(b) for b in blobs]
    send_counts = torch.tensor(send_sizes, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    with dd.waiting():
        dd.complete([dist.all_to_all_single(recv_counts, send_counts, group=dd.role_group(), async_op=True)])
    recv_sizes = recv_counts.tolist()

    payload = b"".join(blobs)
    send_buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                else torch.empty(0, dtype=torch.uint8)).to(device)
    recv_buf = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    with dd.waiting():
        dd.complete([dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=recv_sizes,
                                            input_split_sizes=send_sizes, group=dd.role_group(),
                                            async_op=True)])

    data = recv_buf.cpu().numpy().tobytes()
    incoming: list[list[Any]] = []
    offset = 0
    for s, n in enumerate(recv_sizes):
        if s == rank:
            incoming.append(list(outgoing[rank]))
        else:
            incoming.append(pickle.loads(data[offset:offset + n]) if n else [])
        offset += n
    return incoming


def _gather_costs(costs: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's cost list, on every rank: an int64 all_gather padded to the longest list."""
    longest = int(dd.all_reduce(float(len(costs)), op="max").item())
    row = torch.zeros(longest + 1, dtype=torch.int64, device=device)
    row[0] = len(costs)
    if costs:
        row[1:len(costs) + 1] = torch.tensor(costs, dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(dd.rank_and_world()[1])]
    with dd.waiting():
        dd.complete([dist.all_gather(rows, row, group=dd.role_group(), async_op=True)])
    out = []
    for t in rows:
        vals = t.tolist()
        out.append(vals[1:1 + vals[0]])
    return out


def _stats(before: list[int], after: list[int], moved: int) -> dict[str, float]:
    return {"tokens_before_max": float(max(before)), "tokens_before_min": float(min(before)),
            "tokens_after_max": float(max(after)), "tokens_after_min": float(min(after)),
            "moved_groups": float(moved)}


def balance_groups(groups: list[Any], costs: list[int],
                   device: torch.device = torch.device("cpu")) -> tuple[list[Any], dict[str, float]]:
    """Collective: rebalance whole groups across ranks by token cost.

    Returns this rank's new groups, ordered by (source_rank, group_index) so the order is the same
    whatever the timing, and global stats (identical on every rank): per-rank token max/min
    before and after, and how many groups changed rank. When nothing would move, no payload
    is exchanged.
    """
    costs = [int(c) for c in costs]
    if len(groups) != len(costs):
        raise ValueError(f"{len(groups)} groups but {len(costs)} costs")
    rank, world = dd.rank_and_world()
    if world == 1:
        total = [sum(costs)]
        return list(groups), _stats(total, total, 0)

    all_costs = _gather_costs(costs, device)
    plan = balanced_assignment(all_costs)
    before = [sum(row) for row in all_costs]
    after = [sum(all_costs[s][i] for s, i in dest) for dest in plan]
    moved = sum(s != d for d, dest in enumerate(plan) for s, _ in dest)
    if moved == 0:
        return list(groups), _stats(before, after, 0)

    outgoing = [[groups[i] for s, i in dest if s == rank] for dest in plan]
    incoming = [iter(objs) for objs in exchange(outgoing, device)]
    mine = [next(incoming[s]) for s, _ in plan[rank]]
    return mine, _stats(before, after, moved)
