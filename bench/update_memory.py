"""Peak memory of one update micro-batch (policy forward + backward) with and without the
memory levers: chunked logprobs (`model.logprob_chunk_tokens`) and activation checkpointing
(`model.activation_checkpointing`).

Each variant runs in a fresh 1-rank process (torchrun), so allocator caches and high-water marks
never carry over (`--smoke`, which only checks that the script runs, measures all four in one
process, saving three start-ups): it builds the FSDP2 policy, then measures one `Updater.backward_policy` over a
fixed batch that is a single micro-batch (entropy bonus on, so entropy is computed too). On CPU
the peak is the RSS high-water mark (reset with /proc/self/clear_refs just before the pass); on
CUDA it is torch's peak allocated bytes. `delta` is the peak minus the memory held just before
(the model, no gradients yet): activations, logits, gradients and the allocator's slack.

    .venv/bin/python bench/update_memory.py                               # smollm2_135m, two shapes
    .venv/bin/python bench/update_memory.py --shapes 8x64x48 --models tiny
    .venv/bin/python bench/update_memory.py --smoke --results-dir /tmp/r

`micro_batch_peak(policy, batch, cfg)` is the measurement itself, for other benchmarks to call.
"""

from __future__ import annotations

import json
import re
import sys
import time

# A fixed mmap threshold: glibc then serves every tensor above 64 KiB with its own mapping and
# returns it to the OS when freed, so RSS follows the live tensors instead of the heap's
# high-water mark (by default the threshold grows with freed blocks, up to 32 MiB, and freed
# memory below it stays resident: allocator slack that would blur the comparison).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# name: (model.logprob_chunk_tokens, model.activation_checkpointing)
VARIANTS = {"plain": (0, False), "chunked": (512, False), "checkpointed": (0, True), "both": (512, True)}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def reset_peak() -> float:
    """Reset the peak-memory counter; returns the memory held now (MiB): RSS on CPU, allocated on CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the RSS high-water mark to the current RSS
        f.write("5")
    return _status_mib("VmRSS")


def peak_mib() -> float:
    """The peak since the last reset_peak() (MiB)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return _status_mib("VmHWM")


def micro_batch_peak(policy, batch, cfg) -> dict:
    """{"before_mib", "peak_mib", "delta_mib", "seconds"} of one Updater.backward_policy over all rows of `batch`
    (an UpdateBatch; make optim.micro_batch_size at least its length for a single micro-batch)."""
    from distflow.train.update import Updater

    before = reset_peak()
    t0 = time.perf_counter()
    Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
    seconds = time.perf_counter() - t0
    peak = peak_mib()
    policy.optimizer.zero_grad(set_to_none=True)
    return {"before_mib": round(before, 1), "peak_mib": round(peak, 1), "delta_mib": round(peak - before, 1),
            "seconds": round(seconds, 2)}


def worker(a) -> None:
    from distflow.distributed import init_distributed, shutdown

    info = init_distributed("gloo", "cpu")
    results = {variant: measure_variant(a, variant, info) for variant in a.variant.split(",")}
    with open(a.out, "w") as f:
        json.dump(results, f)
    shutdown()


def measure_variant(a, variant: str, info) -> dict:
    import torch

    from distflow.config import DistflowConfig
    from distflow.distributed.devices import resolve_auto
    from distflow.distributed.layout import ParallelLayout
    from distflow.models.tiny import resolve_model_path
    from distflow.sample import Sample
    from distflow.train.batch import UpdateBatch
    from distflow.train.policy import Policy

    cfg = DistflowConfig()
    cfg.model.shard_ranks = -1
    cfg.model.logprob_chunk_tokens, cfg.model.activation_checkpointing = VARIANTS[variant]
    cfg.optim.micro_batch_size = a.seqs
    cfg.optim.shared_prefix = "off"  # padded rows (the samples share no prompt); update.py --memory compares packed
    cfg.algorithm.entropy_coef = 0.01
    cfg = resolve_auto(cfg, info.device)  # the trainer's model.dtype for the device (components refuse "auto")
    policy = Policy(resolve_model_path(a.model), cfg.model, cfg.optim, ParallelLayout.from_config(cfg.model, info))
    g = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    samples = [Sample(torch.randint(3, vocab, (a.prompt_tokens,), generator=g).tolist(),
                      torch.randint(3, vocab, (a.response_tokens,), generator=g).tolist(),
                      [0.0] * a.response_tokens, False) for _ in range(a.seqs)]
    batch = UpdateBatch.from_samples(samples, 0, info.device)
    batch = batch.with_(advantages=torch.randn(a.seqs, generator=g)[:, None] * batch.tokens.resp_mask)
    result = micro_batch_peak(policy, batch, cfg)
    return {**result, "vocab": vocab, "params": sum(p.numel() for p in policy.model.parameters())}


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None,
                   help="comma list of SEQSxPROMPTxRESPONSE (default 8x64x48,2x64x512; --smoke: 2x8x8)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or ("2x8x8" if args.smoke else "8x64x48,2x64x512")).split(",")]
    models = C.models(args) if args.models or args.smoke else ["smollm2_135m"]
    wd = C.work_dir(args, "update_memory")
    records = []
    for model in models:
        for seqs, prompt, response in shapes:
            rec = {"model": model, "seqs": seqs, "prompt_tokens": prompt, "response_tokens": response, "variants": {}}
            # one process per variant; --smoke: all of them in one (the numbers then carry over)
            for group in ([list(VARIANTS)] if args.smoke else [[v] for v in VARIANTS]):
                tag = group[0] if len(group) == 1 else "all"
                out = wd / f"{model}-{seqs}x{prompt}x{response}-{tag}.json"
                C.fresh(out)
                print(f"[update_memory] {model} {seqs}x{prompt}x{response} {', '.join(group)}", flush=True)
                C.torchrun(__file__, ["--worker", "--model", model, "--variant", ",".join(group), "--seqs", str(seqs),
                                      "--prompt-tokens", str(prompt), "--response-tokens", str(response),
                                      "--out", str(out)], 1, out.with_suffix(".log"), extra_env=MALLOC_ENV)
                rec["variants"].update(json.loads(out.read_text()))
            records.append(rec)
    print(f"\n{'model':14} {'seqs x prompt x response':>25} " + " ".join(f"{v + ' MiB':>16}" for v in VARIANTS))
    for r in records:
        shape = f"{r['seqs']} x {r['prompt_tokens']} x {r['response_tokens']}"
        print(f"{r['model']:14} {shape:>25} " + " ".join(
            f"{r['variants'][v]['delta_mib']:>7.0f} ({r['variants'][v]['peak_mib']:>5.0f})" for v in VARIANTS))
    C.write_json(args.results_dir, "update_memory", {"records": records, "variants": {k: list(v) for k, v in VARIANTS.items()},
                                         "machine": C.machine()})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        import argparse

        wp = argparse.ArgumentParser()
        wp.add_argument("--worker", action="store_true")
        for name in ("--model", "--out"):
            wp.add_argument(name, required=True)
        wp.add_argument("--variant", required=True, help="comma list, measured one after the other")
        for name in ("--seqs", "--prompt-tokens", "--response-tokens"):
            wp.add_argument(name, type=int, required=True)
        worker(wp.parse_args())
        from distflow.run.exit import exit_process

        exit_process(0)  # the measured ranks are done: skip the interpreter's teardown of torch and vLLM
    else:
        main()
