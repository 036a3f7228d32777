"""TRL's GRPOTrainer on CPU, configured like a distflow benchmark run; launched by bench/vs_trl.py as
`torchrun --standalone --nproc_per_node N bench/trl_grpo.py ...` (gloo; `accelerate launch --cpu
--num_processes 2` silently runs one process on this machine).

Same prompts (recipes/data/arith.jsonl with the arith task's system prompt, chat-templated by TRL),
same numeric reward as distflow (--reward gym: reasoning-gym's scorer on rows that carry their
`gym_entry`, as the demo's task writes them), one generation and one optimizer step per training step
(gradient_accumulation_steps=1, so generation_batch_size = global batch), beta = 0 (no reference
model), plain transformers `generate` (use_vllm=False). --bf16 sets GRPOConfig(bf16=True): TRL still
loads the model in fp32 (its default dtype, the master weights) and accelerate runs the model's
forward, in generation and training alike, under torch.autocast("cpu", bfloat16).

Rank 0 writes --out: per-step wall times (slowest rank, like distflow's timing/step_s) and the
running `num_tokens` TRL logs (prompt+completion tokens of all processes); per-step tokens are
differences of it; and TRL's own per-step log (reward, frac_reward_zero_std, grad_norm, ...).
--save-model writes the trained policy as an HF folder (model and tokenizer) for an evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from distflow.tasks.gym import gym_reward as distflow_gym_reward
from distflow.tasks.rewards.numeric import numeric_match
from distflow.train.policy import warmup_schedule


def _texts(completions) -> list[str]:
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def numeric_reward(prompts, completions, answer, **_):
    return [numeric_match(t, str(a)) for t, a in zip(_texts(completions), answer)]


def gym_reward(prompts, completions, item_json, **_):
    return [distflow_gym_reward("", t, [], json.loads(i)) for t, i in zip(_texts(completions), item_json)]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.begin = 0.0
        self.steps: list[dict] = []

    def on_step_begin(self, args, state, control, **kw):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.steps.append({"step": state.global_step, "step_s": time.perf_counter() - self.begin,
                           "num_tokens": float(state.num_input_tokens_seen)})


def precision(trainer) -> dict:
    """What --bf16 did: the weights' dtype and whether accelerate autocasts the forward."""
    acc = trainer.accelerator
    return {"param_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
            "mixed_precision": str(acc.mixed_precision), "autocast": bool(acc.native_amp)}


def main() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--system-prompt", default="")
    p.add_argument("--num-generations", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, required=True, help="global prompts per optimizer step")
    p.add_argument("--max-completion-length", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reward", choices=("numeric", "gym"), default="numeric")
    p.add_argument("--save-model", default="", help="write the trained policy here (HF folder)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights (GRPOConfig bf16=True)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hide-vllm", action="store_true",
                   help="tell TRL vLLM is not installed: it imports vLLM whenever it is, even with use_vllm=False, "
                        "which costs seconds of start-up (vs_trl.py --smoke)")
    p.add_argument("--skip-teardown", action="store_true",
                   help="once written, end without the interpreter's teardown of torch, transformers and TRL "
                        "(about a second; the --smoke runs, whose launch walls nobody compares)")
    a = p.parse_args()
    if a.hide_vllm:
        import trl.import_utils as trl_import_utils

        trl_import_utils.is_vllm_available = lambda *_, **__: False
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    global_batch = a.prompts_per_step * a.num_generations
    assert global_batch % world == 0, "global batch must split over the processes"
    rows = [json.loads(line) for line in open(a.data) if line.strip()]
    system = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
    dataset = Dataset.from_list([{"prompt": system + [{"role": "user", "content": r["prompt"]}],
                                  "answer": str(r["answer"]), "item_json": json.dumps(r)} for r in rows])
    config = GRPOConfig(
        output_dir=a.output_dir, use_cpu=True, bf16=a.bf16, fp16=False, use_vllm=False,
        num_generations=a.num_generations, per_device_train_batch_size=global_batch // world,
        gradient_accumulation_steps=1, beta=0.0, max_completion_length=a.max_completion_length,
        temperature=a.temperature, top_p=1.0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=a.warmup_steps,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps, logging_steps=1, report_to=[],
        save_strategy="no", seed=a.seed, disable_tqdm=True, dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(a.model_path)
    timer = StepTimer()

    class Trainer(GRPOTrainer):  # distflow's warm-up schedule, not HF's
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = warmup_schedule(optimizer or self.optimizer, a.warmup_steps)
            return self.lr_scheduler

    reward = {"numeric": numeric_reward, "gym": gym_reward}[a.reward]
    trainer = Trainer(model=a.model_path, reward_funcs=reward, args=config, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    if a.save_model:
        trainer.save_model(a.save_model)  # rank 0 writes; the others wait for it
        if int(os.environ.get("RANK", "0")) == 0:
            tokenizer.save_pretrained(a.save_model)

    steps = timer.steps
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, steps)
        steps = [dict(s, step_s=max(r[i]["step_s"] for r in everyone)) for i, s in enumerate(steps)]
    if int(os.environ.get("RANK", "0")) == 0:
        prev = 0.0
        for s in steps:
            s["tokens"], prev = s["num_tokens"] - prev, s["num_tokens"]
        with open(a.out, "w") as f:
            json.dump({"world_size": world, "torch_threads": torch.get_num_threads(), **precision(trainer),
                       "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
                       "steps": steps, "log": trainer.state.log_history}, f, indent=1)
    return a


if __name__ == "__main__":
    if main().skip_teardown:
        from distflow.run.exit import exit_process

        exit_process(0)
