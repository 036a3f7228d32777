"""Per-layer comparison of the vLLM engine and the transformers policy on the same tokens.

What it does
------------
1. Builds a few realistic sequences with the model's own tokenizer (a chat-templated arithmetic
   prompt followed by a worked answer; `--seqs` of them, 1 to 4: 96, 222, 87 and 130 tokens with
   SmolLM2's tokenizer, which prepends its default system prompt).
2. Starts the real rollout engine (`distflow.rollout.vllm_engine.VLLMEngine`: in-process,
   external_launcher on a 1-process gloo group, fp32, enforce_eager), registers forward hooks on
   its model (embedding, every decoder layer's input norm, qkv projection, rotary output,
   attention output (before o_proj), o_proj, post-attention norm, MLP, the residual stream after
   the layer, the final norm, the logits) and runs `prompt_logprobs` one sequence at a time.
3. Runs transformers on the same tokens, float32, with the same hooks: a plain unpadded forward
   (`--hf-attn` sdpa|eager) and, unless `--no-policy`, the policy's own path
   (`distflow.train.policy.Policy.logprobs`: left padding, explicit position_ids, logits_to_keep; FSDP2
   on the same 1-process group), and a float64 eager forward as ground truth (`--no-fp64` skips).
4. Prints, for every hook point: max |vLLM - HF fp32|, the same relative to max |HF|, and, with the
   fp64 reference, each side's own error (|vLLM - fp64|, |HF fp32 - fp64|), so a divergence can be
   attributed to one side. Then the end-to-end prompt-logprob differences (max, mean, per-sequence
   max): engine vs plain HF, engine vs policy path, plain HF vs policy path, each vs fp64.
5. Optionally: `--local` re-runs every vLLM op (norms, qkv/o/gate_up/down GEMMs, rotary, attention,
   LM head, log-softmax) in torch fp32 and fp64 on the very input vLLM saw, giving each kernel's own
   error; `--noise-floor` shows how far HF's own fp32 logprobs move under rounding-only changes
   (half-ulp noise on the embeddings; 1 vs N threads), i.e. how close two correct fp32
   implementations can be expected to agree.

Usage (CPU, one or two minutes for SmolLM2-135M):

    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python bench/probe_layers.py --model smollm2_135m --seqs 2
    ... --model tiny --seqs 3 --hf-attn eager --summary

Environment variables meant for vLLM (e.g. VLLM_CPU_* ones) are read when the engine starts, so
set them on the command line. `--no-onednn` makes vLLM's CPU linear dispatch fall back from its
prepacked oneDNN kernels to torch.nn.functional.linear (by clearing vllm._custom_ops._supports_onednn
before loading: an experiment, not a vLLM switch); `--ref-attn` replaces vLLM's CPU attention
kernel with a float32 causal torch SDPA of the same q/k/v.

Findings on SmolLM2-135M (fp32, 2 sequences): engine vs policy max 6.5e-5; every op agrees to a few
fp32 ulps (relative 1e-7..1.3e-6); each side is ~4e-5 from fp64; HF moves by ~3e-5 under half-ulp
embedding noise or a thread-count change. The difference is the fp32 noise floor, not one op.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import defaultdict

import torch

_SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker later replaces it with a no-op

QUESTIONS = [
    ("What is 12 + 7? Give only the final number after 'The answer is'.",
     "To add 12 and 7, add the ones first: 2 + 7 = 9. The tens stay at 1, so the sum is 19. "
     "The answer is 19."),
    ("A box has 48 apples. Tom takes 15 apples and then buys 23 more. How many apples are in the "
     "box now? Give the final number after 'The answer is'.",
     "Let's think step by step. The box starts with 48 apples. Tom takes 15 apples, so 48 - 15 = 33 "
     "apples remain. Then he buys 23 more and puts them in the box: 33 + 23 = 56. To check, the "
     "total change is -15 + 23 = 8, and 48 + 8 = 56, which matches. So after both steps the box holds "
     "56 apples. The question asks for the number of apples in the box now, which is the total after "
     "taking and adding. Each step used whole apples, so no rounding is needed. The answer is 56."),
    ("Compute 7 * 8 - 9. Give the final number after 'The answer is'.",
     "First multiply: 7 * 8 = 56. Then subtract 9: 56 - 9 = 47. The answer is 47."),
    ("What is 125 divided by 5, plus 3 times 4?",
     "Division first: 125 / 5 = 25. Multiplication next: 3 * 4 = 12. Finally add them: 25 + 12 = 37. "
     "We can verify: 37 - 12 = 25 and 25 * 5 = 125. The answer is 37."),
]


def make_sequences(tok, n: int) -> list[list[int]]:
    seqs = []
    for q, a in QUESTIONS[:n]:
        chat = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)
        ids = list(chat["input_ids"]) + tok(a, add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        seqs.append(ids)
    return seqs


def init_single_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _layers(model):
    return model.model.layers


class Recorder:
    """Forward hooks writing detached float copies of module outputs into `self.calls[name]`."""

    def __init__(self):
        self.calls: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.handles = []

    def clear(self):
        self.calls.clear()

    def put(self, name, t):
        self.calls[name].append(t.detach().clone())

    def out(self, module, name, fn=_first):
        self.handles.append(module.register_forward_hook(lambda m, a, o: self.put(name, fn(o))))

    def inp(self, module, name, idx=0):
        self.handles.append(module.register_forward_pre_hook(lambda m, a: self.put(name, a[idx])))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def hook_vllm(model, rec: Recorder) -> None:
    """vLLM Llama/Qwen2: tensors are [tokens, features]; the decoder layer returns (h, residual)
    with the residual add deferred into the next norm, so the stream is h + residual."""
    inner = model.model
    rec.out(inner.embed_tokens, "embed")
    for i, layer in enumerate(_layers(model)):
        p = f"L{i:02d}."
        rec.out(layer.input_layernorm, p + "1.in_norm")
        rec.out(layer.self_attn.qkv_proj, p + "2.qkv")
        # (rotary_emb is one module shared by all layers: read its result at the attention input)
        rec.inp(layer.self_attn.attn, p + "3.q_rope", 0)
        rec.inp(layer.self_attn.attn, p + "3.k_rope", 1)
        rec.inp(layer.self_attn.o_proj, p + "4.attn")
        rec.out(layer.self_attn, p + "5.o_proj")
        rec.out(layer.post_attention_layernorm, p + "6.post_norm")
        rec.out(layer.mlp, p + "7.mlp")
        rec.out(layer, p + "8.stream", lambda o: o[0] + o[1])
    rec.out(inner.norm, "final_norm")
    rec.out(model.logits_processor, "logits")


def _hf_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def hook_hf(model, rec: Recorder) -> None:
    """transformers Llama/Qwen2: tensors are [batch, seq, features]. q/k/v are separate projections
    (concatenated here to match vLLM's fused qkv); the rotary outputs are recomputed from the
    captured q/k projections and the model's own cos/sin (HF applies rope inside forward)."""
    inner = model.model
    rec.out(inner.embed_tokens, "embed")
    rec.out(inner.rotary_emb, "_cos", lambda o: o[0])
    rec.out(inner.rotary_emb, "_sin", lambda o: o[1])
    for i, layer in enumerate(_layers(model)):
        p = f"L{i:02d}."
        a = layer.self_attn
        rec.out(layer.input_layernorm, p + "1.in_norm")
        rec.out(a.q_proj, p + "_q")
        rec.out(a.k_proj, p + "_k")
        rec.out(a.v_proj, p + "_v")
        rec.inp(a.o_proj, p + "4.attn")
        rec.out(a, p + "5.o_proj")
        rec.out(layer.post_attention_layernorm, p + "6.post_norm")
        rec.out(layer.mlp, p + "7.mlp")
        rec.out(layer, p + "8.stream")
    rec.out(inner.norm, "final_norm")
    rec.out(model.lm_head, "logits")


def finish_hf(model, calls: dict, row: int, n: int) -> dict[str, torch.Tensor]:
    """One forward's captures -> {name: [n, features]} for batch row `row`, last n positions."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for name, ts in calls.items():
        t = ts[-1]
        if t.dim() == 3:
            t = t[row, -n:]
        out[name] = t
    for i in range(cfg.num_hidden_layers):
        p = f"L{i:02d}."
        q, k, v = out.pop(p + "_q"), out.pop(p + "_k"), out.pop(p + "_v")
        out[p + "2.qkv"] = torch.cat([q, k, v], -1)
        cos, sin = out["_cos"], out["_sin"]
        qh = q.view(n, -1, hd).transpose(0, 1)[None]
        kh = k.view(n, -1, hd).transpose(0, 1)[None]
        qr, kr = _hf_rope(qh, kh, cos[None], sin[None])
        out[p + "3.q_rope"] = qr[0].transpose(0, 1).reshape(n, -1)
        out[p + "3.k_rope"] = kr[0].transpose(0, 1).reshape(n, -1)
    out.pop("_cos"), out.pop("_sin")
    return out


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    lp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def hf_plain(model, seqs, rec: Recorder | None):
    caps, lps = [], []
    for ids in seqs:
        if rec:
            rec.clear()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        lps.append(token_logprobs(logits, ids))
        if rec:
            caps.append(finish_hf(model, rec.calls, 0, len(ids)))
    return caps, lps


def engine_with_hooks(model_path: str, args):
    from distflow.config import DistflowConfig, ModelConfig, RolloutConfig
    from distflow.distributed.devices import resolve_auto
    from distflow.rollout.vllm_engine import VLLMEngine

    if args.no_onednn:
        disable_onednn_linear()
    rollout = RolloutConfig(max_new_tokens=32, max_prompt_tokens=max(256, args.max_len))
    t0 = time.perf_counter()
    cfg = resolve_auto(DistflowConfig(model=ModelConfig(path=model_path), rollout=rollout), "cpu")
    engine = VLLMEngine(model_path, cfg.model, cfg.rollout, torch.device("cpu"), seed=0)
    load_s = time.perf_counter() - t0
    rec = Recorder()
    model = engine.llm.collective_rpc(lambda w: w.model_runner.get_model())[0]
    if args.ref_attn:
        swap_attention_to_sdpa(model)
    return engine, model, rec, load_s


def disable_onednn_linear() -> None:
    """Experiment: make vLLM's CPU linear dispatch skip oneDNN (its fallback is torch F.linear on
    the unpacked fp32 weight). Must run before the engine loads the model."""
    from vllm import _custom_ops as ops

    ops._supports_onednn = False


def swap_attention_to_sdpa(model) -> None:
    """Experiment: replace each vLLM Attention call with a causal fp32 torch SDPA on the same
    q/k/v (only valid for one sequence per forward with the whole prompt in one chunk, as here)."""
    for layer in _layers(model):
        attn = layer.self_attn.attn
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_size

        def fwd(q, k, v, *a, _nh=nh, _nkv=nkv, _hd=hd, _scale=attn.impl.scale, **kw):
            T = q.shape[0]
            qh = q.view(T, _nh, _hd).transpose(0, 1)[None]
            kh = k.view(T, _nkv, _hd).transpose(0, 1)[None]
            vh = v.view(T, _nkv, _hd).transpose(0, 1)[None]
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=_scale,
                                                                 enable_gqa=True)
            return o[0].transpose(0, 1).reshape(T, _nh * _hd)

        attn.forward = fwd


def engine_run(engine, model, rec, seqs, hooks: bool):
    caps, lps = [], []
    if hooks:
        hook_vllm(model, rec)
    for ids in seqs:
        rec.clear()
        lp = engine.prompt_logprobs([ids])[0]
        lps.append(torch.tensor(lp, dtype=torch.float64))
        if hooks:
            cap = {}
            for name, ts in rec.calls.items():
                full = [t for t in ts if t.shape[0] == len(ids)]
                if name == "logits":
                    full = [t for t in ts if t.shape[0] == len(ids) - 1]
                if not full:
                    raise RuntimeError(f"no full-sequence capture for {name}: {[t.shape for t in ts]}")
                cap[name] = full[0]
            caps.append(cap)
    rec.remove()
    return caps, lps


def policy_logprobs(model_path, seqs, hf_attn: str | None):
    """The trainer's probe path: Policy (FSDP2 on the 1-process group), all sequences in one
    left-padded batch with explicit position_ids and logits_to_keep, as the trainer's probe (distflow.probe.max_logprob_diff)."""
    from distflow.config import DistflowConfig, ModelConfig
    from distflow.distributed.devices import resolve_auto
    from distflow.distributed.layout import ParallelLayout
    from distflow.sample import Sample
    from distflow.train.batch import TokenBatch
    from distflow.train.policy import Policy

    cfg = resolve_auto(DistflowConfig(model=ModelConfig(path=model_path)), "cpu")
    policy = Policy(model_path, cfg.model, cfg.optim, ParallelLayout.current(cfg.model), trainable=False)
    if hf_attn:
        policy.model.config._attn_implementation = hf_attn
    batch = TokenBatch.from_samples([Sample(s[:1], s[1:], [], False) for s in seqs], 0, torch.device("cpu"))
    with torch.no_grad():
        lp = policy.logprobs(batch)
    return [lp[i, : len(s) - 1].double() for i, s in enumerate(seqs)]


