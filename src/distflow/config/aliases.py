"""Old spellings of config keys, so users' scripts, SLURM jobs and saved commands keep working.

`rename_overrides` rewrites command-line overrides (`key=value`, `+key=value`, `++key=value`,
`~key`) from an old key to its new one and says so once per key, naming the new key. A key that
is gone maps to None: its override is dropped with a line that says why. A key in SPLIT sets a
second key beside its new one (algorithm.tis_cap=2 is token-level IS capped at 2).
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
    "algorithm.tis_cap": "algorithm.rollout_correction.rollout_is_threshold",
}
# Old keys whose value now takes a second key too: (what a number also sets, what null sets instead)
SPLIT: dict[str, tuple[str, str]] = {
    "algorithm.tis_cap": ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is=null"),
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
                         else f"{key} is deprecated: use {SPLIT[key][0]} {new}=<value>" if key in SPLIT
                         else f"{key} is deprecated: use {new}")
        prefix, rest = m.group("prefix") or "", m.group("rest")
        if key in SPLIT:
            on, off = SPLIT[key]
            if rest[1:].strip().lower() in ("", "null", "none"):
                out.append(prefix + off)
                continue
            out.append(prefix + on)
        if new is not None:
            out.append(f"{prefix}{new}{rest}")
    return out, notes
