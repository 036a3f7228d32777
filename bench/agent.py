"""Agents on any harness: episodes/s and generated tokens/s of a multi-turn harness through each
rank's OpenAI-compatible endpoint, the engine stepping in waves (reproducible) or taking requests
as they come, and the update's forward tokens with shared prefixes (the group's prompt, a request's
n choices) packed once or padded.

    .venv/bin/python bench/agent.py [--models smollm2_135m] [--repeats 2] [--steps 4] [--turns 3] [--tool-ms 20]

The harness (bench/agent_harness.py) makes --turns requests per episode with a --tool-ms sleep
between them (a tool's latency). Launches of recipes/grpo.py alternate, per repeat, over the
variants: `wave` (agent.wait=wave, optim.shared_prefix=on: the baseline), `free`
(agent.wait=free) and `padded` (optim.shared_prefix=off), and `n4` and `n4_padded`, whose harness
asks for 4 choices of its first turn and goes on from the first (each episode trains 4 rows, 3 of
them branches sharing the first prompt), packed and padded; step 1 of each is a warm-up. Per
variant: episodes and generated tokens per second of generation, generate/update/step seconds,
the update's forward tokens (`update/forward_tokens`), and the ratios against `wave`. Writes
bench/results/agent.json (--smoke: the tiny model, the HF engine, 1 process, 1 step of one prompt's group,
2 turns, one launch each, at once).
"""

from __future__ import annotations

import statistics

import common as C

# name: (overrides, choices of the first turn)
VARIANTS = {"wave": (["agent.wait=wave", "optim.shared_prefix=on"], 1),
            "free": (["agent.wait=free", "optim.shared_prefix=on"], 1),
            "padded": (["agent.wait=wave", "optim.shared_prefix=off"], 1),
            "n4": (["agent.wait=wave", "optim.shared_prefix=on"], 4),
            "n4_padded": (["agent.wait=wave", "optim.shared_prefix=off"], 4)}
SETTINGS = dict(prompts_per_rank=4, group_size=4, max_new_tokens=32, lr=1e-6)


def launch(args, model: str, variant: str, repeat: int, wd) -> dict:
    tag = f"{model}_{variant}_{repeat}"
    out = wd / tag
    C.fresh(out)
    s = SETTINGS if not args.smoke else dict(SETTINGS, prompts_per_rank=1, max_new_tokens=8)  # one group
    extra = ["task.agent=agent_harness:run", f"rollout.max_turns={args.turns}",
             f"rollout.max_total_tokens={args.turns * (s['max_new_tokens'] + 24)}", "run.sync_probe_seqs=0",
             *VARIANTS[variant][0]]
    cmd = C.distflow_overrides(model, out, args.steps, s["prompts_per_rank"], s["group_size"], s["max_new_tokens"],
                               s["lr"], C.engine(args), extra)
    nproc = 1 if args.smoke else 2  # (--smoke: the script's check, not a measurement)
    C.torchrun(C.GRPO, cmd, nproc, wd / f"{tag}.log",
               extra_env={"AGENT_BENCH_TURNS": str(args.turns), "AGENT_BENCH_TOOL_MS": str(args.tool_ms),
                          "AGENT_BENCH_N": str(VARIANTS[variant][1])})
    ms = C.read_metrics(out)[1:] or C.read_metrics(out)  # step 1 is the warm-up (a smoke run keeps it)
    episodes = nproc * s["prompts_per_rank"] * s["group_size"]
    return {"episodes_per_s": [episodes / m["timing/generate_s"] for m in ms],
            "generated_tokens_per_s": [episodes * m["response_length/generated_mean"] / m["timing/generate_s"]
                                       for m in ms],
            "generate_s": [m["timing/generate_s"] for m in ms], "update_s": [m["timing/update_s"] for m in ms],
            "step_s": [m["timing/step_s"] for m in ms], "forward_tokens": [m["update/forward_tokens"] for m in ms],
            "requests_mean": [m["agent/requests_mean"] for m in ms],
            "rows_per_episode": [1 + (m["agent/branches"] + m["agent/restarts"]) / episodes for m in ms],
            "command": f"torchrun --standalone --nproc_per_node {nproc} recipes/grpo.py " + " ".join(cmd)}


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="launches per variant (default 2; --smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per launch incl. 1 warm-up (default 4; --smoke: 1, kept)")
    p.add_argument("--turns", type=int, default=None, help="requests per episode (default 3; --smoke: 2)")
    p.add_argument("--tool-ms", type=float, default=20.0, help="the harness's tool latency between requests")
    args = p.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.steps = args.steps or (1 if args.smoke else 4)
    args.turns = args.turns or (2 if args.smoke else 3)  # --smoke: still a tool's sleep and reply between turns
    wd = C.work_dir(args, "agent")
    records = []
    for model in C.models(args):
        runs = {v: [] for v in VARIANTS}
        order = [(v, r) for r in range(args.repeats) for v in (VARIANTS if r % 2 == 0 else reversed(VARIANTS))]
        for (v, _), rec in zip(order, C.each(lambda vr: launch(args, model, vr[0], vr[1], wd), order,
                                             together=args.smoke)):
            runs[v].append(rec)
        rec = {"model": model, "processes": 1 if args.smoke else 2, "turns": args.turns, "tool_ms": args.tool_ms, "variants": {}}
        for v, launches in runs.items():
            flat = {k: [x for run in launches for x in run[k]] for k in launches[0] if k != "command"}
            rec["variants"][v] = {**{f"{k}_median": statistics.median(xs) for k, xs in flat.items()},
                                  "commands": [run["command"] for run in launches]}
        base = rec["variants"]["wave"]
        rec["free_over_wave_episodes_per_s"] = rec["variants"]["free"]["episodes_per_s_median"] / \
            base["episodes_per_s_median"]
        rec["padded_over_packed_forward_tokens"] = rec["variants"]["padded"]["forward_tokens_median"] / \
            base["forward_tokens_median"]
        n4 = rec["variants"]["n4"]
        rec["n4_padded_over_packed_forward_tokens"] = rec["variants"]["n4_padded"]["forward_tokens_median"] / \
            n4["forward_tokens_median"]
        rec["n4_padded_over_packed_update_s"] = rec["variants"]["n4_padded"]["update_s_median"] / n4["update_s_median"]
        records.append(rec)
        rows = [[v, f"{x['episodes_per_s_median']:.2f}", f"{x['generated_tokens_per_s_median']:.0f}",
                 f"{x['generate_s_median']:.2f}", f"{x['update_s_median']:.2f}", f"{x['step_s_median']:.2f}",
                 f"{x['forward_tokens_median']:.0f}", f"{x['rows_per_episode_median']:.2f}"]
                for v, x in rec["variants"].items()]
        print(f"{model}: {args.turns} requests per episode, {args.tool_ms:g} ms tool latency, {rec['processes']} processes")
        print(C.table(["variant", "episodes/s", "generated tok/s", "generate s", "update s", "step s",
                       "forward tokens", "rows/episode"], rows))
        print(f"free / wave episodes/s: {rec['free_over_wave_episodes_per_s']:.2f}; padded / packed forward tokens: "
              f"{rec['padded_over_packed_forward_tokens']:.2f}; with n=4 branches: "
              f"{rec['n4_padded_over_packed_forward_tokens']:.2f} "
              f"(update s {rec['n4_padded_over_packed_update_s']:.2f})")
    C.write_json(args.results_dir, "agent", {"machine": C.machine(), "records": records})


if __name__ == "__main__":
    main()
