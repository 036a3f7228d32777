"""recipes/grpo.py with peak memory measured per trainer phase (bench/memory_hooks.py): the hooks
are installed first, then the unmodified recipe runs as __main__ with the same overrides.

    DISTFLOW_MEM_OUT=DIR torchrun --standalone --nproc_per_node N bench/memory_entry.py experiment=demo ...
"""

from __future__ import annotations

from distflow.run.output import quiet_third_party_env

quiet_third_party_env()  # as recipes/grpo.py does, before the hooks import torch and transformers

import common  # noqa: E402
import memory_hooks  # noqa: E402

if __name__ == "__main__":
    memory_hooks.install()
    common.run_grpo_recipe()
