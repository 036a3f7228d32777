"""Every seed a run derives, from its parts: one hash, so no two streams collide by arithmetic.

A seed names where its numbers are used (run seed, stream position; a sample, a turn; a step), so
the same parts give the same draws on any rank count, after any resume, and different parts give
unrelated ones (31 bits, as every sampler accepts).
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 31-bit seed derived from `parts`: reproducible and resumable."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sample_seed(run_seed: int, position: int, *continuation: int) -> int:
    """The seed of a group's samples: its prompt's position in the global prompt stream (not the rank
    that draws it, so a resized run samples alike). A sample continued after a cut adds (its index in
    the group, how many times it was cut)."""
    return derive_seed(run_seed, "position", position, *continuation)
