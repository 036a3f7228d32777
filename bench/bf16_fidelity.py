"""How far a bf16 update strays from the float32 one: a numerics diagnostic for `model.dtype=bfloat16`.

Part 1, one update's gradient. The demo's kind of batch (the task's prompts, G responses each
sampled from the float32 model, random group-normalized advantages) goes through the policy
loss's backward (`Updater.backward_policy`) four times, each on a fresh policy with the same
weights: float32; float32 at weights rounded to bf16 (what rounding alone changes); bf16 compute
over float32 masters with the float32 logprob head (the default); and with a bf16 head
(`model.logprob_head_float32=false`). Each is compared with float32 by cosine, norm ratio and
sign agreement: AdamW's first step is about lr x sign(g), so sign agreement is what a step moves.

Part 2 (`--runs DIR ...`), what of a finished run's learned update bf16 keeps: the run's exported
float32 weights (`checkpoint.export_at_end=true`, DIR/hf_model) against its starting weights,
before and after rounding both to bf16. "kept" is the bf16 update's projection on the float32 one
(1: all of it), "visible" the share of moved weights whose bf16 value moved at all.

    .venv/bin/python bench/bf16_fidelity.py                           # SmolLM2, 8 prompts x 4
    .venv/bin/python bench/bf16_fidelity.py --models tiny --prompts 4
    .venv/bin/python bench/bf16_fidelity.py --runs outputs/a outputs/b
    .venv/bin/python bench/bf16_fidelity.py --smoke --results-dir /tmp/r
"""

from __future__ import annotations

import json
from pathlib import Path

import common as C

TASK = C.ROOT / "recipes" / "task" / "gym_arith.yaml"  # the demo's task
GRADIENTS = {  # name: (model.dtype, round the float32 weights to bf16 first, model.logprob_head_float32)
    "float32 at bf16-rounded weights": ("float32", True, True),
    "bf16 compute, float32 head": ("bfloat16", False, True),
    "bf16 compute, bf16 head": ("bfloat16", False, False),
}


def sampled_batch(model_path: str, prompts: int, group: int, max_new: int, seed: int):
    """`prompts` x `group` samples drawn from the float32 model (temperature 1) and advantages
    normalized within each group, as GRPO's are."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.config import DistflowConfig
    from distflow.tasks.prompts import load_prompts
    from distflow.sample import Sample

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    task = DistflowConfig.from_dict({"task": yaml.safe_load(TASK.read_text())}).task
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    samples = []
    for item in load_prompts(task, tok, 128)[:prompts]:
        ids = torch.tensor([item.prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, num_return_sequences=group, pad_token_id=pad)
        for row in out[:, ids.shape[1]:].tolist():
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            response = row[:end] or [tok.eos_token_id]
            samples.append(Sample(list(item.prompt_ids), response, [0.0] * len(response), False))
    adv = torch.randn(prompts, group)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).flatten()
    return samples, adv


def gradient(info, model_path: str, batch, group: int, dtype: str, round_weights: bool, head_float32: bool):
    """The policy loss's full gradient over `batch` on one process (`info`), flattened, in float64."""
    import torch

    from distflow.config import DistflowConfig
    from distflow.distributed.devices import resolve_auto
    from distflow.distributed.layout import ParallelLayout
    from distflow.train.policy import Policy
    from distflow.train.update import Updater

    cfg = DistflowConfig()
    cfg.model.dtype, cfg.model.logprob_head_float32 = dtype, head_float32
    cfg.model.shard_ranks = 1
    cfg.algorithm.group_size = group
    cfg.optim.micro_batch_size = len(batch)
    cfg = resolve_auto(cfg, info.device)  # components read concrete values (the trainer's shared-prefix rule)
    policy = Policy(model_path, cfg.model, cfg.optim, ParallelLayout.from_config(cfg.model, info))
    if round_weights:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.copy_(p.bfloat16().float())
    Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in policy.model.parameters()]
    return torch.cat([g.flatten() for g in grads]).double()


