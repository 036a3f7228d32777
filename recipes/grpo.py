"""Hydra entry point: `torchrun --nproc_per_node=N recipes/grpo.py [group=choice ...] [key=value ...]`.

Thin by design: compose and validate the config, hand it to distflow.Trainer. The library
itself never imports Hydra.
"""

from __future__ import annotations

import os
import sys

from distflow.output import quiet_third_party_env

quiet_third_party_env()  # before torch, vLLM or datasets start logging

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from distflow.config import ConfigError, DistflowConfig, check_known_keys  # noqa: E402

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))

ConfigStore.instance().store(name="distflow_schema", node=DistflowConfig)
# Data files shipped beside the recipes are addressed as ${recipes_dir:}/data/...,
# so no path depends on the working directory.
OmegaConf.register_new_resolver("recipes_dir", lambda: RECIPES_DIR, replace=True)


def _prepare_argv() -> None:
    """Only rank 0 writes .hydra/; logging is distflow's own (distflow.output) on every rank;
    multirun cannot work under torchrun. The working directory goes on sys.path (last, so it
    shadows nothing): `python script.py` puts only the script's folder there, and a user's
    reward module beside them (task.reward=my_rewards:fn) would not import, here or in the
    reward workers, which inherit this sys.path."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    args = sys.argv[1:]
    if "WORLD_SIZE" in os.environ and any(a in ("-m", "--multirun") for a in args):
        sys.exit("distflow: error: Hydra multirun (-m) is not supported under torchrun; "
                 "sweep by launching one torchrun per configuration instead.")
    sys.argv += ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if int(os.environ.get("RANK", "0")) != 0:
        sys.argv += ["hydra.output_subdir=null"]


@record
@hydra.main(config_path=".", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from distflow.preemption import EXIT_STOPPED
    from distflow.resume import RunComplete
    from distflow.trainer import RunAborted, Trainer

    try:
        check_known_keys(OmegaConf.to_container(cfg, resolve=False))
        config: DistflowConfig = OmegaConf.to_object(cfg)
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
