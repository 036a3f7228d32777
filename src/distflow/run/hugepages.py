"""Transparent huge pages for torch's large CPU tensors.

With `run.host_mmap_threshold_kib` (distflow.distributed.hostmem) every large tensor is a fresh
mapping, handed back to the OS when freed, so its pages fault in again each time: the update of a
replicated model allocates a new fp32 buffer for each block's gradients, twice (FSDP2's
reduce-scatter input and output, on a one-rank mesh too), and these copies ran at page-fault
speed. torch's CPU allocator asks the kernel for 2 MiB pages for blocks of 2 MiB and more when
THP_MEM_ALLOC_ENABLE=1 (c10's alloc_cpu): one fault per 2 MiB instead of 512, and freed blocks
still go back to the OS. On the demo's update (bench/update.py --shape demo, 2 processes, bf16)
that took the update from 5.70 to 5.11 s and the processes' system time from 26 to 20 s, at the
same peak memory (docs/performance.md).

torch reads the variable once, when its library loads: set it before `import torch`, as the
entry points do (recipes/grpo.py, the tests' conftest, the benchmarks' launcher). A value already
in the environment is kept (THP_MEM_ALLOC_ENABLE=0 turns it off). Host memory only: CUDA tensors
do not come from this allocator, and on a GPU node it changes nothing but host-side buffers.
This module imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import os
import re
import sys
from typing import MutableMapping

THP_ENV = "THP_MEM_ALLOC_ENABLE"
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


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
