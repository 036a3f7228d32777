"""On-policy distillation on the demo: a student learns from a teacher that is a trained copy of
itself, and its held-out greedy pass@1 moves toward the teacher's.

    .venv/bin/python bench/distill.py [--seed 1] [--teacher-seed 0] [--reward-weight 0]

1. The teacher: `recipes/grpo.py experiment=demo run.seed=<teacher-seed>
   checkpoint.export_at_end=true`, the demo's GRPO run, exported as an HF folder. Its summary
   gives the base model's held-out pass@1 (before) and the teacher's (after).
2. The student: `experiment=demo algorithm=distill teacher.path=<that folder> run.seed=<seed>`,
   the same steps, prompts and settings, learning only from the teacher's per-token logprobs
   (algorithm.distill_reward_weight, default 0: the reward is scored and logged, not trained on).
3. For scale, GRPO at the student's seed (skipped when it is the teacher's seed: that run is the
   teacher itself).

Prints base, teacher, GRPO and the distilled student with the student's reverse KL at its first
and last step, and writes bench/results/distill.json. Each run is one after another, alone on the
machine; they take minutes each (--smoke: the tiny model, 2 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import common as C


def overrides(args, out: Path, extra: list[str]) -> list[str]:
    smoke = ["model=tiny", "rollout=hf", "run.steps=2", "task.heldout_size=8", "rollout.max_new_tokens=8",
             "run.sync_probe_seqs=0"] if args.smoke else []
    return ["experiment=demo", *smoke, f"run.output_dir={out}", "logging.plot_at_end=false",
            "logging.progress_bar=false", *extra]


def launch(args, wd: Path, tag: str, extra: list[str]) -> dict:
    out = wd / tag
    C.fresh(out)
    cmd = overrides(args, out, extra)
    wall = C.torchrun(C.GRPO, cmd, 2, wd / f"{tag}.log")
    summary, ms = json.loads((out / "summary.json").read_text()), C.read_metrics(out)
    return {"before": summary["heldout_pass1_before"], "after": summary["heldout_pass1_after"],
            "reward_mean": [m["reward/mean"] for m in ms],
            "reverse_kl": [m["distill/reverse_kl_mean"] for m in ms if "distill/reverse_kl_mean" in m],
            "teacher_s": [m["timing/teacher_s"] for m in ms if "timing/teacher_s" in m],
            "step_s": [m["timing/step_s"] for m in ms], "wall_s": wall,
            "command": "torchrun --standalone --nproc_per_node 2 recipes/grpo.py " + " ".join(cmd)}


def main() -> None:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1, help="the student's run.seed")
    p.add_argument("--teacher-seed", type=int, default=0, help="the teacher's GRPO run.seed")
    p.add_argument("--reward-weight", type=float, default=0.0, help="algorithm.distill_reward_weight")
    args = p.parse_args()
    wd = C.work_dir(args, "distill")
    teacher = launch(args, wd, "teacher", [f"run.seed={args.teacher_seed}", "checkpoint.export_at_end=true"])
    folder = wd / "teacher" / "hf_model"
    student = launch(args, wd, "student", ["algorithm=distill", f"teacher.path={folder}", f"run.seed={args.seed}",
                                           f"algorithm.distill_reward_weight={args.reward_weight}"])
    grpo = launch(args, wd, "grpo", [f"run.seed={args.seed}"]) if args.seed != args.teacher_seed else teacher
    rows = [["base model", f"{teacher['before']:.3f}", "", ""],
            [f"teacher (GRPO, seed {args.teacher_seed})", f"{teacher['after']:.3f}", "", ""],
            [f"GRPO, seed {args.seed}", f"{grpo['after']:.3f}", "", ""],
            [f"distilled student, seed {args.seed}", f"{student['after']:.3f}", f"{student['reverse_kl'][0]:.4f}",
             f"{student['reverse_kl'][-1]:.4f}"]]
    print(f"held-out greedy pass@1 after {len(student['reward_mean'])} steps")
    print(C.table(["model", "held-out pass@1", "reverse KL step 1", "reverse KL last step"], rows))
    C.write_json(args.results_dir, "distill", {
        "machine": C.machine(), "seed": args.seed, "teacher_seed": args.teacher_seed,
        "reward_weight": args.reward_weight, "base": teacher["before"], "teacher": teacher, "student": student,
        "grpo": grpo})


if __name__ == "__main__":
    main()
