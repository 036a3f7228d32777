"""A version's weights through a split run's publish and host-staging paths: seconds per GiB of the parts
one device can time, and with --ranks the whole publish to the other ranks.

    python bench/publish_rate.py --model DIR [--dtype bfloat16] [--device cuda] [--repeats 5] [--out FILE]
    python bench/publish_rate.py --model DIR --ranks 3 --device cpu      # 1 trainer -> 2 rollout ranks, gloo

- `pack`: the trainer's side of `WeightPublisher.publish` before the wire, each broadcast bucket
  (pipeline's BROADCAST_BUCKET_BYTES, one dtype) flattened into one tensor on the device;
- `stage_to_host`: a rollout rank's `pipeline.staging=host`, each received tensor into pinned host memory
  (`distflow.pipeline.weights._to_host`);
- `host_to_device`: the staged version back onto the device where the engine loads it (on the CPU, where
  both moves are the tensor itself, a copy stands in for each);
- `publish` (--ranks R >= 2): rank 0's `WeightPublisher.publish` of one version to ranks 1..R-1, each
  with a `WeightReceiver` taking its tensors, bucket by bucket, over gloo on the CPU or NCCL with one
  GPU per rank (NCCL takes no two ranks on one GPU, so one-GPU machines leave it out).

Each figure is the median of --repeats after one warm-up; the model's own tensors are used (safetensors
files of DIR, in --dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import common as C
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
    cuda = device.type == "cuda"  # on the CPU, where both moves are the tensor itself, a copy stands in
    stage = _to_host if cuda else (lambda t: t.clone())
    back = (lambda t: t.to(device, non_blocking=True)) if cuda else (lambda t: t.clone())
    staged = [stage(t) for _, t in items]
    buckets = list(_buckets(items, BROADCAST_BUCKET_BYTES))
    seconds = {
        "pack": _timed(lambda: [torch.cat([t.reshape(-1) for _, t in b]) for b in buckets], device, repeats),
        "stage_to_host": _timed(lambda: [stage(t) for _, t in items], device, repeats),
        "host_to_device": _timed(lambda: [back(t) for t in staged], device, repeats),
    }
    gib = nbytes / 2**30
    return {"bytes": nbytes, "tensors": len(items), "buckets": len(buckets), "pinned": cuda,
            **{f"{k}_s": v for k, v in seconds.items()}, **{f"{k}_s_per_gib": v / gib for k, v in seconds.items()},
            **{f"{k}_gib_per_s": gib / v for k, v in seconds.items() if v > 0}}


def load(model: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        weights.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(f).items()})
    return weights


def _publish_rank(rank: int, world: int, a: argparse.Namespace, port: int, out: str) -> None:
    """One rank of the --ranks run: rank 0 publishes --repeats + 1 versions, the others receive them."""
    from distflow.pipeline.links import Links
    from distflow.pipeline.weights import WeightPublisher, WeightReceiver

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = a.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    links = Links(dist.new_group(backend="gloo"), rank, timeout_s=300)  # announces, as a split run's
    group = dist.new_group(backend="nccl" if cuda else "gloo")  # the weight group
    if rank == 0:
        weights, times = load(a.model, device, getattr(torch, a.dtype)), []
        publisher = WeightPublisher(links, 0, list(range(1, world)), group, 300)
        for version in range(a.repeats + 1):
            t0 = time.perf_counter()
            publisher.publish(weights.items(), version)
            times.append(time.perf_counter() - t0)
        Path(out).write_text(json.dumps(times[1:]))
    else:
        receiver = WeightReceiver(links, 0, group, device, 300)
        for _ in range(a.repeats + 1):
            for _name, _t in receiver.tensors(receiver.announce()):
                pass
    links.flush()
    dist.barrier()
    dist.destroy_process_group()


def publish_figures(a: argparse.Namespace, nbytes: int) -> dict:
    """The --ranks run's seconds per version, per GiB, and GiB/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "publish.json")
        torch.multiprocessing.spawn(_publish_rank, args=(a.ranks, a, C.free_port(), out), nprocs=a.ranks)
        times = json.loads(Path(out).read_text())
    seconds, gib = statistics.median(times), nbytes / 2**30
    return {"ranks": a.ranks, "receivers": a.ranks - 1, "publish_s": seconds, "publish_s_per_gib": seconds / gib,
            "publish_gib_per_s": gib / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a folder with the model's safetensors files")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1, help=">= 2: also publish to ranks 1..R-1 (one device each)")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    result = {"model": a.model, "dtype": a.dtype, "device": str(device), "repeats": a.repeats,
              "bucket_bytes": BROADCAST_BUCKET_BYTES, **measure(load(a.model, device, dtype), device, a.repeats)}
    if a.ranks >= 2:
        result.update(publish_figures(a, result["bytes"]))
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
