"""Ending a rank's process once its run is over.

A finished rank has closed its engine, its process group, its loggers and its files. What the
interpreter does after that, tearing down the modules of torch, transformers and vLLM one object at
a time and running their native destructors, took 1.6 s per rank with the HF engine and 2.5 s with
vLLM on the CPU machines (tiny model, `experiment=smoke`), on every launch, and serves nothing:
the operating system frees the memory and closes the descriptors anyway.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(status: int) -> NoReturn:
    """Exit with `status` as the interpreter would, minus its module teardown.

    Everything a normal exit does that anyone can observe still happens, in the same order:
    non-daemon threads are joined, the atexit handlers run (logging's flush of every rank log,
    wandb's finish, multiprocessing's reaping of children, finalizers, a benchmark's hooks), and
    stdout and stderr are flushed. Only then does the process end, with `os._exit`."""
    threading._shutdown()  # what Py_Finalize does first: threading's exit hooks (which stop idle executor
    # workers), then a join of every non-daemon thread
    atexit._run_exitfuncs()  # what it does next; the handlers run once, then are cleared
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # replaced, closed, or its reader gone
            pass
    os._exit(status)
