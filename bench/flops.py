"""Training-phase efficiency: achieved FLOP/s of distflow's update phase vs this machine's fp32 and
bf16 matmul FLOP/s measured in the same run, with the recipe run in each dtype of --dtypes.

    train FLOP/s = 6 x params x trained tokens / update time

params: the model's unique parameters (a tied head once); trained tokens: prompt+response tokens
of all ranks in the step (padding excluded); update time: timing/update_s (slowest rank) from
metrics.jsonl, step 1 (warm-up) skipped. The matmul rates are aggregates of all ranks multiplying
at once inside the same torchrun job, right after the models are loaded and again after the last
step (bench/flops_entry.py; the higher is used), in fp32 and in bf16 whatever the run's dtype, at
square sizes (1024, 2048, 4096) and at the model's own forward GEMMs for a micro-batch of
--gemm-tokens tokens (q/o, k/v, MLP and LM head shapes from the model's config; default 512, about
what a SmolLM2 step here trains: one micro-batch per rank). A dtype's peak is its best shape;
"gemm mix" is the model's GEMMs together, FLOP-weighted. % peak uses the peak of the dtype the run
trained in: model.dtype as the run resolved it, read back from its config.json.

    .venv/bin/python bench/flops.py                       # tiny + smollm2_135m, 1 and 2 processes, fp32 and bf16
    .venv/bin/python bench/flops.py --models smollm2_135m --nprocs 1 --steps 5 --dtypes bfloat16
    .venv/bin/python bench/flops.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import json

import common as C
from vs_trl import SETTINGS

GOAL = 0.50
RUN_DTYPES = ("auto", "float32", "bfloat16")  # model.dtype values
PEAK_DTYPES = ("float32", "bfloat16")  # measured in every run


def model_gemms(model_path: str, tokens: int) -> dict:
    """The forward GEMMs of a `tokens`-token micro-batch, `F.linear([m, k], [n, k])` shapes from the
    model's config, keyed "MxKxN"; shapes that coincide (q and o when heads x head_dim = hidden)
    are merged, `count` = how many one forward runs."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    h, layers = c.hidden_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, (c.num_key_value_heads or c.num_attention_heads) * head_dim
    i = c.intermediate_size
    out: dict = {}
    for name, k, n, count in [("q_proj", h, q, layers), ("k_proj", h, kv, layers), ("v_proj", h, kv, layers),
                              ("o_proj", q, h, layers), ("gate_proj", h, i, layers), ("up_proj", h, i, layers),
                              ("down_proj", i, h, layers), ("lm_head", h, c.vocab_size, 1)]:
        g = out.setdefault(f"{tokens}x{k}x{n}", {"m": tokens, "k": k, "n": n, "count": 0, "layers": []})
        g["count"] += count
        g["layers"].append(name)
    return out


def best(peak_rec: dict, dtype: str, key: str) -> float:
    """The higher of the before / after measurements."""
    return max(peak_rec["before"][dtype][key], peak_rec["after"][dtype][key])


def run_dtype(out) -> str:
    """model.dtype as the run resolved it ("auto" made concrete), from its config.json."""
    return json.loads((out / "config.json").read_text())["model"]["dtype"]