def compare(ref, other) -> dict:
    """Cosine, norm ratio, sign agreement (coordinates where both are non-zero) and the cosine of
    the two sign vectors (AdamW's first-step directions)."""
    import torch

    sr, so = torch.sign(ref), torch.sign(other)
    both = (sr != 0) & (so != 0)
    return {"cosine": float(ref @ other / (ref.norm() * other.norm())), "norm_ratio": float(other.norm() / ref.norm()),
            "sign_agreement": float((sr[both] == so[both]).double().mean()),
            "adam_step1_cosine": float((sr * so).sum() / both.sum())}


def kept_update(run_dir: Path) -> dict:
    """What bf16 rounding keeps of a run's learned update (its export against its start)."""
    import torch
    from safetensors.torch import load_file

    start_path = C.resolve_model(json.loads((run_dir / "config.json").read_text())["model"]["path"])
    start = load_file(str(Path(start_path) / "model.safetensors"))
    end = load_file(str(run_dir / "hf_model" / "model.safetensors"))
    dm2 = de2 = dot = 0.0
    moved = visible = big_moved = big_visible = 0
    for name, w0 in start.items():
        if name not in end:
            continue
        w0, w1 = w0.float(), end[name].float()
        dm, de = w1 - w0, w1.bfloat16().float() - w0.bfloat16().float()
        dm2 += float((dm.double() ** 2).sum())
        de2 += float((de.double() ** 2).sum())
        dot += float((dm.double() * de.double()).sum())
        m, big = dm != 0, w0.abs() >= 1 / 16
        moved += int(m.sum())
        visible += int((m & (de != 0)).sum())
        big_moved += int((m & big).sum())
        big_visible += int((m & big & (de != 0)).sum())
    return {"run": str(run_dir), "update_norm": dm2 ** 0.5, "bf16_update_norm": de2 ** 0.5,
            "cosine": dot / max((dm2 * de2) ** 0.5, 1e-30), "kept": dot / max(dm2, 1e-30),
            "visible": visible / max(moved, 1), "visible_large": big_visible / max(big_moved, 1),
            "large_share": big_moved / max(moved, 1)}


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="*", default=[], help="run folders with hf_model/ (checkpoint.export_at_end)")
    a = p.parse_args()
    if a.smoke:
        a.prompts, a.group_size, a.max_new_tokens = 2, 2, 8
    names = C.models(a) if a.models else ["tiny" if a.smoke else "smollm2_135m"]
    if len(names) != 1:
        p.error(f"--models takes one model here, got {names}")
    model = names[0]
    path = C.resolve_model(model)  # puts src/ on the path
    from distflow.distributed import init_distributed, shutdown
    from distflow.train.batch import UpdateBatch

    samples, adv = sampled_batch(path, a.prompts, a.group_size, a.max_new_tokens, a.seed)
    info = init_distributed("gloo", "cpu")  # one process
    batch = UpdateBatch.from_samples(samples, 0, info.device)
    batch = batch.with_(advantages=adv[:, None] * batch.tokens.resp_mask)
    response_tokens = sum(len(s.response_ids) for s in samples)
    ref = gradient(info, path, batch, a.group_size, "float32", False, True)
    grads = {name: compare(ref, gradient(info, path, batch, a.group_size, *spec)) for name, spec in GRADIENTS.items()}
    shutdown()
    print(f"{model}: {len(samples)} samples, {response_tokens} response tokens; each gradient against float32's")
    print(C.table(["gradient", "cosine", "norm ratio", "sign agreement", "AdamW step-1 cosine"],
                  [[n, *(f"{g[k]:.4f}" for k in ("cosine", "norm_ratio", "sign_agreement", "adam_step1_cosine"))]
                   for n, g in grads.items()]))
    runs = [kept_update(Path(r)) for r in a.runs]
    if runs:
        print("\nlearned update (export - start), float32 vs both rounded to bf16")
        print(C.table(["run", "|update|", "|bf16 update|", "cosine", "kept", "visible", "visible |w|>=1/16"],
                      [[r["run"], r["update_norm"], r["bf16_update_norm"], r["cosine"], r["kept"], r["visible"],
                        r["visible_large"]] for r in runs]))
    C.write_json(a.results_dir, "bf16_fidelity", {
        "smoke": a.smoke, "model": model, "machine": C.machine(), "samples": len(samples),
        "response_tokens": response_tokens, "gradients": grads, "runs": runs})


if __name__ == "__main__":
    main()