def noise_floor(model, seqs, base) -> None:
    """How far transformers' own fp32 logprobs move under perturbations that change nothing but
    rounding: +-half an ulp of random noise on the embedding output, and 1 thread instead of N
    (a different GEMM blocking). Two correct fp32 implementations can differ by about this much."""
    g = torch.Generator().manual_seed(0)

    def half_ulp(mod, a, o):
        return o + torch.randint(-1, 2, o.shape, generator=g).float() * torch.finfo(torch.float32).eps * o.abs() * 0.5

    h = model.model.embed_tokens.register_forward_hook(half_ulp)
    _, p = hf_plain(model, seqs, None)
    h.remove()
    n = torch.get_num_threads()
    _SET_NUM_THREADS(1 if n > 1 else 2)
    _, t = hf_plain(model, seqs, None)
    _SET_NUM_THREADS(n)
    print("\nfp32 noise floor of HF itself (max |dlogprob|):")
    print(f"  half-ulp random noise on the embeddings: {max((a - b).abs().max().item() for a, b in zip(p, base)):.3e}")
    print(f"  {torch.get_num_threads()} vs {1 if n > 1 else 2} threads:                      "
          f"{max((a - b).abs().max().item() for a, b in zip(t, base)):.3e}")


def stat(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs().max().item()
    return d, d / max(b.double().abs().max().item(), 1e-30)


def report(names, eng, hf, ref, summary: bool):
    print(f"\n{'point':22s} {'|vllm-hf|':>10s} {'rel':>9s} {'|ref|max':>9s}"
          + (f" {'|vllm-f64|':>10s} {'|hf-f64|':>10s}" if ref else ""))
    for name in names:
        rows = [stat(e[name], h[name]) for e, h in zip(eng, hf)]
        d, r = max(x[0] for x in rows), max(x[1] for x in rows)
        mag = max(h[name].abs().max().item() for h in hf)
        if summary and not (name.endswith("8.stream") or not name.startswith("L")):
            continue
        line = f"{name:22s} {d:10.3e} {r:9.2e} {mag:9.2e}"
        if ref:
            dv = max(stat(e[name], f[name])[0] for e, f in zip(eng, ref))
            dh = max(stat(h[name], f[name])[0] for h, f in zip(hf, ref))
            line += f" {dv:10.3e} {dh:10.3e}"
        print(line)


# --------------------------------------------------------------------------- per-op (local) errors
def hook_vllm_local(model, rec: Recorder) -> None:
    """Inputs and outputs of each vLLM op, so each op can be re-run in torch fp32 and fp64 on the
    very same input: the op's own error, free of what earlier layers accumulated."""
    for i, layer in enumerate(_layers(model)):
        p = f"L{i:02d}."
        a, m = layer.self_attn, layer.mlp
        rec.inp(layer.input_layernorm, p + "in_norm.x", 0)
        if i > 0:
            rec.inp(layer.input_layernorm, p + "in_norm.res", 1)
        rec.out(layer.input_layernorm, p + "in_norm.y")
        rec.inp(a.qkv_proj, p + "qkv.x")
        rec.out(a.qkv_proj, p + "qkv.y")
        rec.inp(a.attn, p + "attn.q", 0)
        rec.inp(a.attn, p + "attn.k", 1)
        rec.inp(a.attn, p + "attn.v", 2)
        rec.out(a.attn, p + "attn.y")
        rec.inp(a.o_proj, p + "o_proj.x")
        rec.out(a.o_proj, p + "o_proj.y")
        rec.inp(layer.post_attention_layernorm, p + "post_norm.x", 0)
        rec.inp(layer.post_attention_layernorm, p + "post_norm.res", 1)
        rec.out(layer.post_attention_layernorm, p + "post_norm.y")
        rec.inp(m.gate_up_proj, p + "gate_up.x")
        rec.out(m.gate_up_proj, p + "gate_up.y")
        rec.inp(m.down_proj, p + "down.x")
        rec.out(m.down_proj, p + "down.y")
    rec.inp(model.model.norm, "final_norm.x", 0)
    rec.inp(model.model.norm, "final_norm.res", 1)
    rec.out(model.model.norm, "final_norm.y")
    rec.inp(model.logits_processor, "lm_head.x", 1)
    rec.out(model.logits_processor, "lm_head.y")


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _attn(q, k, v, nh, nkv, hd):
    T = q.shape[0]
    qh, kh, vh = (t.view(T, -1, hd).transpose(0, 1)[None] for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(T, nh * hd)


def _rope(x, hd, theta, dtype):
    """HF's default rotary (rotate_half) on [T, heads*hd], cos/sin computed in `dtype`."""
    T = x.shape[0]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(dtype) / hd))
    f = torch.arange(T, dtype=dtype)[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xh = x.view(T, -1, hd)
    rot = torch.cat([-xh[..., hd // 2:], xh[..., : hd // 2]], -1)
    return (xh * cos + rot * sin).reshape(T, -1)


def local_errors(caps: list[dict], sd: dict, cfg, seqs, engine_lps) -> None:
    """For each op: max |op(x) - fp64(x)| / max |fp64(x)| for the vLLM kernel and for torch fp32
    on the same captured input x, plus max |vLLM - torch fp32|. Max over layers and sequences."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nh, nkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    res = defaultdict(lambda: [0.0, 0.0, 0.0])

    def acc(op, got, f32, f64, relative=True):
        ref = f64.abs().max().item() if relative else 1.0
        r = res[op]
        r[0] = max(r[0], (got.double() - f64).abs().max().item() / ref)
        r[1] = max(r[1], (f32.double() - f64).abs().max().item() / ref)
        r[2] = max(r[2], (got.double() - f32.double()).abs().max().item() / ref)

    def W(name, dt):
        return sd[name].to(dt)

    def B(name, dt):
        return sd[name].to(dt) if name in sd else None

    for cap, ids, eng_lp in zip(caps, seqs, engine_lps):
        def lin(op, key, names):
            x = cap[key + ".x"]
            for dt in (torch.float32, torch.float64):
                w = torch.cat([W(n + ".weight", dt) for n in names])
                bs = [B(n + ".bias", dt) for n in names]
                b = torch.cat(bs) if bs[0] is not None else None
                out = torch.nn.functional.linear(x.to(dt), w, b)
                if dt == torch.float32:
                    f32 = out
            acc(op, cap[key + ".y"], f32, out)

        def norm(op, key, wname):
            x = cap[key + ".x"]
            if key + ".res" in cap:
                x64 = x.double() + cap[key + ".res"].double()
                x32 = x + cap[key + ".res"]
            else:
                x64, x32 = x.double(), x
            acc(op, cap[key + ".y"], _rms(x32, W(wname, torch.float32), eps), _rms(x64, W(wname, torch.float64), eps))

        for i in range(cfg.num_hidden_layers):
            p, hp = f"L{i:02d}.", f"model.layers.{i}."
            norm("rms_norm (input)", p + "in_norm", hp + "input_layernorm.weight")
            lin("qkv_proj", p + "qkv", [hp + "self_attn." + n for n in ("q_proj", "k_proj", "v_proj")])
            qkv = cap[p + "qkv.y"]
            q0, k0, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            acc("rotary q", cap[p + "attn.q"], _rope(q0, hd, theta, torch.float32), _rope(q0.double(), hd, theta, torch.float64))
            acc("rotary k", cap[p + "attn.k"], _rope(k0, hd, theta, torch.float32), _rope(k0.double(), hd, theta, torch.float64))
            q, k, v = cap[p + "attn.q"], cap[p + "attn.k"], cap[p + "attn.v"]
            acc("attention", cap[p + "attn.y"], _attn(q, k, v, nh, nkv, hd),
                _attn(q.double(), k.double(), v.double(), nh, nkv, hd))
            lin("o_proj", p + "o_proj", [hp + "self_attn.o_proj"])
            norm("rms_norm (post)", p + "post_norm", hp + "post_attention_layernorm.weight")
            lin("gate_up_proj", p + "gate_up", [hp + "mlp.gate_proj", hp + "mlp.up_proj"])
            lin("down_proj", p + "down", [hp + "mlp.down_proj"])
        norm("rms_norm (final)", "final_norm", "model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
        x = cap["lm_head.x"]
        logits64 = x.double() @ W(head, torch.float64).T
        logits32 = x @ W(head, torch.float32).T
        acc("lm_head", cap["lm_head.y"], logits32, logits64)
        tgt = torch.tensor(ids[1:])[:, None]
        f32 = torch.log_softmax(cap["lm_head.y"].float(), -1).gather(-1, tgt)[:, 0]
        f64 = torch.log_softmax(cap["lm_head.y"].double(), -1).gather(-1, tgt)[:, 0]
        acc("log_softmax (ABS err)", torch.tensor(eng_lp), f32, f64, relative=False)
    print("\nper-op error on identical inputs (max abs err / max |fp64 result|, max over layers):")
    print(f"{'op':24s} {'vLLM kernel':>12s} {'torch fp32':>12s} {'vLLM-torch':>12s}")
    for op, (a, b, c) in res.items():
        print(f"{op:24s} {a:12.2e} {b:12.2e} {c:12.2e}")


def run_local(engine, model, seqs, path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    rec = Recorder()
    hook_vllm_local(model, rec)
    caps, lps = [], []
    for ids in seqs:
        rec.clear()
        lps.append(engine.prompt_logprobs([ids])[0])
        cap = {}
        for name, ts in rec.calls.items():
            want = len(ids) - 1 if name.startswith("lm_head") else len(ids)
            full = [t for t in ts if t.shape[0] == want]
            cap[name] = full[0].reshape(want, -1)
        caps.append(cap)
    rec.remove()
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    local_errors(caps, sd, AutoConfig.from_pretrained(path), seqs, lps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2_135m", help="tiny | smollm2_135m | a model folder")
    ap.add_argument("--seqs", type=int, default=2, help=f"number of sequences (1-{len(QUESTIONS)})")
    ap.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--no-policy", action="store_true", help="skip the policy (FSDP2, left-padded) path")
    ap.add_argument("--no-fp64", action="store_true", help="skip the float64 ground-truth forward")
    ap.add_argument("--no-layers", action="store_true", help="end-to-end logprobs only, no hooks")
    ap.add_argument("--summary", action="store_true", help="print only embed, per-layer stream, norm, logits")
    ap.add_argument("--no-onednn", action="store_true", help="experiment: vLLM linears via torch F.linear (no oneDNN)")
    ap.add_argument("--ref-attn", action="store_true", help="experiment: vLLM attention via torch SDPA")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also: how much HF's own logprobs move under rounding-only perturbations")
    ap.add_argument("--local", action="store_true",
                    help="also: each vLLM op's own error, re-running it in torch fp32/fp64 on the same input")
    ap.add_argument("--max-len", type=int, default=256)
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.models.tiny import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    seqs = make_sequences(tok, args.seqs)
    print(f"model {args.model} ({path}); sequence lengths {[len(s) for s in seqs]}; torch threads "
          f"{torch.get_num_threads()}")
    args.max_len = max(args.max_len, max(len(s) for s in seqs))
    init_single_process_group()
    hooks = not args.no_layers

    engine, vmodel, vrec, load_s = engine_with_hooks(path, args)
    t0 = time.perf_counter()
    e_caps, e_lps = engine_run(engine, vmodel, vrec, seqs, hooks)
    print(f"engine: load {load_s:.1f}s, prompt_logprobs {time.perf_counter() - t0:.2f}s")
    if args.local:
        run_local(engine, vmodel, seqs, path)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=args.hf_attn).eval()
    rec = Recorder()
    if hooks:
        hook_hf(hf, rec)
    h_caps, h_lps = hf_plain(hf, seqs, rec if hooks else None)
    rec.remove()
    if args.noise_floor:
        noise_floor(hf, seqs, h_lps)
    del hf

    f_caps, f_lps = [], None
    if not args.no_fp64:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
        rec = Recorder()
        if hooks:
            hook_hf(ref, rec)
        f_caps, f_lps = hf_plain(ref, seqs, rec if hooks else None)
        rec.remove()
        del ref

    p_lps = None
    if not args.no_policy:
        p_lps = policy_logprobs(path, seqs, args.hf_attn if args.hf_attn != "sdpa" else None)

    if hooks:
        names = sorted(h_caps[0].keys(), key=lambda n: (n != "embed", n == "final_norm" or n == "logits",
                                                        n == "logits", n))
        e_caps = [{k: v.reshape(v.shape[0], -1) for k, v in c.items()} for c in e_caps]
        # HF's logits cover every position; vLLM's prompt-logprob logits skip the last one.
        for c in h_caps + f_caps:
            c["logits"] = c["logits"][:-1]
        report(names, e_caps, h_caps, f_caps or None, args.summary)

    def lpdiff(a, b):
        d = [(x.double() - y.double()).abs() for x, y in zip(a, b)]
        per = " ".join(f"{t.max().item():.2e}" for t in d)
        return f"max {max(t.max().item() for t in d):.3e}  mean {torch.cat(d).mean().item():.2e}  per-seq max [{per}]"

    print("\nend-to-end prompt logprobs, |difference|:")
    print(f"  engine vs HF fp32 plain ({args.hf_attn:5s}): {lpdiff(e_lps, h_lps)}")
    if p_lps is not None:
        print(f"  engine vs policy path:           {lpdiff(e_lps, p_lps)}")
        print(f"  HF plain vs policy path:         {lpdiff(h_lps, p_lps)}")
    if f_lps is not None:
        print(f"  engine vs fp64:                  {lpdiff(e_lps, f_lps)}")
        print(f"  HF fp32 plain vs fp64:           {lpdiff(h_lps, f_lps)}")
        if p_lps is not None:
            print(f"  policy path vs fp64:             {lpdiff(p_lps, f_lps)}")
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
