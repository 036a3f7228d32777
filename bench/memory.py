"""Peak memory per rank and per phase (start-up, generate, logprob, update, sync, probe, validate)
of a real training run, for several override sets run side by side in one invocation.

Each run is `torchrun --standalone --nproc_per_node N bench/memory_entry.py experiment=E model=M
<variant overrides>`: the unmodified recipe with bench/memory_hooks.py measuring every rank (CPU:
the kernel's RSS high-water mark, reset at each phase boundary; CUDA: peak allocated). A variant
is a name and a list of Hydra overrides (`env:NAME=VALUE` sets an environment variable instead).
A variant naming a config key this checkout does not have is skipped with a note, so the default
list also covers levers that exist only in some checkouts; a variant whose run fails (e.g. a
ConfigError) is recorded with its error line and the others go on.

    .venv/bin/python bench/memory.py                               # SmolLM2 demo, 1 and 2 ranks, every lever
    .venv/bin/python bench/memory.py --nprocs 2 --variants default,off
    .venv/bin/python bench/memory.py --variant arena2=env:MALLOC_ARENA_MAX=2 --variant kv2=rollout.kv_cache_gib=2
    .venv/bin/python bench/memory.py --smoke --results-dir /tmp/r   # tiny model, smoke experiment, 2 ranks
"""

from __future__ import annotations

import dataclasses
import json
import typing

import common as C

GOAL_GB = 3.5  # peak RSS per rank on the demo (CPU)
GIB = 2**30
PHASES = ("startup", "generate", "logprob", "update", "sync", "probe", "validate", "other")
LEVERS_OFF = ["model.meta_device_init=false", "model.activation_checkpointing=false", "model.logprob_chunk_tokens=0"]
# name -> overrides. Every lever alone against all of them off (today's path), all on, the shipped
# defaults, and two-way tensor-parallel engine groups (only where the world size allows).
VARIANTS = {
    "default": [],
    "off": LEVERS_OFF,
    "meta": [o.replace("init=false", "init=true") for o in LEVERS_OFF],
    "ckpt": [o.replace("checkpointing=false", "checkpointing=true") for o in LEVERS_OFF],
    "chunk": [o.replace("chunk_tokens=0", "chunk_tokens=512") for o in LEVERS_OFF],
    "all": ["model.meta_device_init=true", "model.activation_checkpointing=true", "model.logprob_chunk_tokens=512"],
    "tp2": ["rollout.tensor_parallel_size=2"],
}
SMOKE_VARIANTS = ("default",)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name=o1 o2 ...' -> (name, [o1, o2, ...]); 'name' or 'name=' -> (name, [])."""
    name, _, rest = text.partition("=")
    if not name.strip():
        raise SystemExit(f"--variant {text!r}: expected NAME=OVERRIDES")
    return name.strip(), rest.split()


def unknown_keys(overrides: list[str]) -> list[str]:
    """Keys in `overrides` that distflow.config.DistflowConfig does not have (config group choices
    such as model=... and env: settings are always known)."""
    from distflow.config import DistflowConfig

    groups = {p.name for p in (C.ROOT / "recipes").iterdir() if p.is_dir()}
    bad = []
    for o in overrides:
        if o.startswith("env:"):
            continue
        key = o.lstrip("+~").split("=", 1)[0]
        node: typing.Any = DistflowConfig
        for part in key.split("."):
            if not dataclasses.is_dataclass(node):
                break  # a dict-typed field: any key goes
            hints = typing.get_type_hints(node)
            if part not in hints:
                if not (key in groups and "." not in key):
                    bad.append(key)
                break
            node = hints[part]
    return bad


def fits(overrides: list[str], nproc: int) -> str | None:
    """Why a variant cannot run at this world size (None when it can)."""
    for o in overrides:
        if o.split("=", 1)[0] == "rollout.tensor_parallel_size":
            k = int(o.split("=", 1)[1])
            if nproc % k:
                return f"rollout.tensor_parallel_size={k} does not divide {nproc} rank(s)"
    return None


