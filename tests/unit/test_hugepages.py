"""distflow.run.hostmem: torch's large CPU tensors get 2 MiB pages when the setting is on
(real kernel, real torch, in fresh processes: torch reads it once, when it loads)."""

from __future__ import annotations

import os

import pytest

from distflow.run.hostmem import THP_ENV, prefer_huge_pages, thp_mode
from launch_helpers import python_json

# Touches one 64 MiB tensor and reports how much of the process's anonymous memory is in huge pages.
CHILD = r"""
import json, re, sys
from distflow.run.hostmem import prefer_huge_pages
asked = prefer_huge_pages()  # before torch, as the entry point does
import torch
t = torch.ones(16 << 20)
huge = int(re.search(r"AnonHugePages:\s+(\d+) kB", open("/proc/self/smaps_rollup").read()).group(1)) >> 10
print(json.dumps({"asked": asked, "huge_mib": huge, "sum": float(t.sum())}))
"""


def huge_mib(setting: str) -> dict:
    return python_json(CHILD, extra_env={THP_ENV: setting})


def test_setting_follows_the_kernel_and_keeps_the_users(tmp_path):
    def kernel(mode: str) -> str:  # the sysfs file as Linux writes it, the mode in brackets
        path = tmp_path / mode
        path.write_text(" ".join(f"[{m}]" if m == mode else m for m in ("always", "madvise", "never")) + "\n")
        return str(path)

    assert thp_mode(kernel("madvise")) == "madvise"
    assert thp_mode(str(tmp_path / "absent")) is None
    env: dict[str, str] = {}
    assert prefer_huge_pages(env, kernel("madvise")) and env == {THP_ENV: "1"}
    assert prefer_huge_pages(env := {}, kernel("always")) and env == {THP_ENV: "1"}
    assert not prefer_huge_pages(env := {}, kernel("never")) and env == {}  # the kernel would refuse: not set
    assert not prefer_huge_pages(env := {}, str(tmp_path / "absent")) and env == {}  # no THP (not Linux)
    assert not prefer_huge_pages(env := {THP_ENV: "0"}, kernel("madvise")) and env == {THP_ENV: "0"}  # the user's


@pytest.mark.skipif(thp_mode() != "madvise" or not os.path.exists("/proc/self/smaps_rollup"),
                    reason="needs the kernel's THP in madvise mode (then only regions that ask get huge pages)")
def test_large_tensors_get_huge_pages_only_when_asked():
    on, off = huge_mib("1"), huge_mib("0")
    assert on["asked"] and not off["asked"]
    assert on["sum"] == off["sum"] == float(16 << 20)
    assert on["huge_mib"] >= 32, on  # most of the 64 MiB tensor
    assert off["huge_mib"] < 8, off
