"""Reward models and LLM judges: their scores on 1 and 2 ranks (real gloo, FSDP2, sharded and
replicated, a rank with fewer samples or none) equal a plain transformers forward of each sequence
alone in one process, the weighted sum and metric sums are what the specs say, and every bad entry
is one line before any weights load."""

import math
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from config_helpers import fp32_config
from dist_helpers import gathered, run_distributed
from scorer_helpers import build_reward_model, offloaded_shards
from distflow.config import ConfigError, DistflowConfig
from distflow.distributed.layout import ParallelLayout
from distflow.sample import Sample
from distflow.tasks.prompts import PromptItem
from distflow.train.model_rewards import (
    ModelRewards,
    check_reward_model_config,
    conversation,
    judge_token_ids,
    model_reward_metrics,
)

TEMPLATE = "Question: {question}\nReference: {reference}\nAnswer: {answer}\nIs the answer right? Say Y or N."
QUESTIONS = ["What is 2 + 3?", "What is 10 - 4?", "Name a prime above 7.", "What is 6 * 7?", "What is 1 + 1?"]
ANSWERS = ["5", "6", "11", "42", "2"]
RESPONSES = ["The answer is 5.", "It is 7, I think.", "", "42", "2, because 1 + 1 = 2, and that is a long reason " * 6,
             "No idea.", "6", "The answer is 11.", "48", "two"]  # two samples per question; one empty


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A tiny random sequence classifier with one label on the tiny model's tokenizer (and template)."""
    return build_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "tiny-rm")


