"""Host memory: keep glibc's malloc from holding on to freed tensor memory.

CPU tensors (and, on CUDA, host-side buffers) come from glibc malloc. A block above its mmap
threshold gets its own mapping, returned to the OS when freed; smaller ones come from heap
arenas, whose free space stays resident. glibc raises the threshold each time a mapped block
is freed, up to 32 MiB, so after the first update most activations and logits land in arenas:
a SmolLM2-135M rank then kept ~1.5 GB of freed update memory for the rest of the run, and
fragmentation raised the update's own peak by ~0.4 GB (bench/memory.py). A fixed threshold
stops the climb; blocks that big are few, so mapping each costs little. What it does cost is
page faults, each new mapping's pages faulting in and being zeroed again: huge pages
(distflow.run.hugepages) make the faults 512 times fewer, though not the zeroing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("distflow")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def limit_malloc_retention(threshold_kib: int) -> bool:
    """Fix glibc's mmap threshold at `threshold_kib` KiB (0: leave glibc's dynamic default).
    Returns whether it was set (False off glibc, e.g. musl or macOS)."""
    if threshold_kib <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt: run.host_mmap_threshold_kib has no effect here")
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_kib * 1024))
