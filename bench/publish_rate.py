"""A version's weights through a split run's publish and host-staging paths, on one device: seconds per
GiB of the parts one device can time.

    python bench/publish_rate.py --model DIR [--dtype bfloat16] [--device cuda] [--repeats 5] [--out FILE]

- `pack`: the trainer's side of `WeightPublisher.publish` before the wire, each broadcast bucket
  (pipeline's BROADCAST_BUCKET_BYTES, one dtype) flattened into one tensor on the device;
- `stage_to_host`: a rollout rank's `pipeline.staging=host`, each received tensor into pinned host memory
  (`distflow.pipeline.weights._to_host`; on the CPU, where that is the tensor itself, a copy stands in);
- `host_to_device`: the staged version back onto the device where the engine loads it.

The broadcast itself needs a second device (NCCL takes no two ranks on one GPU), so one-GPU machines
leave it out; on a node, bench/pipeline.py's `publish_s` is the whole publish. Each figure is the median
of --repeats after one warm-up; the model's own tensors are used (safetensors files of DIR, in --dtype).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from distflow.config.pipeline import BROADCAST_BUCKET_BYTES
from distflow.pipeline.weights import _buckets, _to_host


def _timed(fn, device: torch.device, repeats: int) -> float:
    """The median seconds of fn() over `repeats` after a warm-up, the device synchronised around each."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(weights: dict[str, torch.Tensor], device: torch.device, repeats: int) -> dict:
    """Seconds and seconds per GiB of packing, staging to host and loading back, for these tensors."""
    items = list(weights.items())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    stage = _to_host if device.type == "cuda" else (lambda t: t.clone())
    staged = [stage(t) for _, t in items]
    def pack():
        return [torch.cat([t.reshape(-1) for _, t in b]) for b in _buckets(items, BROADCAST_BUCKET_BYTES)]

    seconds = {
        "pack": _timed(pack, device, repeats),
        "stage_to_host": _timed(lambda: [stage(t) for _, t in items], device, repeats),
        "host_to_device": _timed(lambda: [t.to(device, non_blocking=True) for t in staged], device, repeats),
    }
    gib = nbytes / 2**30
    return {"bytes": nbytes, "tensors": len(items), "buckets": sum(1 for _ in _buckets(items, BROADCAST_BUCKET_BYTES)),
            "pinned": device.type == "cuda", **{f"{k}_s": v for k, v in seconds.items()},
            **{f"{k}_s_per_gib": v / gib for k, v in seconds.items()},
            **{f"{k}_gib_per_s": gib / v for k, v in seconds.items() if v > 0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a folder with the model's safetensors files")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    weights = {}
    for f in sorted(Path(a.model).glob("*.safetensors")):
        weights.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(f).items()})
    result = {"model": a.model, "dtype": a.dtype, "device": str(device), "repeats": a.repeats,
              "bucket_bytes": BROADCAST_BUCKET_BYTES, **measure(weights, device, a.repeats)}
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
