"""recipes/grpo.py with distflow's collectives counted (bench/comm_hooks.py): the hooks are installed
first, then the unmodified recipe runs as __main__ with the same command-line overrides.

    torchrun --standalone --nproc_per_node N bench/comm_entry.py experiment=smoke ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import comm_hooks

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"

if __name__ == "__main__":
    comm_hooks.install()
    sys.argv[0] = str(GRPO)
    sys.path.insert(0, str(GRPO.parent))
    runpy.run_path(str(GRPO), run_name="__main__")