def _items_and_samples(tokenizer):
    items = [PromptItem([1], f"<user>{q}", a, {"q": q}, [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": q}])
             for q, a in zip(QUESTIONS, ANSWERS)]
    samples = [Sample([1], tokenizer.encode(r, add_special_tokens=False), [], False) for r in RESPONSES]
    return items, samples


def _cfg(reward_model_dir, judge_dir, shard_ranks, max_tokens=4096, offload=False):
    cfg = fp32_config()
    cfg.model.shard_ranks = shard_ranks
    cfg.task.reward_models = [{"path": reward_model_dir, "weight": 0.5, "max_tokens": max_tokens,
                               "batch_tokens": 96, "offload": offload}]  # small passes: several per rank
    cfg.task.judges = [{"path": judge_dir, "template": TEMPLATE, "yes": "Y", "no": "N", "weight": 2.0,
                        "name": "grader", "max_tokens": max_tokens, "batch_tokens": 96, "offload": offload}]
    return cfg


def _worker(rank, world, reward_model_dir, judge_dir, settings):
    """Per (shard_ranks, max_tokens, offload): rank r scores groups r, r + world, ... (with 5 groups on
    2 ranks, rank 1 has fewer), and a rank with nothing at all keeps step too."""
    out = []
    for shard_ranks, max_tokens, offload in settings:
        cfg = _cfg(reward_model_dir, judge_dir, shard_ranks, max_tokens, offload)
        scorer = ModelRewards(cfg, ParallelLayout.current(cfg.model))
        assert [offloaded_shards(model.net.model) for _, model in scorer.models] == [offload, offload]
        tokenizer = AutoTokenizer.from_pretrained(judge_dir)
        items, samples = _items_and_samples(tokenizer)
        mine = list(range(rank, len(items), world))
        total, sums = scorer([items[g] for g in mine], [s for g in mine for s in samples[2 * g:2 * g + 2]],
                             [r for g in mine for r in RESPONSES[2 * g:2 * g + 2]], group_size=2)
        empty = {key: tuple(model.scores([]).shape) for key, model in scorer.models}
        out.append(gathered((mine, total, sums, empty)))
    return out


def _plain_scores(reward_model_dir, judge_dir, max_tokens=4096):
    """Each sequence alone through plain transformers, in one process: (reward model logits,
    judge P(Y) / (P(Y) + P(N)))."""
    tok = AutoTokenizer.from_pretrained(judge_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    judge = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    items, samples = _items_and_samples(tok)
    y, n = tok.encode("Y", add_special_tokens=False)[0], tok.encode("N", add_special_tokens=False)[0]
    rm_scores, judge_scores = [], []
    with torch.no_grad():
        for i, (sample, text) in enumerate(zip(samples, RESPONSES)):
            item = items[i // 2]
            rendered = tok.apply_chat_template(conversation(item, sample, text), tokenize=False)
            ids = tok.encode(rendered, add_special_tokens=False)[-max_tokens:]
            rm_scores.append(float(rm(torch.tensor([ids])).logits[0, 0]))
            content = TEMPLATE.format(question=item.messages[-1]["content"], reference=item.answer, answer=text)
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)[-max_tokens:]
            p = torch.softmax(judge(torch.tensor([ids])).logits[0, -1].double(), -1)
            judge_scores.append(float(p[y] / (p[y] + p[n])))
    return torch.tensor(rm_scores), torch.tensor(judge_scores)


@pytest.mark.parametrize("world, settings", [(1, [(None, 4096, False)]), (2, [(-1, 4096, True), (1, 40, False)])])
def test_scores_equal_a_plain_forward_of_each_sequence(tiny_model_dir, reward_model_dir, world, settings):
    """1 rank; 2 ranks fully sharded with the shards offloaded to host memory between passes; 2
    ranks replicated with every sequence cut to its last 40 tokens."""
    runs = run_distributed(_worker, world, reward_model_dir, tiny_model_dir, settings)
    for (_, max_tokens, _), results in zip(settings, runs):
        _check_scores(results, *_plain_scores(reward_model_dir, tiny_model_dir, max_tokens), max_tokens)


def _check_scores(results, rm, judge, max_tokens):
    assert rm.std() > 0 and judge.std() > 0 and ((judge > 0) & (judge < 1)).all()
    seen = []
    for mine, total, sums, empty in results:
        rows = [2 * g + k for g in mine for k in (0, 1)]
        seen += rows
        torch.testing.assert_close(total, 0.5 * rm[rows] + 2.0 * judge[rows], rtol=1e-6, atol=1e-6)
        assert sums["reward_model/tiny-rm/sum"] == pytest.approx(float(rm[rows].sum()), rel=1e-5, abs=1e-6)
        assert sums["judge/grader/sq"] == pytest.approx(float((judge[rows] ** 2).sum()), rel=1e-5)
        assert sums["judge/grader/n"] == len(rows)
        assert sums["judge/grader/truncated"] == (len(rows) if max_tokens == 40 else 0)
        assert all(shape == (0,) for shape in empty.values())
    assert sorted(seen) == list(range(len(RESPONSES)))
    g = {k: sum(r[2][k] for r in results) for k in results[0][2]}
    m = model_reward_metrics(g, ["reward_model/tiny-rm"])
    assert m["reward_model/tiny-rm/mean"] == pytest.approx(float(rm.mean()), rel=1e-5)
    assert m["reward_model/tiny-rm/std"] == pytest.approx(float(rm.std(unbiased=False)), rel=1e-4)


# ----------------------------------------------------------------------------- bad input

def test_a_reward_model_must_be_a_one_label_classifier(tiny_model_dir, reward_model_dir, tmp_path):
    check_reward_model_config(AutoConfig.from_pretrained(reward_model_dir), "rm")
    with pytest.raises(ConfigError, match=r"^rm is not a sequence classifier .*'Qwen2ForCausalLM'.* as a judge"):
        check_reward_model_config(AutoConfig.from_pretrained(tiny_model_dir), "rm")
    two = tmp_path / "two"
    shutil.copytree(reward_model_dir, two)
    config = AutoConfig.from_pretrained(two)
    config.num_labels = 2
    config.save_pretrained(two)
    with pytest.raises(ConfigError, match="^rm is a classifier with 2 labels: a reward model has one"):
        check_reward_model_config(AutoConfig.from_pretrained(two), "rm")


def test_judge_words_must_be_single_distinct_tokens(tiny_model_dir):
    from distflow.config.task import JudgeSpec

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert judge_token_ids(tok, JudgeSpec("j", TEMPLATE, "Y", "N"), "j") == (tok.convert_tokens_to_ids("Y"),
                                                                             tok.convert_tokens_to_ids("N"))
    with pytest.raises(ConfigError, match=r"^j: 'Yes' is 2 tokens in the judge's vocabulary .* not one"):
        judge_token_ids(tok, JudgeSpec("j", TEMPLATE), "j")
    with pytest.raises(ConfigError, match="are the same token"):
        judge_token_ids(tok, JudgeSpec("j", TEMPLATE, "Y", "Y"), "j")


@pytest.mark.parametrize("task, words", [
    ({"judges": [{"path": "/tmp", "template": "Is {question} right?"}]}, r"task.judges\[0\].template has no \{answer\}"),
    ({"judges": [{"path": "/tmp", "template": "{answer} {score}"}]}, "cannot be rendered .KeyError: 'score'"),
    ({"judges": [{"path": "/tmp", "template": "{answer}", "temperature": 0}]}, r"unknown keys \['temperature'\]"),
    ({"reward_models": [{"weight": 1.0}]}, r"task.reward_models\[0\]: missing \['path'\]"),
    ({"reward_models": [{"path": "/tmp/no/such/rm"}]}, r"task.reward_models\[0\].path '/tmp/no/such/rm' is not a folder"),
    ({"reward_models": [{"path": "/tmp"}, {"path": "/tmp", "weight": 2}]}, "also named 'tmp'"),
    ({"reward_models": [{"path": "/tmp", "weight": float("nan")}]}, "weight must be a finite number"),
    ({"reward_models": [{"path": "/tmp", "offload": "yes"}]}, r"reward_models\[0\].offload must be true or false"),
])
def test_bad_entries_are_one_line(task, words):
    with pytest.raises(ConfigError, match=words) as e:
        DistflowConfig.from_dict({"task": {"path": "p.jsonl", **task}}).validate()
    assert "\n" not in str(e.value)


def test_dynamic_sampling_is_refused_with_model_rewards():
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling keeps groups by their reward functions"):
        DistflowConfig.from_dict({"task": {"path": "p.jsonl", "reward_models": [{"path": "/tmp"}]},
                                  "algorithm": {"dynamic_sampling": True}}).validate()


def test_metrics_of_no_samples_are_zero():
    keys = {f"judge/j/{k}": 0.0 for k in ("sum", "sq", "n", "truncated")}
    assert model_reward_metrics(keys, ["judge/j"]) == {"judge/j/mean": 0.0, "judge/j/std": 0.0,
                                                       "judge/j/truncated": 0.0}
    assert math.isfinite(model_reward_metrics({**keys, "judge/j/n": 1.0, "judge/j/sum": 1e-9}, ["judge/j"])["judge/j/std"])
