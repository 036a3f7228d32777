"""The run folder (run.output_dir): every file and folder a run writes, named once.

    <output_dir>/
      .distflow-run       marks the folder as a distflow run's (written first by a fresh start)
      config.json         the resolved config (distflow.config.config_record)
      metrics.jsonl       one row of metrics per step (the jsonl logger)
      summary.json        held-out pass@1 before/after, wall time, the last reward
      training.png        the curves (distflow.run.plot)
      logs/rank_<r>.log   everything each rank logged
      checkpoints/step_NNNNNN/   (distflow.run.checkpoint)
      hf_model/  adapter/ the exported policy (checkpoint.export_at_end; adapter: LoRA)
      wandb/  wandb_run_id  tb/   the W&B and TensorBoard loggers' files
      previous/<time>/    an earlier run's files, set aside by a fresh start

Writers ask a `RunDir` for their paths. A fresh start in a folder that holds an earlier run
moves exactly these artifacts to previous/<time>/ and leaves every other file where it is (a
launcher's logs/<job>-<node>.log and launch.txt, Hydra's .hydra/, the user's own files). A
folder that holds files under these names but was not written by distflow is refused.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from distflow.config import ConfigError

MARKER = ".distflow-run"


class RunDir:
    def __init__(self, root: str | Path):
        self.root = r = Path(root)
        self.marker, self.config, self.metrics = r / MARKER, r / "config.json", r / "metrics.jsonl"
        self.summary, self.plot, self.logs = r / "summary.json", r / "training.png", r / "logs"
        self.checkpoints, self.hf_model, self.adapter = r / "checkpoints", r / "hf_model", r / "adapter"
        self.wandb, self.wandb_run_id, self.tensorboard = r / "wandb", r / "wandb_run_id", r / "tb"
        self.previous = r / "previous"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def artifacts(self) -> list[Path]:
        """The artifacts present now, the marker last (a set-aside cut short still marks the folder)."""
        fixed = [self.config, self.metrics, self.summary, self.plot, self.checkpoints, self.hf_model, self.adapter,
                 self.wandb, self.wandb_run_id, self.tensorboard]
        found = [p for p in fixed if p.exists()]
        found += sorted(self.logs.glob("rank_*.log")) if self.logs.is_dir() else []
        return found + ([self.marker] if self.marker.exists() else [])

    # ------------------------------------------------------------------ ownership
    def written_by_distflow(self) -> bool:
        """The folder carries the marker, or (a run from before the marker) a distflow config.json."""
        if self.marker.is_file():
            return True
        try:
            record = json.loads(self.config.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and {"model", "rollout", "algorithm"} <= record.keys()

    def claim(self) -> None:
        """Mark the folder as this run's (rank 0, before anything else is written)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps({"created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")

    def set_aside(self) -> Path | None:
        """Move an earlier run's artifacts to previous/<time>/ (None if there were none);
        ConfigError when the folder holds such names but distflow did not write them."""
        found = self.artifacts()
        if not found:
            return None
        if not self.written_by_distflow():
            names = ", ".join(p.relative_to(self.root).as_posix() for p in found[:4])
            raise ConfigError(f"run.output_dir {self.root} holds files distflow did not write ({names}); "
                              "choose an empty or new folder")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest, n = self.previous / stamp, 1
        while dest.exists():
            n += 1
            dest = self.previous / f"{stamp}-{n}"
        for path in found:
            target = dest / path.relative_to(self.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(target))
        return dest
