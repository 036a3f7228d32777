"""Hydra entry point: `torchrun --nproc_per_node=N recipes/grpo.py [group=choice ...] [key=value ...]`.

Every algorithm runs through it (algorithm=grpo, dapo, ppo, ...). Thin by design: compose the
config, build the typed one (distflow.config checks every key and value), hand it to
distflow.job.build_job (the Trainer; in a split run, this rank's role). The library itself never imports Hydra.

`python recipes/grpo.py --check-config [overrides ...]` is the launchers' pre-flight
(launch/local.sh, launch/slurm/): one process composes and validates the config, with no
torch.distributed and no model, and a mistake stops there as one line and exit status 2 before
torchrun starts any rank. `--check-config --with-output-dir` (launch/local.sh, whose overrides name
the folder the ranks will use) also checks that run.output_dir can be created, written and locked.

Hydra creates hydra.run.dir, and rank 0 writes .hydra/ into it, before `main` runs: a run.output_dir
that cannot be created or written would end in Hydra's traceback on every rank. hydra.run.dir is
therefore `${distflow_hydra_dir:${run.output_dir}}`: the folder itself when .hydra/ can be written
there, else a temporary stand-in that `main` removes first; the launch then stops where rank 0
locks the folder (distflow.run.rundir), with that one line.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from distflow.run.hostmem import prefer_huge_pages
from distflow.run.output import (
    line_buffered_console,
    quiet_third_party_env,
    report_error,
    write_line,
)

quiet_third_party_env()  # before torch, vLLM or datasets start logging
prefer_huge_pages()  # before torch loads: its CPU allocator reads the setting once
line_buffered_console()

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from distflow.config import ConfigError, DistflowConfig, hydra_schema, rename_overrides  # noqa: E402
from distflow.run.rundir import RunDir, missing_dirs  # noqa: E402

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))

ConfigStore.instance().store(name="distflow_schema", node=hydra_schema(DistflowConfig))
# Data files shipped beside the recipes are addressed as ${recipes_dir:}/data/...,
# so no path depends on the working directory.
OmegaConf.register_new_resolver("recipes_dir", lambda: RECIPES_DIR, replace=True)
_stand_ins: dict[str, str] = {}  # run.output_dir -> the temporary folder Hydra got instead


def _hydra_dir(output_dir: str) -> str:
    """hydra.run.dir: run.output_dir when Hydra can create it and write .hydra/ there (probed with
    more than Hydra writes), else an empty temporary folder, so that Hydra goes on and the launch
    stops with the line RunDir.lock gives. Ranks other than 0 write nothing there
    (hydra.output_subdir=null): they get the system's temporary folder, which exists, and never make
    run.output_dir before rank 0 has locked it."""
    if int(os.environ.get("RANK", "0")) != 0:
        return tempfile.gettempdir()
    if output_dir in _stand_ins:  # Hydra may resolve it more than once
        return _stand_ins[output_dir]
    root = Path(output_dir)
    made = missing_dirs(root / ".hydra")
    try:
        (root / ".hydra").mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root / ".hydra", prefix=".probe-") as f:
            f.write(b"\0" * 65536)  # more than Hydra's three files
            f.flush()
        return output_dir
    except OSError:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
    _stand_ins[output_dir] = stand_in = tempfile.mkdtemp(prefix="distflow-hydra-")
    atexit.register(shutil.rmtree, stand_in, True)  # should main never run
    return stand_in


OmegaConf.register_new_resolver("distflow_hydra_dir", _hydra_dir, replace=True)


def _prepare_argv() -> None:
    """Old key spellings become the new ones (one line each, on rank 0); only rank 0 writes .hydra/;
    logging is distflow's own (distflow.run.output) on every rank; multirun cannot work under
    torchrun. The working directory goes on sys.path (last, so it shadows nothing): `python
    script.py` puts only the script's folder there, and a user's reward module beside them
    (task.reward=my_rewards:fn) would not import, here or in the reward workers, which inherit
    this sys.path."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    args, notes = rename_overrides(sys.argv[1:])
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            write_line(f"distflow: warning: {note}", sys.stderr)
    if "WORLD_SIZE" in os.environ and any(a in ("-m", "--multirun") for a in args):
        sys.exit("distflow: error: Hydra multirun (-m) is not supported under torchrun; "
                 "sweep by launching one torchrun per configuration instead.")
    args += ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if int(os.environ.get("RANK", "0")) != 0:
        args += ["hydra.output_subdir=null"]
    sys.argv[1:] = args


