"""The demo over seeds, distflow beside TRL's GRPOTrainer: held-out greedy pass@1 before and after
training, per seed, both evaluated by distflow.

    .venv/bin/python bench/demo_seeds.py [--frameworks distflow,trl] [--seeds 0-15] [--temperature T]

One source of truth for the settings: the base model is evaluated first by `recipes/grpo.py
experiment=demo run.steps=0` (the demo's "before"), and that run's resolved config.json gives both
frameworks their model, task, group size, prompts per step, response budget, learning rate,
warm-up, temperature and dtype. Per seed:

- distflow: `recipes/grpo.py experiment=demo run.seed=N` (plus --temperature when given);
- TRL: bench/trl_grpo.py on the demo task's training rows (its own chat template, reasoning-gym's
  scorer, beta = 0, one optimizer step per generation, distflow's warm-up, bf16 autocast when the
  demo resolves to bf16), the policy saved and then evaluated by `experiment=demo
  model.path=<saved> run.steps=0`: the same held-out items, engine and greedy decoding.

A seed "collapses" when it ends below the base model. "Signal steps" are optimizer steps whose
gradient was not zero: distflow's `grad_norm` > 0, TRL's `frac_reward_zero_std` < 1 (a batch where
every group's rewards are equal has no gradient at beta = 0). Each run is one after another, alone
on the machine; they take minutes each (--smoke: the tiny model, 2 steps, seed 0).
"""

from __future__ import annotations

import json
import statistics
import threading
from pathlib import Path

import common as C


def seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def demo_overrides(args, out: Path, extra: list[str]) -> list[str]:
    smoke = ["model=tiny", "rollout=hf", "run.steps=2", "task.heldout_size=8", "rollout.max_new_tokens=8",
             "run.sync_probe_seqs=0"] if args.smoke else []
    temp = [f"rollout.temperature={args.temperature}"] if args.temperature is not None else []
    return ["experiment=demo", *smoke, *temp, f"run.output_dir={out}", "validation.save_samples=true",
            "logging.plot_at_end=false", "logging.progress_bar=false", *extra]


def evaluate(args, wd: Path, tag: str, extra: list[str]) -> tuple[dict, dict]:
    """`experiment=demo run.steps=0` with `extra`: (summary.json, config.json) of that run."""
    out = wd / tag
    C.fresh(out)
    C.torchrun(C.GRPO, demo_overrides(args, out, ["run.steps=0", "validation.at_end=false", *extra]), 2,
               wd / f"{tag}.log")
    return json.loads((out / "summary.json").read_text()), json.loads((out / "config.json").read_text())


def demo_steps(args) -> int:
    """run.steps of the demo (the base evaluation's config.json says 0): recipes/experiment/demo.yaml's."""
    import yaml

    return 2 if args.smoke else int(yaml.safe_load((C.ROOT / "recipes/experiment/demo.yaml").read_text())["run"]["steps"])


def run_distflow(args, wd: Path, seed: int, cfg: dict) -> dict:
    out = wd / f"distflow-s{seed}"
    C.fresh(out)
    overrides = demo_overrides(args, out, [f"run.seed={seed}", *args.set])
    wall = C.torchrun(C.GRPO, overrides, 2, wd / f"distflow-s{seed}.log")
    summary, ms = json.loads((out / "summary.json").read_text()), C.read_metrics(out)
    assert len(ms) == cfg["train_steps"], f"{out}: {len(ms)} steps, TRL runs {cfg['train_steps']}"
    return {"after": summary["heldout_pass1_after"], "before": summary["heldout_pass1_before"],
            "signal_steps": sum(m["grad_norm"] > 0 for m in ms),
            "reward_mean": statistics.fmean(m["reward/mean"] for m in ms), "wall_s": wall,
            "command": "torchrun --standalone --nproc_per_node 2 recipes/grpo.py " + " ".join(overrides)}


def trl_args(cfg: dict, rows: Path, seed: int, model_out: Path, out: Path, work: Path) -> list[str]:
    a, r, o = cfg["algorithm"], cfg["rollout"], cfg["optim"]
    world = 2
    return ["--model-path", C.resolve_model(cfg["model"]["path"]), "--data", str(rows), "--reward", "gym",
            *(["--system-prompt", cfg["task"]["system_prompt"]] if cfg["task"]["system_prompt"] else []),
            "--num-generations", str(a["group_size"]),
            "--prompts-per-step", str(cfg["data"]["prompts_per_rank"] * world),
            "--max-completion-length", str(r["max_new_tokens"]), "--temperature", str(r["temperature"]),
            "--lr", str(o["lr"]), "--warmup-steps", str(o["warmup_steps"]), "--steps", str(cfg["train_steps"]),
            "--seed", str(seed), *(["--bf16"] if cfg["model"]["dtype"] == "bfloat16" else []),
            "--save-model", str(model_out), "--output-dir", str(work), "--out", str(out)]


