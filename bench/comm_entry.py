"""recipes/grpo.py with distflow's collectives counted (bench/comm_hooks.py): the hooks are installed
first, then the unmodified recipe runs as __main__ with the same command-line overrides.

    torchrun --standalone --nproc_per_node N bench/comm_entry.py experiment=smoke ...
"""

from __future__ import annotations

import comm_hooks
import common

if __name__ == "__main__":
    comm_hooks.install()
    common.run_grpo_recipe()
