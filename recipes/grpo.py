"""Hydra entry point: `torchrun --nproc_per_node=N recipes/grpo.py [group=choice ...] [key=value ...]`.

Every algorithm runs through it (algorithm=grpo, dapo, ppo, ...). Thin by design: compose the
config, build the typed one (distflow.config checks every key and value), hand it to
distflow.Trainer. The library itself never imports Hydra.
"""

from __future__ import annotations

import os
import sys

from distflow.run.output import quiet_third_party_env

quiet_third_party_env()  # before torch, vLLM or datasets start logging

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from distflow.config import ConfigError, DistflowConfig, hydra_schema, rename_overrides  # noqa: E402

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))

ConfigStore.instance().store(name="distflow_schema", node=hydra_schema(DistflowConfig))
# Data files shipped beside the recipes are addressed as ${recipes_dir:}/data/...,
# so no path depends on the working directory.
OmegaConf.register_new_resolver("recipes_dir", lambda: RECIPES_DIR, replace=True)


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
            print(f"distflow: warning: {note}", file=sys.stderr, flush=True)
    if "WORLD_SIZE" in os.environ and any(a in ("-m", "--multirun") for a in args):
        sys.exit("distflow: error: Hydra multirun (-m) is not supported under torchrun; "
                 "sweep by launching one torchrun per configuration instead.")
    args += ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if int(os.environ.get("RANK", "0")) != 0:
        args += ["hydra.output_subdir=null"]
    sys.argv[1:] = args


@record
@hydra.main(config_path=".", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from distflow.run.preemption import EXIT_STOPPED
    from distflow.run.resume import RunComplete
    from distflow.trainer import RunAborted, Trainer

    try:
        config = DistflowConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
        trainer = Trainer(config)
    except ConfigError as e:
        print(f"distflow: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RunComplete as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"distflow: {e}", flush=True)
        sys.exit(0)
    try:
        trainer.train()
    except RunAborted as e:
        print(f"distflow: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        # name the failing rank; torchrun then stops the others (or they time out in a collective)
        print(f"distflow: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        trainer.close()
    if trainer.stopped is not None:  # a signal: saved, exit with the status launchers requeue on
        sys.exit(EXIT_STOPPED)


if __name__ == "__main__":
    _prepare_argv()
    main()
