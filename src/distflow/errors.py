"""The run's exceptions and the exit status the recipe maps each one to.

Every rank raises the same one of these with the same line, so that a launcher sees one cause:
`recipes/grpo.py` prints it as `distflow: error: ...` and exits with the status named here. This
module imports only the standard library, so every wing can raise them.
"""

import shutil
from pathlib import Path

EXIT_OK = 0
EXIT_ABORTED = 1  # RunAborted
EXIT_CONFIG = 2  # ConfigError: before any model loads
# A rank that stopped on a signal after saving (EX_TEMPFAIL: try again later). Relaunching with the
# same output folder resumes. torchrun itself reports 1 for it; the launchers in launch/ turn that
# back into 75 through the stop file.
EXIT_STOPPED = 75


class ConfigError(ValueError):
    """A user-facing configuration or input problem: reported as one line, exit code 2."""


class RunAborted(RuntimeError):
    """The run cannot go on (non-finite losses for too many steps, a full disk): one line, exit 1."""


class CheckpointSaveError(RunAborted):
    """A save failed on some rank (a full disk, a file over its size limit): every rank raises it,
    with the same line (exit 1), and the previous checkpoint stays the latest."""


class RunComplete(Exception):
    """The folder holds this run, already finished: nothing to train (exit 0)."""


def free_space(path: str | Path) -> str:
    """Free space on the file system of `path` (or of its nearest existing parent), for an error line."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = float(shutil.disk_usage(p).free)
    except OSError:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024:
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return f"{free:.1f} TiB"


def write_failure_line(path: str | Path, err: OSError) -> str:
    """`could not write <path>: No space left on device (0 B free there)`."""
    return f"could not write {path}: {err.strerror or err} ({free_space(path)} free there)"