def check_config(overrides: list[str], output_dir: bool = False) -> int:
    """The pre-flight: 0 when the config composes and validates (and, with `output_dir`, its
    run.output_dir can be created, written and locked: RunDir.check), else one error line and 2.
    Hydra's own flags (--cfg, -m, ...) are the run's to handle: nothing is checked then."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args, _ = rename_overrides(overrides)  # the ranks print the deprecation lines
    if any(a.startswith("-") for a in args):
        return 0
    try:
        with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
            cfg = compose(config_name="grpo", overrides=args)
        config = DistflowConfig.from_dict(OmegaConf.to_container(cfg, resolve=True)).validate()
        note = RunDir(config.run.output_dir).check() if output_dir else None
    except ConfigError as e:
        report_error(str(e))
        return 2
    except OmegaConfBaseException as e:  # a bad interpolation, a missing value
        key, what = getattr(e, "full_key", None), str(e).strip().splitlines()[0]
        report_error(f"{key}: {what}" if key else what)
        return 2
    except HydraException as e:  # an unknown group option, a malformed override, a value of the wrong type
        text = str(e).split("Config search path")[0]
        cause = e.__cause__
        if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
            text += f": {str(cause).strip().splitlines()[0]}"  # what was wrong, without OmegaConf's key dump
        report_error(" ".join(text.split()))
        return 2
    if note:
        write_line(f"distflow: warning: {note}", sys.stderr)
    return 0


def _rank_failed(e: Exception) -> None:
    """Name the failing rank and its error in one line (the traceback follows, for the rank's log);
    torchrun then stops the others, or they time out in a collective."""
    write_line(f"distflow: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {e}", sys.stderr)


@hydra.main(config_path=".", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from distflow.errors import EXIT_ABORTED, EXIT_CONFIG, EXIT_OK, EXIT_STOPPED, RunAborted, RunComplete

    for stand_in in _stand_ins.values():
        shutil.rmtree(stand_in, ignore_errors=True)
    try:
        config = DistflowConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
        if _stand_ins and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            # .hydra/ could not be written there: one process says why before torch loads; under
            # torchrun rank 0's lock says it (start_run) and every rank reports it
            RunDir(config.validate().run.output_dir).check()
        from distflow.job import build_job

        trainer = build_job(config)  # the trainer (a split run: this rank's role)
    except ConfigError as e:
        report_error(str(e))
        sys.exit(EXIT_CONFIG)
    except RunComplete as e:
        if os.environ.get("RANK", "0") == "0":
            write_line(f"distflow: {e}")
        sys.exit(EXIT_OK)
    except Exception as e:
        _rank_failed(e)
        raise
    try:
        trainer.train()
    except RunAborted as e:
        report_error(str(e))
        sys.exit(EXIT_ABORTED)
    except Exception as e:
        _rank_failed(e)
        raise
    finally:
        trainer.close()
    if trainer.stopped is not None:  # a signal: saved, exit with the status launchers requeue on
        sys.exit(EXIT_STOPPED)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-config"]:
        with_dir = sys.argv[2:3] == ["--with-output-dir"]
        sys.exit(check_config(sys.argv[3 if with_dir else 2:], output_dir=with_dir))
    # torchelastic's @record under torchrun (its error file names an uncaught error in torchrun's
    # failure summary), applied here so that the pre-flight, and one process's refusals before any
    # model loads, never import torch
    entry = main
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(main)
    # Hydra's own composition errors (an unknown group option, a value it cannot convert, a malformed
    # override) are multi-line reports: the pre-flight's one line comes first, on every rank
    if status := check_config(sys.argv[1:]):
        sys.exit(status)
    _prepare_argv()
    try:
        entry()
    except SystemExit as e:
        if e.code not in (0, None):
            # Any other end keeps the interpreter's exit: torchrun stops the other ranks as soon as
            # one exits non-zero, and a peer still on its way to its own error line (or flushing
            # its stop report) gets the teardown's time to finish it.
            raise
    from distflow.run.exit import exit_process

    exit_process(0)  # every rank finished: torchrun waits for all, so skip the interpreter's teardown
