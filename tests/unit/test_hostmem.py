"""distflow.run.hostmem: freed activation-sized tensors go back to the OS (real glibc, real torch)."""

from __future__ import annotations

import os
import sys

import pytest

from launch_helpers import python_json

# Frees one 30 MiB tensor (glibc then raises its mmap threshold to 30 MiB), then allocates 300
# tensors of 2 MiB with small survivors in between, as a backward pass leaves them, frees the
# big ones and reports how much of the 600 MiB stayed resident.
CHILD = r"""
import json, re, sys
import torch
from distflow.run.hostmem import limit_malloc_retention

def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) << 10

was_set = limit_malloc_retention(int(sys.argv[1]))
big = torch.ones(30 << 18); del big
before = rss()
blocks, survivors = [], []
for _ in range(300):
    blocks.append(torch.ones(2 << 18))
    survivors.append(torch.ones(1 << 10))
del blocks
print(json.dumps({"set": was_set, "retained_mib": (rss() - before) / 2**20}))
"""


def retained(threshold_kib: int) -> dict:
    return python_json(CHILD, str(threshold_kib))


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_fixed_mmap_threshold_returns_freed_blocks():
    fixed, default = retained(1024), retained(0)
    assert fixed["set"] and not default["set"]
    assert fixed["retained_mib"] < 50, fixed  # the 2 MiB blocks were mapped, and unmapped when freed
    assert default["retained_mib"] > 300, default  # glibc's climbing threshold kept them in the heap
