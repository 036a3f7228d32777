"""Multi-turn episodes in flight on role-split ranks: pipeline.env_wait=wave against free, with an
environment that takes --env-ms per turn (bench/slow_env.py).

Both variants run the same split run (W ranks, W/2 trainers + W/2 rollout ranks, pipeline.apply=inflight,
eta 1): every episode takes --turns model turns, each but the last answered by the environment in the
task's worker processes (--env-workers of them a rank) after --env-ms. `wave` answers the turns that
finished in one engine step together while the engine waits; `free` steps the engine on the other
episodes while those answers run, and submits each episode's next turn as its answer arrives. Launches
alternate (wave, free, free, wave, ...) over --repeats; each launch's first --warmup steps are left out.
Per variant, over its measured steps: mean step, the trainers' wait for their groups
(timing/recv_wait_s), the rollout ranks' idle ratio, turns per episode; trained tokens/s (prompt and
response) and samples/s over the summed step time; free / wave.

    .venv/bin/python bench/env_wait.py                              # HF engine, tiny, 50 ms a turn
    .venv/bin/python bench/env_wait.py --engine vllm --env-ms 200
    .venv/bin/python bench/env_wait.py --smoke --results-dir /tmp/r  # 2 ranks (1 + 1), 1 step, at once
"""

from __future__ import annotations

import statistics

import common as C

VARIANTS = ("wave", "free")
KEYS = {"step_s": "timing/step_s", "recv_wait_s": "timing/recv_wait_s", "rollout_idle_ratio": "rollout/idle_ratio",
        "turns_mean": "turns/mean"}


def launch(args, variant: str, repeat: int, wd) -> dict:
    out = wd / f"{variant}_{repeat}"
    C.fresh(out)
    trainers = args.nproc // 2
    extra = ["pipeline.mode=split", f"pipeline.rollout_ranks={args.nproc - trainers}", "pipeline.apply=inflight",
             "pipeline.max_staleness=1", f"pipeline.env_wait={variant}", "task.env=slow_env:SlowEnv",
             f"+task.env_args={{delay: {args.env_ms / 1000}, turns: {args.turns}}}",
             f"task.reward_workers={args.env_workers}",
             f"rollout.max_turns={args.turns}",
             f"rollout.max_total_tokens={args.turns * (args.max_new_tokens + 16)}", "rollout.max_prompt_tokens=352",
             "rollout_correction=token_tis", "run.sync_probe_every=1000", *args.set]
    cmd = C.distflow_overrides(args.model, out, args.steps, args.prompts_per_rank, args.group_size,
                               args.max_new_tokens, 1e-6, args.engine, extra)
    C.torchrun(C.GRPO, cmd, args.nproc, wd / f"{variant}_{repeat}.log")
    rows = C.read_metrics(out)[args.warmup:]
    return {**{k: [r[m] for r in rows] for k, m in KEYS.items()}, "tokens": [C.step_tokens(r) for r in rows],
            "samples_per_step": args.prompts_per_rank * args.group_size * trainers,
            "command": f"torchrun --standalone --nproc_per_node {args.nproc} recipes/grpo.py " + " ".join(cmd)}


def summary(launches: list[dict]) -> dict:
    """Means over every measured step of a variant's launches; samples and tokens per second over their
    summed step time (at eta 1 steps alternate between waiting for groups and finding them there, so a
    median step would pick one kind)."""
    steps = {k: [x for run in launches for x in run[k]] for k in (*KEYS, "tokens")}
    seconds, n = sum(steps["step_s"]), len(steps["step_s"])
    return {**{f"{k}_mean": statistics.fmean(steps[k]) for k in KEYS}, "steps": n,
            "samples_per_s": launches[0]["samples_per_step"] * n / seconds,
            "tokens_per_s": sum(steps["tokens"]) / seconds,
            "commands": [run["command"] for run in launches]}


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="W (default 4; --smoke 2): W/2 trainers + W/2 rollout ranks")
    p.add_argument("--engine", default="hf", choices=("vllm", "hf"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=None, help="steps per launch (default 7; --smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="first steps of a launch left out (default 1; --smoke 0)")
    p.add_argument("--repeats", type=int, default=None, help="launches per variant (default 2; --smoke 1)")
    p.add_argument("--prompts-per-rank", type=int, default=4, help="prompts per trainer and step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16, help="per turn")
    p.add_argument("--turns", type=int, default=3, help="model turns per episode")
    p.add_argument("--env-ms", type=float, default=50.0, help="the environment's latency per turn")
    p.add_argument("--env-workers", type=int, default=None,
                   help="task.reward_workers: turns answered at once per rank (default 8; --smoke 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override after the bench's")
    args = p.parse_args()
    args.nproc = args.nproc or (2 if args.smoke else 4)
    args.steps = args.steps or (1 if args.smoke else 7)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1)
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.env_workers = args.env_workers or (1 if args.smoke else 8)
    wd = C.work_dir(args, "env_wait")
    order = [(v, r) for r in range(args.repeats) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]
    trainers = args.nproc // 2
    print(f"[env_wait] {args.engine} {args.model} W={args.nproc} (split {trainers}+{args.nproc - trainers}), "
          f"{args.turns} turns of {args.max_new_tokens} tokens, {args.env_ms:g} ms a turn at the environment "
          f"({args.env_workers} workers a rank)", flush=True)
    runs = {v: [] for v in VARIANTS}
    for (v, _), rec in zip(order, C.each(lambda vr: launch(args, *vr, wd), order, together=args.smoke)):
        runs[v].append(rec)
    variants = {v: summary(launches) for v, launches in runs.items()}
    free_over_wave = variants["free"]["samples_per_s"] / variants["wave"]["samples_per_s"]
    print(C.table(["env_wait", "step s", "recv wait s", "rollout idle", "trained tok/s", "turns", "samples/s"],
                  [[v, x["step_s_mean"], x["recv_wait_s_mean"], x["rollout_idle_ratio_mean"], x["tokens_per_s"],
                    x["turns_mean_mean"], x["samples_per_s"]] for v, x in variants.items()]))
    print(f"free / wave samples/s: {free_over_wave:.2f}")
    C.write_json(args.results_dir, "env_wait", {
        "bench": "env_wait", "smoke": args.smoke, "machine": C.machine(), "engine": args.engine, "model": args.model,
        "world": args.nproc, "turns": args.turns, "env_ms": args.env_ms, "env_workers": args.env_workers,
        "max_new_tokens": args.max_new_tokens,
        "prompts_per_rank": args.prompts_per_rank, "group_size": args.group_size, "steps": args.steps,
        "warmup": args.warmup, "repeats": args.repeats, "variants": variants,
        "free_over_wave_samples_per_s": free_over_wave})


if __name__ == "__main__":
    main()
