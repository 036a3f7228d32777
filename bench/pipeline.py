"""Role-split ranks against sync on the same ranks: trained samples per second of sync, split eta = 0, 1, 2
(the staged schedule) and split eta = 2 with versions applied in flight (pipeline.apply=inflight).

Every mode runs the real loop on W ranks (default 4; split: W/2 trainers + W/2 rollout ranks) and
trains the same global batch per step (split: data.prompts_per_rank x W / T per trainer). Modes run as
separate launches, alternated over --repeats (sync, split0, split1, split2, inflight2, sync, ...; --smoke
leaves split1 out); each mode's first --warmup steps are left out.

`--engine-time tau0,tau1` pads every generate call to a GPU-like duration by sleeping after it (an
observer of the run, distflow.metrics.timer): tau0 x L + tau1 x b x L seconds for b sequences of L
tokens (L = rollout.max_new_tokens: the tiny random model almost never ends a response early), the time one engine
decoding them together takes (shared async-design section 4: T_batch = tau0 L_max + tau1 K). Sleeping
costs no CPU, so on 2 cores the overlap of generation and training shows; without it both roles
compete for the same cores and no gain is expected.

Per mode: step, generate (the generating ranks'), update and publish seconds, the trainers' wait in
collectives and for the step's groups (timing/recv_wait_s), the rollout ranks' idle ratio
(rollout/idle_ratio), staleness mean/max, trained samples/s and its ratio vs sync, and the model's ratio
from the measured parts: sync S = T_batch(W) + t, split eta = 0: T_batch(R) + t + r, eta >= 1:
max(T_batch(R), t + r) (inflight too), t the trainers' own step time (sync's step - generate), r the
publish, T_batch(R) the emulated time plus sync's real generate time scaled by the sequences per rank.

    .venv/bin/python bench/pipeline.py --engine-time 0.02,0.0005
    .venv/bin/python bench/pipeline.py                          # real CPU engines only
    .venv/bin/python bench/pipeline.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

MODES = ("sync", "split0", "split1", "split2", "inflight2")
SMOKE_MODES = ("sync", "split0", "split2", "inflight2")  # split1 runs split2's code


class EngineTime:
    """Pads each generate call of this rank to tau0 L + tau1 b L seconds by sleeping after it, and each
    engine step of an inflight rollout rank (which steps its engine itself) to tau0 + tau1 b, b the
    samples it decoded (the hf engine's count; others: tau0 only)."""

    def __init__(self, tau0: float, tau1: float, length: int, group_size: int):
        self.tau0, self.tau1, self.length, self.group_size = tau0, tau1, length, group_size
        self.groups = 0  # groups per call: set once the job is built (its rollout's per_rank)
        self.engine = None  # the rank's engine, for the samples an engine step decoded
        self.decoding = 0

    def on_phase_start(self, phase: str, step: int) -> None:
        if phase == "engine_step":
            self.decoding = getattr(self.engine, "running_samples", lambda: 0)()

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None:
        if self.tau0 + self.tau1 <= 0:
            return
        if phase == "generate":
            b = self.groups * self.group_size
            time.sleep(max(0.0, self.tau0 * self.length + self.tau1 * b * self.length))
        elif phase == "engine_step":
            time.sleep(self.tau0 + self.tau1 * self.decoding)


def worker(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from config_helpers import compose

    from distflow.job import build_job
    from distflow.run.exit import exit_process

    tau0, tau1 = map(float, a.engine_time.split(","))
    pad = EngineTime(tau0, tau1, a.max_new_tokens, a.group_size)
    job = build_job(compose(json.loads(a.overrides)), [pad])
    rollout = job.rollout.local if hasattr(job.rollout, "local") else job.rollout  # a split trainer's own
    pad.groups, pad.engine = rollout.per_rank, rollout.engine
    start = time.perf_counter()
    job.train()
    wall = time.perf_counter() - start
    publisher = getattr(job.rollout, "publisher", None)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank_{job.run.dist.rank}.json").write_text(json.dumps({
        "trainer": hasattr(job, "learner"), "wall_s": wall,
        "published_bytes": publisher.sent_bytes if publisher is not None else 0}))
    job.close()
    exit_process(0)  # skip the interpreter's teardown of torch and vLLM


def summarise(results: dict[str, list[dict]], warmup: int, tau: tuple[float, float], shape: dict) -> list[dict]:
    """Means over each mode's steps after the warm-up, every repeat together; the ratios against sync."""
    def mean(rows, key):
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    out, w, t_ranks, length, g = [], shape["world"], shape["trainers"], shape["length"], shape["group_size"]
    sync = [r for run in results["sync"] for r in run["rows"][warmup:]]
    b_sync = shape["prompts"] * g  # sequences per generate call in sync
    real_gen, sync_step = mean(sync, "timing/generate_s"), mean(sync, "timing/step_s")  # (the phase ends before the pad)
    sync_gen = real_gen + tau[0] * length + tau[1] * b_sync * length
    train = sync_step - sync_gen  # the trainers' own work per step (logprobs, update, resync)
    for mode in results:
        rows = [r for run in results[mode] for r in run["rows"][warmup:]]
        ranks = [x for run in results[mode] for x in run["ranks"]]
        samples = mean(rows, "samples_per_step")
        step = mean(rows, "timing/step_s")
        if mode == "sync":
            generate, model_step = sync_gen, sync_step
        else:
            eta, r_ranks = int(mode[-1]), w - t_ranks
            b = shape["prompts"] * w // r_ranks * g  # each rollout rank's share of the global batch
            t_batch = tau[0] * length + tau[1] * b * length + real_gen * b / b_sync
            publish = mean(rows, "timing/sync_s")
            generate = t_batch
            model_step = t_batch + train + publish if eta == 0 else max(t_batch, train + publish)
        out.append({
            "mode": mode, "steps": len(rows), "step_s": step, "generate_s": generate,
            "update_s": mean(rows, "timing/update_s"), "publish_s": mean(rows, "timing/sync_s"),
            "trainer_wait_s": mean(rows, "timing/wait_s"),
            "trainer_recv_wait_s": mean(rows, "timing/recv_wait_s"),
            "rollout_idle_ratio": mean(rows, "rollout/idle_ratio"),
            "published_bytes_per_trainer_step": statistics.fmean(
                x["published_bytes"] for x in ranks if x["trainer"]) / max(len(results[mode][0]["rows"]), 1),
            "staleness_mean": mean(rows, "staleness/mean"), "staleness_max": max((r.get("staleness/max", 0) for r in rows),
                                                                                 default=0),
            "samples_per_s": samples / step,
            "model_step_s": model_step, "model_samples_per_s": samples / model_step,
        })
    base = out[0]
    for s in out:
        s["ratio_vs_sync"] = s["samples_per_s"] / base["samples_per_s"]
        s["model_ratio"] = s["model_samples_per_s"] / base["model_samples_per_s"]
        s["of_model"] = s["ratio_vs_sync"] / s["model_ratio"]
    return out


