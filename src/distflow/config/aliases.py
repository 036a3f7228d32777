"""Old spellings of config keys, so users' scripts, SLURM jobs and saved commands keep working.

`rename_overrides` rewrites command-line overrides (`key=value`, `+key=value`, `++key=value`,
`~key`) from an old key to its new one and says so once per key, naming the new key. A key that
is gone maps to None: its override is dropped with a line that says why.
"""

from __future__ import annotations

import re

_RUN = ("steps", "seed", "output_dir", "device", "backend", "collective_timeout_s", "balance_lengths",
        "sync_probe_seqs", "sync_probe_every", "max_nonfinite_steps", "host_mmap_threshold_kib", "fault_inject")

# old key -> new key (None: removed)
ALIASES: dict[str, str | None] = {
    **{f"trainer.{k}": f"run.{k}" for k in _RUN},
    "trainer.checkpoint_every": "checkpoint.every",
    "trainer.checkpoint_every_s": "checkpoint.every_s",
    "trainer.checkpoint_at_end": "checkpoint.at_end",
    "trainer.keep_last": "checkpoint.keep_last",
    "trainer.resume": "checkpoint.resume",
    "trainer.export_at_end": "checkpoint.export_at_end",
    "trainer.val_every": "validation.every",
    "trainer.val_before_train": "validation.before_train",
    "trainer.val_at_end": "validation.at_end",
    "trainer.val_pass_k": "validation.pass_k",
    "trainer.loggers": "logging.loggers",
    "trainer.log_level": "logging.level",
    "trainer.progress_bar": "logging.progress_bar",
    "trainer.wandb_project": "logging.wandb_project",
    "trainer.plot_at_end": "logging.plot_at_end",
    "trainer.straggler_warn_steps": "logging.straggler_warn_steps",
    "critic.enabled": None,
}
REMOVED = {"critic.enabled": "the critic follows from algorithm.advantage (gae trains one)"}

_OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.]*)(?P<rest>(=.*)?)$", re.S)


def rename_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides with old keys renamed, one deprecation line per old key used)."""
    out, notes, seen = [], [], set()
    for arg in args:
        m = _OVERRIDE.match(arg)
        key = m.group("key") if m else None
        if key not in ALIASES:
            out.append(arg)
            continue
        new = ALIASES[key]
        if key not in seen:
            seen.add(key)
            notes.append(f"{key} is deprecated and ignored: {REMOVED[key]}" if new is None
                         else f"{key} is deprecated: use {new}")
        if new is not None:
            out.append(f"{m.group('prefix') or ''}{new}{m.group('rest')}")
    return out, notes
