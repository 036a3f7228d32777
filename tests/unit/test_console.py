"""What rank 0's console shows (distflow.run.output): expected third-party warnings folded into one
line once start-up is over, unknown ones in full, everything in the rank's file; and the error line
that torchrun's failure summary repeats, read back by torch's own parser."""

import json
import logging

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from distflow.run.output import note_expected_warnings, report_error, reset_output, setup_output

STARTUP = [  # (logger, message) as vLLM and torch log them when a CPU engine starts
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best performance, ..."),
    ("torch._library.triton", "Triton not available, find_triton_kernels = []"),
]
RESYNC = ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights")
UNKNOWN = ("vllm.engine", "KV cache is smaller than one sequence")


@pytest.fixture
def channel(tmp_path):
    def setup(level: str = "WARNING", rank: int = 0):
        log_file = tmp_path / "logs" / f"rank_{rank}.log"
        setup_output(log_file, rank=rank, log_level=level)
        return log_file

    yield setup
    reset_output()


def _warn(*records):
    for name, message in records:
        logging.getLogger(name).warning(message)


def test_expected_start_up_warnings_become_one_line_and_unknown_ones_show(channel, capsys):
    log_file = channel()
    _warn(*STARTUP, UNKNOWN, STARTUP[0])
    note_expected_warnings(log_file)
    _warn(RESYNC, RESYNC)  # after start-up: in the file only, and no second note
    note_expected_warnings(log_file)
    console = capsys.readouterr().out.splitlines()
    assert console == [f"[vllm.engine] WARNING: {UNKNOWN[1]}",
                       f"distflow: 5 expected start-up warnings from torch and vllm, kept in {log_file}"]
    text = log_file.read_text()  # nothing is lost
    assert all(text.count(message) == (2 if message == STARTUP[0][1] else 1) for _, message in STARTUP)
    assert text.count(RESYNC[1]) == 2 and UNKNOWN[1] in text


def test_level_info_shows_every_warning_and_other_ranks_only_errors(channel, capsys, tmp_path):
    log_file = channel("INFO")
    _warn(*STARTUP, RESYNC)
    note_expected_warnings(log_file)
    assert capsys.readouterr().out.splitlines() == [f"[{name}] WARNING: {message}" for name, message in [*STARTUP, RESYNC]]
    reset_output()
    log_file = channel(rank=1)
    _warn(*STARTUP, UNKNOWN)
    logging.getLogger("distflow").error("a rank's own failure")
    note_expected_warnings(log_file)
    assert capsys.readouterr().out.splitlines() == ["distflow: error: a rank's own failure"]


def test_the_error_line_is_what_torchruns_failure_summary_shows(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_error("validation needs a held-out split: set task.heldout_path")
    line = "distflow: error: validation needs a held-out split: set task.heldout_path"
    assert capsys.readouterr().err == line + "\n"
    # torchrun's agent reads the file with torch's own ProcessFailure and prints ChildFailedError
    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("recipes/grpo.py", {0: failure}).format_msg()
    assert f"traceback : {line}" in summary and "<N/A>" not in summary and "To enable traceback" not in summary
    assert json.loads(error_file.read_text())["message"]["message"] == line
    # outside torchrun (no error file asked for) only the line is written
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    report_error("another")
    assert capsys.readouterr().err == "distflow: error: another\n"