def run_trl(args, wd: Path, seed: int, cfg: dict, rows: Path) -> dict:
    tag = f"trl-s{seed}"
    C.fresh(wd / tag)
    targs = trl_args(cfg, rows, seed, wd / tag / "model", wd / tag / "trl.json", wd / tag / "trainer")
    if args.smoke:
        targs += ["--hide-vllm", "--skip-teardown"]
    wall = C.torchrun(C.BENCH / "trl_grpo.py", targs, 2, wd / f"{tag}.log")
    rec = json.loads((wd / tag / "trl.json").read_text())
    steps = [e for e in rec["log"] if "frac_reward_zero_std" in e]
    summary, _ = evaluate(args, wd / tag, "eval", [f"model.path={wd / tag / 'model'}"])
    return {"after": summary["heldout_pass1_before"],
            "signal_steps": sum(e["frac_reward_zero_std"] < 1 for e in steps),
            "reward_mean": statistics.fmean(e["reward"] for e in steps), "wall_s": wall,
            "command": "torchrun --standalone --nproc_per_node 2 bench/trl_grpo.py " + " ".join(targs)}


def import_rows_generator() -> None:
    """reasoning-gym and distflow's loader of its rows, which training_rows imports (seconds)."""
    import reasoning_gym  # noqa: F401

    from distflow.tasks.gym import gym_rows  # noqa: F401


def training_rows(cfg: dict, path: Path) -> Path:
    """The demo task's training split, as distflow's loader builds it, one JSON row per line."""
    from distflow.config.task import TaskConfig
    from distflow.tasks.gym import gym_rows

    path.write_text("".join(json.dumps(r) + "\n" for r in gym_rows(TaskConfig(**cfg["task"]), "train")))
    return path


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="distflow,trl")
    p.add_argument("--seeds", default=None, help="e.g. 0-15 or 0,3,7 (default 0-15; --smoke: 0)")
    p.add_argument("--temperature", type=float, default=None, help="default: the demo's")
    p.add_argument("--set", nargs="*", default=[], help="more recipe overrides for distflow's training runs "
                   "(e.g. optim.skip_zero_gradient=false, which TRL does not have)")
    args = p.parse_args()
    frameworks = args.frameworks.split(",")
    wd = C.work_dir(args, "demo_seeds")
    if "trl" in frameworks:  # imported while the base model is evaluated, not after
        threading.Thread(target=import_rows_generator, daemon=True).start()
    base, cfg = evaluate(args, wd, "base", [])
    cfg["train_steps"] = demo_steps(args)
    before = base["heldout_pass1_before"]
    rows = training_rows(cfg, wd / "train.jsonl") if "trl" in frameworks else None
    results: dict[str, dict[int, dict]] = {f: {} for f in frameworks}
    for seed in seeds(args.seeds or ("0" if args.smoke else "0-15")):
        for f in frameworks:
            r = run_distflow(args, wd, seed, cfg) if f == "distflow" else run_trl(args, wd, seed, cfg, rows)
            results[f][seed] = r
            print(f"seed {seed} {f}: {before:.3f} -> {r['after']:.3f}, {r['signal_steps']} signal steps, "
                  f"reward {r['reward_mean']:.3f}, {r['wall_s']:.0f} s", flush=True)
    table = []
    for f, per_seed in results.items():
        after = [r["after"] for r in per_seed.values()]
        table.append([f, f"{statistics.fmean(after):.3f}", f"{min(after):.3f}",
                      f"{sum(x < before for x in after)}/{len(after)}",
                      f"{min(r['signal_steps'] for r in per_seed.values())}-"
                      f"{max(r['signal_steps'] for r in per_seed.values())}"])
    print(f"held-out pass@1 before training: {before:.3f} ({base['heldout_items']} items)")
    print(C.table(["framework", "mean after", "min after", "ended below base", "signal steps"], table))
    C.write_json(args.results_dir, "demo_seeds", {
        "machine": C.machine(), "before": before, "heldout_items": base["heldout_items"],
        "temperature": cfg["rollout"]["temperature"], "dtype": cfg["model"]["dtype"], "steps": cfg["train_steps"],
        "results": results})


if __name__ == "__main__":
    main()
