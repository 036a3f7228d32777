"""On-policy distillation: the estimator against its definition written out, the teacher's per-token
advantages on 2 ranks (real gloo, FSDP2 student and teacher) against a plain transformers forward
in one process, exactly zero advantage when the teacher is the student, the distill/* metrics, and
the start-up refusals (no teacher, an unused teacher, another tokenizer)."""

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from config_helpers import fp32_config
from dist_helpers import gathered, run_distributed
from scorer_helpers import offloaded_shards
from grad_helpers import fixed_batch
from distflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, local_sum
from distflow.algorithms.distill import MAX, distill_metrics, distill_vector, no_sums
from distflow.config import AlgorithmConfig, ConfigError, DistflowConfig
from distflow.distributed.layout import ParallelLayout
from distflow.models.folder_check import check_same_tokenizer
from distflow.train.learner import Learner


# ----------------------------------------------------------------------------- the estimator

def _reference(student, teacher, lengths, rewards, weight, group_size, eps):
    """Per token -(s - t), plus weight x (r - mean) / (std + eps) of the sample's group (0 when the
    group's rewards are equal), in plain python."""
    out = []
    for i, n in enumerate(lengths):
        g = rewards[i // group_size * group_size:(i // group_size + 1) * group_size]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        task = 0.0 if max(g) == min(g) else (rewards[i] - mean) / (std + eps)
        out.append([-(student[i][t] - teacher[i][t]) + weight * task for t in range(n)])
    return out


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_distill_advantages_match_definition(weight):
    lengths = [3, 0, 1, 4, 2, 2]  # an empty and a one-token response
    g = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(6, 4, generator=g) * 3, -torch.rand(6, 4, generator=g) * 3
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths])
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, -1.0]  # the middle group is equal: no task signal
    cfg = AlgorithmConfig(advantage="distill", group_size=2, distill_reward_weight=weight)
    inputs = AdvantageInputs(torch.tensor(rewards), torch.zeros(6, 4), mask, None, (student - teacher) * mask)
    adv, returns = ADVANTAGE_ESTIMATORS["distill"](inputs, cfg, local_sum)
    assert returns is None
    ref = _reference(student.tolist(), teacher.tolist(), lengths, rewards, weight, 2, cfg.eps)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(adv[i, :n], torch.tensor(ref[i]), rtol=1e-6, atol=1e-6)
        assert torch.equal(adv[i, n:], torch.zeros(4 - n))  # padding and the empty response: exact zeros
    # a teacher equal to the student and no task reward: exactly zero everywhere
    same = AdvantageInputs(torch.tensor(rewards), torch.zeros(6, 4), mask, None, (student - student) * mask)
    assert torch.equal(ADVANTAGE_ESTIMATORS["distill"](same, AlgorithmConfig(advantage="distill", group_size=2),
                                                       local_sum)[0], torch.zeros(6, 4))


