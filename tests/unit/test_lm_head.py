"""The chunked LM head's dtype (distflow.train.lm_head): a bf16 model's head can run in float32."""

import torch
import torch.nn.functional as F

from distflow.train.lm_head import chunked_stats, token_stats


def _case():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 32, generator=g) * 2)
    hidden = (torch.randn(2, 5, 32, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 500, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    mask[1, :2] = 0
    return head, hidden, targets, mask


def test_float32_head_of_a_bf16_model_equals_the_float32_formula_and_trains_the_bf16_weight():
    head, hidden, targets, mask = _case()
    out = chunked_stats(hidden, head, targets, mask, 0.7, 3, False, torch.float32)[..., 0]
    m = mask.bool()
    ref, _ = token_stats(F.linear(hidden.detach().float(), head.weight.detach().float()), targets, 0.7, False)
    # float32 rounding only: the chunks' matmuls may pick another kernel or summation order than the
    # whole batch's (with one thread here they differ in the last bit), bf16 logits by ~0.3
    torch.testing.assert_close(out[m], ref[m], rtol=1e-6, atol=1e-5)
    assert torch.all(out[~m] == 0)
    bf16, _ = token_stats(F.linear(hidden.detach(), head.weight.detach()), targets, 0.7, False)
    assert (bf16[m] - ref[m]).abs().max() > 1e-2  # bf16 logits really are coarser: the option matters
    out.sum().backward()
    assert head.weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    assert head.weight.grad.abs().sum() > 0


def test_no_head_dtype_keeps_the_models_own():
    head, hidden, targets, mask = _case()
    out = chunked_stats(hidden.detach(), head, targets, mask, 1.0, 4, False)[..., 0]
    ref, _ = token_stats(F.linear(hidden.detach(), head.weight.detach()), targets, 1.0, False)
    assert torch.equal(out[mask.bool()], ref[mask.bool()])
