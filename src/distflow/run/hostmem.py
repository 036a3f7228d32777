"""Host memory of a rank's process: glibc's mmap threshold and transparent huge pages for torch's
large CPU tensors. Both tune the same allocator path, so they live together.

glibc malloc. CPU tensors (and, on CUDA, host-side buffers) come from glibc malloc. A block above
its mmap threshold gets its own mapping, returned to the OS when freed; smaller ones come from heap
arenas, whose free space stays resident. glibc raises the threshold each time a mapped block
is freed, up to 32 MiB, so after the first update most activations and logits land in arenas:
a SmolLM2-135M rank then kept ~1.5 GB of freed update memory for the rest of the run, and
fragmentation raised the update's own peak by ~0.4 GB (bench/memory.py). A fixed threshold
(`limit_malloc_retention`, run.host_mmap_threshold_kib) stops the climb; blocks that big are few,
so mapping each costs little. What it does cost is page faults, each new mapping's pages faulting
in and being zeroed again.

Huge pages. With the fixed threshold every large tensor is a fresh mapping, so its pages fault in
again each time: the update of a replicated model allocates a new fp32 buffer for each block's
gradients, twice (FSDP2's reduce-scatter input and output, on a one-rank mesh too), and these
copies ran at page-fault speed. torch's CPU allocator asks the kernel for 2 MiB pages for blocks of
2 MiB and more when THP_MEM_ALLOC_ENABLE=1 (c10's alloc_cpu): one fault per 2 MiB instead of 512
(not fewer zeroed pages), and freed blocks still go back to the OS. On the demo's update
(bench/update.py --shape demo, 2 processes, bf16) that took the update from 5.70 to 5.11 s and the
processes' system time from 26 to 20 s, at the same peak memory (docs/performance.md).

torch reads the variable once, when its library loads: `prefer_huge_pages` runs before
`import torch`, as the entry points do (recipes/grpo.py, the tests' conftest, the benchmarks'
launcher). A value already in the environment is kept (THP_MEM_ALLOC_ENABLE=0 turns it off). Host
memory only: CUDA tensors do not come from this allocator. This module imports nothing heavy, so
that it can run first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import sys
from typing import MutableMapping

log = logging.getLogger("distflow")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
THP_ENV = "THP_MEM_ALLOC_ENABLE"
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def thp_mode(path: str = THP_SYSFS) -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise or never); None without THP."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def prefer_huge_pages(environ: MutableMapping[str, str] | None = None, sysfs: str = THP_SYSFS) -> bool:
    """Set THP_MEM_ALLOC_ENABLE=1 in `environ` (default: this process's) unless it is set already,
    where the kernel gives huge pages to regions that ask (THP mode madvise or always).
    Returns whether torch will ask, in a process that imports torch after this call. For this
    process's own environment that is only true if torch is not loaded yet."""
    own = environ is None
    environ = os.environ if own else environ
    if thp_mode(sysfs) not in ("madvise", "always"):
        return False
    environ.setdefault(THP_ENV, "1")
    return environ[THP_ENV] == "1" and not (own and "torch" in sys.modules)