def main() -> None:
    import common as C

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="W: every mode's ranks (split: W/2 + W/2)")
    p.add_argument("--engine", default="hf", choices=("vllm", "hf"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=None, help="steps per launch (default 6; --smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="first steps of a launch left out (default 2; --smoke 0)")
    p.add_argument("--repeats", type=int, default=None, help="launches per mode (default 2; --smoke 1)")
    p.add_argument("--prompts-per-rank", type=int, default=2, help="per rank of a sync run; the global batch is W x it")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=None, help="L (default 32; --smoke 8)")
    p.add_argument("--engine-time", default="0,0", metavar="TAU0,TAU1", help="seconds per engine step: tau0 + tau1 x b")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override after the bench's")
    args = p.parse_args()
    steps, warmup = args.steps or (2 if args.smoke else 6), args.warmup if args.warmup is not None else (0 if args.smoke else 2)
    repeats, length = args.repeats or (1 if args.smoke else 2), args.max_new_tokens or (8 if args.smoke else 32)
    w, trainers = args.nproc, args.nproc // 2
    tau = tuple(map(float, args.engine_time.split(",")))
    wd = C.work_dir(args, "pipeline")
    modes = SMOKE_MODES if args.smoke else MODES
    results: dict[str, list[dict]] = {m: [] for m in modes}
    print(f"[pipeline] {args.engine} {args.model} W={w} (split {trainers}+{w - trainers}) L={length} "
          f"{args.prompts_per_rank * w}x{args.group_size} per step, engine time {args.engine_time}", flush=True)
    for rep in range(repeats):
        for mode in modes:
            run_dir, out = wd / f"{mode}_{rep}" / "run", wd / f"{mode}_{rep}" / "ranks"
            C.fresh(run_dir, out)
            prompts = args.prompts_per_rank if mode == "sync" else args.prompts_per_rank * w // trainers
            extra = [] if mode == "sync" else ["pipeline.mode=split", f"pipeline.rollout_ranks={w - trainers}",
                                                f"pipeline.max_staleness={mode[-1]}"] + \
                (["pipeline.apply=inflight"] if mode.startswith("inflight") else [])
            overrides = C.distflow_overrides(args.model, run_dir, steps, prompts, args.group_size, length, 1e-6,
                                             args.engine, ["rollout_correction=token_tis", "run.sync_probe_every=1000",
                                                           *extra, *args.set])
            C.torchrun(__file__, ["--worker", "--overrides", json.dumps(overrides), "--out", str(out),
                                  "--engine-time", args.engine_time, "--max-new-tokens", str(length),
                                  "--group-size", str(args.group_size)], w, wd / f"{mode}_{rep}.log")
            rows = C.read_metrics(run_dir)
            for r in rows:
                r["samples_per_step"] = prompts * args.group_size * (w if mode == "sync" else trainers)
            results[mode].append({"rows": rows, "ranks": [json.loads(f.read_text()) for f in sorted(out.glob("rank_*.json"))]})
    shape = {"world": w, "trainers": trainers, "length": length, "group_size": args.group_size,
             "prompts": args.prompts_per_rank}
    summary = summarise(results, warmup, tau, shape)
    print(C.table(["mode", "step s", "generate s", "update s", "publish s", "trainer wait s", "recv wait s",
                   "rollout idle", "staleness mean/max", "samples/s", "x sync", "model x sync", "of model"],
                  [[s["mode"], s["step_s"], s["generate_s"], s["update_s"], s["publish_s"], s["trainer_wait_s"],
                    s["trainer_recv_wait_s"], s["rollout_idle_ratio"],
                    f"{s['staleness_mean']:.2f}/{s['staleness_max']:.0f}", s["samples_per_s"], s["ratio_vs_sync"],
                    s["model_ratio"], s["of_model"]] for s in summary]))
    C.write_json(args.results_dir, "pipeline", {
        "bench": "pipeline", "smoke": args.smoke, "machine": C.machine(), "engine": args.engine, "model": args.model,
        "world": w, "trainers": trainers, "max_new_tokens": length, "prompts_per_rank_sync": args.prompts_per_rank,
        "group_size": args.group_size, "engine_time": tau, "steps": steps, "warmup": warmup, "repeats": repeats,
        "summary": summary, "runs": results})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        import common as C

        worker(C.worker_args(("--max-new-tokens", "--group-size"), ("--engine-time",)))
    else:
        main()
