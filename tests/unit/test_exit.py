"""A finished rank's exit: everything observable of a normal exit happens, only without the
interpreter's module teardown."""

import subprocess
import sys
import textwrap


def test_exit_process_joins_threads_runs_atexit_flushes_and_keeps_the_status(tmp_path):
    marker = tmp_path / "atexit.txt"
    script = textwrap.dedent(f"""
        import atexit, logging, sys, threading, time
        from distflow.run.exit import exit_process

        handler = logging.FileHandler({str(tmp_path / "rank.log")!r})
        logging.getLogger("t").addHandler(handler)
        handler.stream.write("buffered log line\\n")  # left in the handler's buffer: logging's atexit flushes it
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        def late():
            time.sleep(0.3)
            sys.stdout.write("thread done\\n")
        threading.Thread(target=late).start()
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)  # an idle worker (non-daemon): the interpreter's exit hook stops it
        pool.submit(lambda: None).result()
        sys.stdout.write("no newline yet")  # a block-buffered pipe: only a flush delivers it
        class Finalizer:
            def __del__(self, write=open({str(tmp_path / "teardown.txt")!r}, "w").write):
                write("torn down")  # (bound early: the teardown may have cleared the builtins)
        keep = Finalizer()  # a module global: only the interpreter's teardown would collect it
        exit_process(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline yetthread done\n", proc.stdout
    assert marker.read_text() == "ran"
    assert (tmp_path / "rank.log").read_text() == "buffered log line\n"
    assert (tmp_path / "teardown.txt").read_text() == ""  # the teardown was skipped
