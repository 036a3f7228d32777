"""Build a model folder once, safely, however many processes ask for it at the same time.

Used by the built-in models (tiny, smollm2_135m): torchrun ranks all resolve the model path at
start-up, so one of them builds under a file lock into a temporary sibling folder, the build
writes its completion marker last, and the folder is renamed into place. A folder that fails
`is_complete` (half-written, truncated, stale) is moved aside and rebuilt.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir`, else $DISTFLOW_CACHE, else ~/.cache/distflow."""
    return Path(cache_dir or os.environ.get("DISTFLOW_CACHE") or "~/.cache/distflow").expanduser()


def build_once(final: Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None]) -> str:
    """Return `final`, first running `build(tmp_folder)` (which must write its marker last)
    unless a complete folder is already there."""
    from filelock import FileLock

    if is_complete(final):
        return str(final)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{final}.lock"):
        if is_complete(final):  # another process finished it while we waited
            return str(final)
        if final.exists():  # broken: move it away first, so no reader sees it half-deleted
            os.replace(final, root / f"{final.name}.tmp-stale-{os.getpid()}-{time.monotonic_ns()}")
        for stale in root.glob(f"{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
        try:
            build(tmp)
            _make_readable(tmp)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(final)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: open it up as umask allows, so a shared cache works."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~umask)
    os.chmod(folder, 0o777 & ~umask)