def measure(model: str, nproc: int, dtype: str, measured: int, s: dict, params: int, wd, args, env: dict) -> dict:
    """One torchrun launch of the recipe in `dtype`; its record."""
    out = wd / f"run-{model}-n{nproc}-{dtype}"
    peak_file = wd / f"peak-{model}-n{nproc}-{dtype}.json"
    C.fresh(out, peak_file)
    print(f"[flops] {model} nproc={nproc} dtype={dtype}", flush=True)
    overrides = C.distflow_overrides(model, out, measured + 1, max(1, s["prompts_per_step"] // nproc),
                                     s["group_size"], s["max_new_tokens"], s["lr"], C.engine(args),
                                     extra=[f"model.dtype={dtype}"])
    C.torchrun(C.BENCH / "flops_entry.py", overrides, nproc, wd / f"{model}-n{nproc}-{dtype}.log",
               extra_env={**env, "DISTFLOW_FLOPS_OUT": str(peak_file)})
    peak_rec = json.loads(peak_file.read_text())
    ran = run_dtype(out)
    peaks = {dt: best(peak_rec, dt, "peak") for dt in PEAK_DTYPES}
    mixes = {dt: best(peak_rec, dt, "gemm_mix") for dt in PEAK_DTYPES}
    peak, mix = peaks[ran], mixes[ran]
    ms = C.read_metrics(out)
    assert len(ms) == measured + 1, f"{out}: {len(ms)} logged steps, expected {measured + 1}"
    ms = ms[1:]  # step 1 is the warm-up
    tokens = sum(C.step_tokens(m) for m in ms)
    update_s = sum(m["timing/update_s"] for m in ms)
    flops = 6 * params * tokens / update_s
    per_step = [6 * params * C.step_tokens(m) / m["timing/update_s"] for m in ms]
    return {"model": model, "processes": nproc, "dtype": ran, "requested_dtype": dtype, "params": params,
            "trained_tokens_per_step": tokens / len(ms), "update_s_per_step": update_s / len(ms),
            "train_flops_per_s": flops, "matmul_peak_flops_per_s": peak, "model_gemm_flops_per_s": mix,
            "matmul_peaks_flops_per_s": peaks, "model_gemm_flops_per_s_by_dtype": mixes,
            "train_flops_fraction_of_peak": flops / peak, "train_flops_fraction_of_model_gemms": flops / mix,
            "per_step_fraction": [f / peak for f in per_step],
            "peak_measurements": peak_rec, "measured_steps": len(ms),
            "timing_s_per_step": {k[7:-2]: sum(m[k] for m in ms) / len(ms) for k in ms[0] if k.startswith("timing/")},
            "config": {**s, "command": f"torchrun --standalone --nproc_per_node {nproc} bench/flops_entry.py "
                       + " ".join(overrides)}}


def dtype_ratios(records: list[dict]) -> list[dict]:
    """bf16 / fp32 of update time, train FLOP/s and matmul peak, per (model, processes) run in both."""
    out = []
    for r in records:
        if r["dtype"] != "bfloat16":
            continue
        f32 = next((x for x in records if (x["model"], x["processes"], x["dtype"]) == (r["model"], r["processes"],
                                                                                         "float32")), None)
        if f32 is None:
            continue
        peaks = {dt: max(x["matmul_peaks_flops_per_s"][dt] for x in (r, f32)) for dt in PEAK_DTYPES}
        out.append({"model": r["model"], "processes": r["processes"],
                    "update_s_bf16_over_fp32": r["update_s_per_step"] / f32["update_s_per_step"],
                    "train_flops_bf16_over_fp32": r["train_flops_per_s"] / f32["train_flops_per_s"],
                    "matmul_peak_bf16_over_fp32": peaks["bfloat16"] / peaks["float32"]})
    return out


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list (default 1,2; --smoke: 1)")
    p.add_argument("--steps", type=int, default=None, help="measured steps after 1 warm-up (default 3; --smoke: 1)")
    p.add_argument("--dtypes", default=None,
                   help="comma list of model.dtype values (auto, float32, bfloat16), one run each, side by side "
                        "(default float32,bfloat16; --smoke: auto); every run measures both peaks")
    p.add_argument("--gemm-tokens", type=int, default=512,
                   help="tokens of the micro-batch whose model GEMM shapes are timed (default 512)")
    args = p.parse_args()
    nprocs = [int(n) for n in (args.nprocs or ("1" if args.smoke else "1,2")).split(",")]
    dtypes = [d.strip() for d in (args.dtypes or ("auto" if args.smoke else "float32,bfloat16")).split(",")
              if d.strip()]
    if not dtypes or set(dtypes) - set(RUN_DTYPES):
        raise SystemExit(f"--dtypes {args.dtypes!r}: choose from {RUN_DTYPES}")
    measured = args.steps or (1 if args.smoke else 3)
    wd = C.work_dir(args, "flops")
    env = {"DISTFLOW_FLOPS_SIZES": "256,512" if args.smoke else "1024,2048,4096",
           "DISTFLOW_FLOPS_REPS": "2" if args.smoke else "5", "DISTFLOW_FLOPS_ROUND": "1e8" if args.smoke else "1e10",
           "DISTFLOW_FLOPS_DTYPES": ",".join(PEAK_DTYPES)}
    records, rows = [], []
    for model in C.models(args):
        s = dict(SETTINGS[model])
        if args.smoke:
            s.update(prompts_per_step=2, group_size=2, max_new_tokens=8)
        path = C.resolve_model(model)
        params = C.count_params(path)
        model_env = {**env, "DISTFLOW_FLOPS_GEMMS": json.dumps(model_gemms(path, args.gemm_tokens))}
        for nproc in nprocs:
            for dtype in dtypes:  # side by side: the dtypes of one layout run one after the other
                rec = measure(model, nproc, dtype, measured, s, params, wd, args, model_env)
                rec["gemm_tokens"] = args.gemm_tokens
                records.append(rec)
                peaks = rec["matmul_peaks_flops_per_s"]
                rows.append([model, nproc, rec["dtype"], rec["trained_tokens_per_step"], rec["update_s_per_step"],
                             rec["train_flops_per_s"] / 1e9, peaks["float32"] / 1e9, peaks["bfloat16"] / 1e9,
                             rec["model_gemm_flops_per_s"] / 1e9, 100 * rec["train_flops_fraction_of_peak"],
                             100 * rec["train_flops_fraction_of_model_gemms"]])
    print(C.table(["model", "procs", "dtype", "tokens/step", "update s", "train GFLOP/s", "fp32 peak", "bf16 peak",
                   "gemm mix", "% peak", "% gemm mix"], rows))
    print("(GFLOP/s; peaks: best matmul shape per dtype; gemm mix: the model's GEMMs in the run's dtype; "
          f"% of the run's dtype; model GEMMs at {args.gemm_tokens} tokens)")
    ratios = dtype_ratios(records)
    if ratios:
        print(C.table(["model", "procs", "update s bf16/fp32", "train FLOP/s bf16/fp32", "peak bf16/fp32"],
                      [[r["model"], r["processes"], r["update_s_bf16_over_fp32"], r["train_flops_bf16_over_fp32"],
                        r["matmul_peak_bf16_over_fp32"]] for r in ratios]))
    # Headline: the largest model measured, 1 process (or the fewest measured), the first of --dtypes;
    # by_dtype: the same (model, processes) in every dtype run, each against its own dtype's peak.
    first = [r for r in records if r["processes"] == min(nprocs) and r["requested_dtype"] == dtypes[0]]
    head = max(first, key=lambda r: r["params"])
    by_dtype = {r["dtype"]: {"train_flops_fraction_of_peak": r["train_flops_fraction_of_peak"],
                             "meets_goal": r["train_flops_fraction_of_peak"] >= GOAL}
                for r in records if (r["model"], r["processes"]) == (head["model"], head["processes"])}
    C.write_json(args.results_dir, "flops", {
        "bench": "flops", "smoke": args.smoke, "machine": {**C.machine(), "cpu_bf16": C.cpu_bf16_support()},
        "goal_fraction": GOAL,
        "train_flops_fraction_of_peak": head["train_flops_fraction_of_peak"],
        "headline": {k: head[k] for k in ("model", "processes", "dtype")},
        "meets_goal": head["train_flops_fraction_of_peak"] >= GOAL, "by_dtype": by_dtype,
        "dtypes": dtypes, "gemm_tokens": args.gemm_tokens, "dtype_ratios": ratios, "records": records})


if __name__ == "__main__":
    main()
