"""Rollout engines: vLLM vs transformers `generate` (HF engine) tokens/s at the smoke experiment's batch shape.

The shape is read from recipes/experiment/smoke.yaml (2 prompts x 4 samples per rank, 16 new
tokens; the demo's is 2 x 4 with 48): per rank
data.prompts_per_rank prompts x algorithm.group_size samples, rollout.max_new_tokens new tokens,
on NPROC ranks (the Makefile's default, 2) launched together with torchrun, each with its own
engine, as in training. Both engines live in the same processes and timed rounds alternate
(vllm, hf, vllm, hf, ...) after one warm-up round each (`--smoke`: none); every round draws new
prompts from recipes/data/arith.jsonl. tokens/s = generated tokens of all ranks / slowest rank's time.

    .venv/bin/python bench/engines.py                 # smollm2_135m (tiny if unavailable)
    .venv/bin/python bench/engines.py --models tiny,smollm2_135m --rounds 10
    .venv/bin/python bench/engines.py --smoke --results-dir /tmp/r     # tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def worker(a) -> None:
    import torch
    from transformers import AutoTokenizer

    from distflow.config import DistflowConfig
    from distflow.tasks.prompts import load_prompts
    from distflow.distributed import all_reduce, barrier, init_distributed, shutdown
    from distflow.models.tiny import resolve_model_path
    from distflow.distributed.devices import resolve_auto
    from distflow.rollout import build_engine

    cfg = DistflowConfig()
    cfg.model.path = a.model
    cfg.rollout.max_new_tokens, cfg.rollout.max_prompt_tokens = a.max_new_tokens, a.max_prompt_tokens
    cfg.task.path, cfg.task.system_prompt = a.data, a.system_prompt
    info = init_distributed("gloo", "cpu")
    cfg = resolve_auto(cfg, info.device)  # the trainer's dtype, eager mode and KV cache for the device
    path = resolve_model_path(a.model)
    items = load_prompts(cfg.task, AutoTokenizer.from_pretrained(path), cfg.rollout.max_prompt_tokens)
    cfg.rollout.engine = "vllm"
    engines = {"vllm": build_engine(path, cfg.model, cfg.rollout, info.device, 0)}
    cfg.rollout.engine = "hf"
    engines["hf"] = build_engine(path, cfg.model, cfg.rollout, info.device, 0)
    res = {name: {"s": [], "gen_tokens": [], "all_tokens": []} for name in engines}
    for r in range(a.warmup + a.rounds):  # the first a.warmup rounds are not timed
        start = ((r * info.world_size + info.rank) * a.prompts) % len(items)
        batch = [items[(start + i) % len(items)] for i in range(a.prompts)]
        seeds = [1000 * r + 10 * info.rank + i for i in range(a.prompts)]
        for name in (["vllm", "hf"] if r % 2 == 0 else ["hf", "vllm"]):
            barrier()
            t0 = time.perf_counter()
            groups = engines[name].generate([it.prompt_ids for it in batch], a.group_size, seeds)
            dt = float(all_reduce(time.perf_counter() - t0, "max"))
            gen = sum(len(s.response_ids) for g in groups for s in g)
            allt = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g)
            gen, allt = (int(v) for v in all_reduce([gen, allt]).tolist())
            if r >= a.warmup:
                res[name]["s"].append(dt)
                res[name]["gen_tokens"].append(gen)
                res[name]["all_tokens"].append(allt)
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world_size": info.world_size, "torch_threads": torch.get_num_threads(), "results": res}, f)
    barrier()
    engines["hf"].shutdown()
    engines["vllm"].shutdown()
    shutdown()


def main() -> None:
    import common as C
    from omegaconf import OmegaConf

    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks, each with its own engines (default 2, as make demo; --smoke: 1)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per engine (default 6; --smoke: 1)")
    args = p.parse_args()
    if not args.models and not args.smoke:
        args.models = "smollm2_135m" if C.smollm2_available() else "tiny"
    rounds = args.rounds or (1 if args.smoke else 6)
    args.nproc = args.nproc or (1 if args.smoke else 2)
    smoke = OmegaConf.load(C.ROOT / "recipes" / "experiment" / "smoke.yaml")
    shape = {"prompts_per_rank": int(smoke.data.prompts_per_rank), "group_size": int(smoke.algorithm.group_size),
             "max_new_tokens": int(smoke.rollout.max_new_tokens), "max_prompt_tokens": int(smoke.rollout.max_prompt_tokens),
             "ranks": args.nproc}
    wd = C.work_dir(args, "engines")
    records, rows = [], []
    for model in C.models(args):
        out = wd / f"{model}.json"
        C.fresh(out)
        print(f"[engines] {model} nproc={args.nproc}", flush=True)
        C.torchrun(__file__, ["--worker", "--model", model, "--data", str(C.ARITH), "--system-prompt", C.SYSTEM_PROMPT,
                              "--prompts", str(shape["prompts_per_rank"]), "--group-size", str(shape["group_size"]),
                              "--max-new-tokens", str(shape["max_new_tokens"]),
                              "--max-prompt-tokens", str(shape["max_prompt_tokens"]),
                              "--rounds", str(rounds), "--warmup", "0" if args.smoke else "1", "--out", str(out)],
                   args.nproc, wd / f"{model}.log")
        r = json.loads(out.read_text())["results"]
        rec = {"model": model, "batch_shape": shape, "rounds": rounds}
        for name in ("vllm", "hf"):
            x = r[name]
            rec[f"{name}_tokens_per_s"] = sum(x["gen_tokens"]) / sum(x["s"])
            rec[f"{name}_total_tokens_per_s"] = sum(x["all_tokens"]) / sum(x["s"])
            rec[f"{name}_round_s_median"] = statistics.median(x["s"])
            rec[f"{name}_raw"] = x
        per_round = [(gv / sv) / (gh / sh) for gv, sv, gh, sh in
                     zip(r["vllm"]["gen_tokens"], r["vllm"]["s"], r["hf"]["gen_tokens"], r["hf"]["s"])]
        rec.update(ratio=rec["vllm_tokens_per_s"] / rec["hf_tokens_per_s"], ratio_median=statistics.median(per_round),
                   ratio_min=min(per_round), ratio_max=max(per_round))
        records.append(rec)
        rows.append([model, f"{args.nproc}x{shape['prompts_per_rank']}x{shape['group_size']}", shape["max_new_tokens"],
                     rec["vllm_round_s_median"], rec["hf_round_s_median"], rec["vllm_tokens_per_s"],
                     rec["hf_tokens_per_s"], rec["ratio_median"]])
    print(C.table(["model", "ranks x prompts x G", "new tok", "vllm s", "hf s", "vllm tok/s", "hf tok/s",
                   "vllm/hf"], rows))
    C.write_json(args.results_dir, "engines", {"bench": "engines", "smoke": args.smoke, "machine": C.machine(),
                                               "records": records})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        for flag in ("--model", "--data", "--out"):
            ap.add_argument(flag, required=True)
        ap.add_argument("--system-prompt", default=None)
        ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per engine first")
        for flag in ("--prompts", "--group-size", "--max-new-tokens", "--max-prompt-tokens", "--rounds"):
            ap.add_argument(flag, type=int, required=True)
        ap.add_argument("--worker", action="store_true")
        worker(ap.parse_args())
        from distflow.run.exit import exit_process

        exit_process(0)  # the measured ranks are done: skip the interpreter's teardown of torch and vLLM
    else:
        main()
