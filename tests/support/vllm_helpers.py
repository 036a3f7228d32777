"""Prompt logprobs from a real vLLM engine (in a fresh process) vs transformers, for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams, TokensPrompt
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    result = [[d[t].logprob for t, d in zip(ids[1:], o.prompt_logprobs[1:])] for ids, o in zip(prompts, outs)]
    print("RESULT " + json.dumps(result))
""")


def vllm_prompt_logprobs(model_dir: str, prompts: list[list[int]], tmp_path) -> list[list[float]]:
    """logp(ids[t] | ids[:t]) for t >= 1 of each prompt, computed by vLLM on CPU."""
    script = tmp_path / "vllm_logprobs.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), model_dir, json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def max_diff_to_transformers(model, prompts: list[list[int]], got: list[list[float]]) -> float:
    """Max |vLLM - transformers| prompt logprob over all prompts.

    The engine must have answered every prompt with one logprob per token after the first:
    a missing, short or empty result is a failure, never a vacuous match."""
    assert len(got) == len(prompts), f"{len(got)} results for {len(prompts)} prompts"
    worst, compared = 0.0, 0
    for ids, lp in zip(prompts, got, strict=True):
        assert len(lp) == len(ids) - 1, (len(lp), len(ids))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        diff = (torch.tensor(lp, dtype=torch.float32) - want).abs()
        assert diff.shape == want.shape and bool(torch.isfinite(diff).all()), (lp, want)
        if diff.numel():
            worst = max(worst, diff.max().item())
        compared += diff.numel()
    assert compared > 0, "no logprob was compared"
    return worst