def test_distill_metrics_summed_over_ranks():
    ratio = torch.tensor([[0.5, -0.25, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 9.0 is padding: not counted
    a = distill_vector(ratio[:1], mask[:1])
    b = distill_vector(ratio[1:], mask[1:])
    empty = distill_vector(ratio[:0], mask[:0])  # a rank with no samples
    total = (a + b + empty).tolist()
    total[MAX] = max(a[MAX], b[MAX], empty[MAX]).item()
    m = distill_metrics(total)
    assert m["distill/reverse_kl_mean"] == pytest.approx((0.5 - 0.25 + 2.0) / 3)
    assert m["distill/reverse_kl_max"] == 2.0
    assert 2.0 <= m["distill/reverse_kl_p99"] <= 2.0 * 1.13  # the bin's upper edge
    assert empty.tolist() == no_sums()
    assert distill_metrics(empty.tolist()) == {"distill/reverse_kl_mean": 0.0, "distill/reverse_kl_p99": 0.0,
                                               "distill/reverse_kl_max": 0.0}


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("change, words", [
    ({"algorithm": {"advantage": "distill"}}, "set teacher.path"),
    ({"teacher": {"path": "/tmp"}}, "does not use a teacher"),
    ({"algorithm": {"advantage": "distill", "group_size": 1, "distill_reward_weight": 0.5}, "teacher": {"path": "/tmp"}},
     "needs group_size >= 2"),
])
def test_distill_config_refusals(change, words):
    task = {"task": {"path": "prompts.jsonl"}}
    with pytest.raises(ConfigError, match=words):
        DistflowConfig.from_dict({**task, **change}).validate()
    DistflowConfig.from_dict({**task, "algorithm": {"advantage": "distill"}, "teacher": {"path": "/tmp"}}).validate()


def test_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<tool_result>"])
    tok.save_pretrained(other)
    check_same_tokenizer(tiny_model_dir, tiny_model_dir, "teacher.path")  # the same folder passes
    with pytest.raises(ConfigError, match=r"teacher.path .* has another tokenizer than model.path .*"
                                          r"'<tool_result>' is id \d+ in its vocabulary and absent in the policy's"):
        check_same_tokenizer(tiny_model_dir, other, "teacher.path")


# ----------------------------------------------------------------------------- on 2 ranks

def _teacher_folder(tiny_model_dir, out) -> str:
    """The tiny model with every weight moved by 5% noise: another model on the same tokenizer."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std().clamp(min=1e-3))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def _worker(rank, world, student, teachers):
    """Per teacher: this rank's rows of the advantages the learner computes for the fixed batch
    (group size 2, four samples per rank), and the update's distill sums."""
    out = {}
    for name, (teacher, offload) in teachers.items():
        cfg = fp32_config()
        cfg.model.path, cfg.teacher.path, cfg.teacher.offload = student, teacher, offload
        cfg.algorithm.advantage, cfg.algorithm.group_size = "distill", 2
        torch.manual_seed(0)
        learner = Learner(cfg, ParallelLayout.current(cfg.model), student, student, pad_id=0, teacher_path=teacher)
        assert offloaded_shards(learner.teacher.model) == offload
        samples = fixed_batch()[0][rank * 4:(rank + 1) * 4]
        batch = learner.batch(samples, current_version=0)
        plan = learner.plan(batch)
        lp = learner.logprobs(plan)
        batch = learner.advantages(batch, torch.tensor([[1.0, 0.0], [0.5, 0.5]]), lp)
        result = learner.update(batch, plan, step=1)
        out[name] = (batch.advantages, batch.tokens.resp_mask, result.distill, result.grad_norm)
    return gathered(out)


def _plain_logprobs(folder, samples):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            rows.append(picked[len(s.prompt_ids) - 1:])
    return rows


def test_teacher_advantages_on_two_ranks_match_a_plain_forward(tiny_model_dir, tmp_path):
    teacher = _teacher_folder(tiny_model_dir, tmp_path / "teacher")
    results = run_distributed(_worker, 2, tiny_model_dir, {"self": (tiny_model_dir, False), "other": (teacher, False),
                                                           "offloaded": (teacher, True)})
    samples = fixed_batch()[0]
    s_rows, t_rows = _plain_logprobs(tiny_model_dir, samples), _plain_logprobs(teacher, samples)
    for rank, per in enumerate(results):
        # the teacher is the student: zero advantage on every token, exactly, hence no gradient
        adv, mask, sums, grad_norm = per["self"]
        assert torch.equal(adv, torch.zeros_like(adv)) and grad_norm == 0.0
        assert sums[0] == 0.0 and sums[MAX] == 0.0 and sums[1] == float(mask.sum())
        adv, mask, sums, grad_norm = per["other"]
        for i in range(4):
            s = samples[rank * 4 + i]
            n = len(s.response_ids)
            expect = -(s_rows[rank * 4 + i] - t_rows[rank * 4 + i])
            torch.testing.assert_close(adv[i, :n], expect, rtol=1e-5, atol=1e-5)
            assert torch.equal(adv[i, n:], torch.zeros_like(adv[i, n:]))
        assert sums[0] == pytest.approx(-float(adv.sum()), rel=1e-5) and grad_norm > 0
        # the teacher's shards in host memory between uses: the same advantages, bit for bit
        assert torch.equal(per["offloaded"][0], adv) and per["offloaded"][3] == grad_norm