def split_env(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    env = dict(o[4:].split("=", 1) for o in overrides if o.startswith("env:"))
    return [o for o in overrides if not o.startswith("env:")], env


def phase_peaks(rank: dict, key: str = "peak_rss") -> dict[str, int]:
    """Peak per phase, `phase:part` labels folded into their phase (imports into other)."""
    out: dict[str, int] = {}
    for label, v in rank[key].items():
        phase = label.split(":")[0]
        phase = "other" if phase == "imports" else phase
        out[phase] = max(out.get(phase, 0), v)
    return out


def summarize(ranks: list[dict]) -> dict:
    """Max over ranks of each phase's peak, in GiB, and rank 0's split of RSS after start-up."""
    per_phase = {}
    for phase in PHASES:
        vals = [phase_peaks(r).get(phase, 0) for r in ranks]
        if any(vals):
            per_phase[phase] = max(vals) / GIB
    rec = {"peak_rss_gib": per_phase, "peak_rss_gib_max": max(per_phase.values()),
           "peak_rss_gib_per_rank": [max(r["peak_rss"].values()) / GIB for r in ranks],
           "method": ranks[0]["method"], "children_rss_gib": max(r["children_rss"] for r in ranks) / GIB}
    if any(r["peak_cuda_allocated"] for r in ranks):
        rec["peak_cuda_allocated_gib"] = {p: max(phase_peaks(r, "peak_cuda_allocated").get(p, 0) for r in ranks) / GIB
                                          for p in PHASES if any(phase_peaks(r, "peak_cuda_allocated").get(p) for r in ranks)}
    r0 = ranks[0]["end_of_phase"]
    rec["rank0_after"] = {label: {k: v / GIB for k, v in split.items()} for label, split in r0.items()}
    return rec


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nprocs", default=None, help="comma list of world sizes (default 1,2; --smoke: 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 3; --smoke: 2)")
    p.add_argument("--experiment", default=None, help="recipes/experiment (default demo; --smoke: smoke)")
    p.add_argument("--variants", default=None,
                   help=f"comma list from {', '.join(VARIANTS)} (default all of them; --smoke: default)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="an extra variant: a name and space-separated overrides (env:NAME=VALUE for the environment)")
    p.add_argument("--overrides", default="", help="space-separated overrides for every run (e.g. "
                   "'validation.before_train=false validation.at_end=false')")
    args = p.parse_args()
    nprocs = [int(n) for n in (args.nprocs or ("2" if args.smoke else "1,2")).split(",")]
    steps = args.steps or (2 if args.smoke else 3)
    experiment = args.experiment or ("smoke" if args.smoke else "demo")
    model_names = C.models(args) if args.models or args.smoke else ["smollm2_135m"]
    names = args.variants.split(",") if args.variants else [] if args.variant else \
        list(SMOKE_VARIANTS if args.smoke else VARIANTS)  # --variant alone: only the variants given
    variants = {n: VARIANTS[n] for n in names if n in VARIANTS}
    if len(variants) != len(names):
        raise SystemExit(f"unknown variant(s) {sorted(set(names) - set(VARIANTS))}; choose from {list(VARIANTS)}")
    variants.update(parse_variant(v) for v in args.variant)
    skipped = {n: f"unknown config key(s) {bad}" for n, o in variants.items() if (bad := unknown_keys(o))}
    for n, why in skipped.items():
        print(f"[memory] skipping variant {n}: {why}", flush=True)
    wd = C.work_dir(args, "memory")
    records, rows = [], []
    for model in model_names:
        for nproc in nprocs:
            for name, overrides in variants.items():
                if name in skipped:
                    continue
                tag = f"{model}-n{nproc}-{name}"
                rec = {"model": model, "processes": nproc, "variant": name, "overrides": overrides}
                if why := fits(overrides, nproc):
                    print(f"[memory] {tag}: not run ({why})", flush=True)
                    continue
                out, run_dir = wd / tag, wd / f"run-{tag}"
                C.fresh(out, run_dir)
                hydra, env = split_env(overrides)
                cmd = [f"experiment={experiment}", f"model={model}", f"rollout={C.engine(args)}", f"run.steps={steps}",
                       f"run.output_dir={run_dir}", "checkpoint.resume=never", "logging.plot_at_end=false",
                       "logging.progress_bar=false", *args.overrides.split(), *hydra]
                print(f"[memory] {tag}: {' '.join(overrides) or '(no overrides)'}", flush=True)
                rec["loadavg_1m_before"] = C.loadavg()
                try:
                    rec["wall_s"] = C.torchrun(C.BENCH / "memory_entry.py", cmd, nproc, wd / f"{tag}.log",
                                               extra_env={"DISTFLOW_MEM_OUT": str(out), **env})
                except RuntimeError as e:
                    lines = [ln for ln in str(e).splitlines() if "distflow: error" in ln or "Error" in ln]
                    rec["error"] = (lines or str(e).splitlines()[:1])[-1].strip()
                    print(f"[memory] {tag} failed: {rec['error']}", flush=True)
                    records.append(rec)
                    continue
                ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
                rec.update(summarize(ranks), command=cmd, env=env, per_rank=ranks)
                rec["meets_goal"] = rec["peak_rss_gib_max"] * GIB / 1e9 <= GOAL_GB
                records.append(rec)
                pk = rec["peak_rss_gib"]
                rows.append([model, nproc, name, *(pk.get(ph, float("nan")) for ph in PHASES[:-1]),
                             rec["peak_rss_gib_max"], rec["rank0_after"].get("startup", {}).get("anon", float("nan"))])
    print(C.table(["model", "procs", "variant", *PHASES[:-1], "peak GiB", "anon@start"], rows))
    C.write_json(args.results_dir, "memory", {
        "bench": "memory", "smoke": args.smoke, "machine": C.machine(), "experiment": experiment, "steps": steps,
        "goal_peak_rss_gb": GOAL_GB,
        "common_overrides": args.overrides.split(), "units": "GiB (2^30 bytes) unless named _gb",
        "variants": variants, "skipped": skipped,
        # records of (model, processes, variant) not measured again stay, so runs can add to each other
        "records": C.merge_records(C.previous_records(args.results_dir, "memory", args.smoke), records,
                                   keys=("model", "processes", "variant"))})


if __name__ == "__main__":
    main()
