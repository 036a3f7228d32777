"""The precision contract, measured: how far the engine's logprobs are from the trainer's for each
engine, dtype and LM-head precision, and what each costs.

For every (task, engine, precision) one run of the recipe: 2 CPU ranks (--smoke: 1), --steps steps. Step 1's
mismatch is pure numerics (the engine sampled with the weights the update's first forward
uses): mismatch/abs_mean, abs_p99, abs_max and kl (k3 of KL(mu || pi)), and the tokens the PPO
clip would cut at step 1 if the engine were the old policy (rollout_correction=bypass, the
"phantom clipping" of an engine that differs from the trainer). Speed: generate and update
seconds per step, medians over the steps after the first.

Precisions: float32; bf16 with both LM heads in float32 (model.logprob_head_float32=true, the
default: the trainer's chunked path, the HF engine's Float32Head; vLLM's head stays bf16); bf16
with both heads in bf16 (=false).

    .venv/bin/python bench/precision.py                       # demo and tools tasks, vLLM and HF
    .venv/bin/python bench/precision.py --tasks demo --engines vllm
    .venv/bin/python bench/precision.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import statistics

import common as C

PRECISIONS = {  # name -> overrides
    "float32": ["model.dtype=float32"],
    "bf16, fp32 heads": ["model.dtype=bfloat16", "model.logprob_head_float32=true"],
    "bf16, bf16 heads": ["model.dtype=bfloat16", "model.logprob_head_float32=false"],
}
TASKS = {  # name -> the experiment it runs, shortened
    "demo": ["experiment=demo"],
    "tools": ["experiment=tools_smollm2"],
}
COMMON = ["validation.before_train=false", "validation.at_end=false", "logging.plot_at_end=false",
          "logging.progress_bar=false", "checkpoint.resume=never", "run.sync_probe_every=1000"]
KEYS = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/abs_max", "mismatch/kl")


def one(args, task: str, engine: str, precision: str, bypass: bool) -> dict:
    name = f"{task}-{engine}-{precision.replace(', ', '-').replace(' ', '')}{'-bypass' if bypass else ''}"
    out = C.work_dir(args, "precision") / name
    C.fresh(out)
    overrides = [*TASKS[task], f"rollout={engine}", *PRECISIONS[precision], *COMMON, f"run.steps={args.steps}",
                 f"run.output_dir={out}", *(["rollout_correction=bypass"] if bypass else []),
                 *(["model=tiny", "rollout.max_new_tokens=16"] if args.smoke else [])]  # at 8, bf16's gap was 1e-6
    # --smoke: one rank each, as its two launches run at once (a rank's mismatch does not depend on the world size)
    wall = C.torchrun(C.GRPO, overrides, 1 if args.smoke else 2, out.parent / f"{name}.log")
    rows = C.read_metrics(out)
    first, later = rows[0], rows[1:] or rows
    row = {"task": task, "engine": engine, "precision": precision, "bypass": bypass, "wall_s": wall,
           **{k.split("/")[1]: first[k] for k in KEYS},
           "generate_s": statistics.median(r["timing/generate_s"] for r in later),
           "update_s": statistics.median(r["timing/update_s"] for r in later)}
    if bypass:
        row["clip_step1"] = first["clip/fraction_low"] + first["clip/fraction_high"]
    return row


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--tasks", default="demo,tools")
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if args.smoke:
        args.tasks, args.engines, args.steps = "demo", "hf", 1
    cases = [(t, e, pr, False) for t in args.tasks.split(",") for e in args.engines.split(",") for pr in PRECISIONS]
    # bypass: the PPO ratio against the engine, where the mismatch shows as clipping
    cases += [(t, e, "bf16, fp32 heads", True) for t in args.tasks.split(",") for e in args.engines.split(",")]
    if args.smoke:  # two launches: float32 in bypass mode (an exact engine must clip nothing), bf16 as trained
        cases = [("demo", "hf", "float32", True), ("demo", "hf", "bf16, fp32 heads", False)]
    rows = C.each(lambda c: one(args, *c), cases, together=args.smoke)
    headers = ["task", "engine", "precision", "bypass", "abs_mean", "abs_p99", "abs_max", "kl", "clip_step1",
               "generate_s", "update_s"]
    print(C.table(headers, [[r.get(h, "") for h in headers] for r in rows]))
    C.write_json(args.results_dir, "precision", {"machine": C.machine(), "cpu_bf16": C.cpu_bf16_support(),
                                                 "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
