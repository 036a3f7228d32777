"""recipes/grpo.py with peak memory measured per trainer phase (bench/memory_hooks.py): the hooks
are installed first, then the unmodified recipe runs as __main__ with the same overrides.

    DISTFLOW_MEM_OUT=DIR torchrun --standalone --nproc_per_node N bench/memory_entry.py experiment=demo ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from distflow.output import quiet_third_party_env

quiet_third_party_env()  # as recipes/grpo.py does, before the hooks import torch and transformers

import memory_hooks  # noqa: E402

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"

if __name__ == "__main__":
    memory_hooks.install()
    sys.argv[0] = str(GRPO)
    sys.path.insert(0, str(GRPO.parent))
    runpy.run_path(str(GRPO), run_name="__main__")
