"""The trainer itself, in-process on 2 real gloo ranks (tiny model, the hf engine, a real reward pool).

One pair of processes runs every case below, one `Trainer` after another, so a case costs its
trainer's start-up (a second or two), not a torchrun launch. The cases:

- every algorithm recipe end to end, with its own metric keys and the post-resync probe;
- packed rows sharing each group's prompt take the same first step as padded rows;
- KL, entropy, truncated IS and dual-clip together; DAPO's dynamic sampling with a rank that keeps
  nothing, and with every group filtered out;
- a harness's episodes through each rank's OpenAI-compatible endpoint train and resume exactly;
- carry-over at eta = 0 is the sync run bit for bit (metrics and final weights; also with dynamic
  sampling and with multi-turn episodes); at eta = 1 it keeps its bound, and a run stopped with
  groups (or episodes) carried and continued equals one run straight through;
- PPO's critic warm-up, and a PPO run stopped at step 2 and continued that equals one run straight
  through (critic, optimizers and schedules restored bit for bit); launched again it has nothing
  to train, and another run (another seed) in its folder is refused;
- a reward that hangs; length balancing on a skewed task; a rank that lags behind (the wait clock
  and the straggler warning); NaN losses for too many steps; training on the CPU of a machine
  that shows GPUs;
- a fresh start in the folder of an earlier LoRA run with W&B and TensorBoard, which moves every
  artifact of that run aside and leaves the files beside them alone;
- the config and data errors every rank must stop on, before any weights load.

tests/e2e keeps what only a real launch shows: vLLM, the recipe's console, torchrun's restarts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from config_helpers import RECIPES, compose
from dist_helpers import gathered, run_distributed
from launch_helpers import stable_metrics
from scorer_helpers import build_reward_model

pytestmark = pytest.mark.slow

BASE = ["experiment=smoke", "model.dtype=float32", "rollout=hf", "logging.plot_at_end=false", "task.reward=rewards_for_tests:digit_fraction"]
ALGORITHMS = sorted(p.stem for p in (RECIPES / "algorithm").glob("*.yaml"))
SPECIFIC = {
    "dapo": ["dynamic_sampling/kept_groups", "dynamic_sampling/rounds"],
    "distill": ["distill/reverse_kl_mean", "distill/reverse_kl_p99", "distill/reverse_kl_max", "timing/teacher_s"],
    "ppo": ["value/loss", "value/clip_fraction", "value/mean", "critic/grad_norm"],
}
TIS_CAP = 0.99
# what a recipe needs beside its group: distill's teacher (here the student itself: zero advantage)
RECIPE_NEEDS = {"distill": ["teacher.path=tiny"]}


def skewed_task(path: Path) -> str:
    """Even rows have long prompts, odd rows short ones: unshuffled, rank 0 of 2 gets all the long ones."""
    rows = []
    for i in range(16):
        a, b = i + 2, 3 * i + 1
        pad = "Read carefully, this is a long preamble about numbers. " * 3 if i % 2 == 0 else ""
        rows.append(json.dumps({"prompt": f"{pad}What is {a} + {b}?", "answer": str(a + b)}))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


FOREIGN = {"notes.txt": "mine", "data/train.jsonl": "{}", "logs/4242-node01.log": "a launcher's log"}
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def cases(tmp: Path) -> list[tuple[str, str, list[str], dict]]:
    """(name, output folder, overrides, environment) in the order the trainers run."""
    no_prompt, empty = tmp / "no_prompt.jsonl", tmp / "empty.jsonl"
    no_prompt.write_text('{"question": "1+1?", "answer": "2"}\n')
    empty.write_text("")
    skewed = skewed_task(tmp / "skewed.jsonl")
    ppo = ["algorithm=ppo", "critic.warmup_steps=1", "critic.lr=1e-3", "checkpoint.every=2"]
    balance = ["run.steps=2", "run.sync_probe_every=5", "task=jsonl", f"task.path={skewed}", "data.shuffle=false",
               "rollout.max_prompt_tokens=256"]
    stale = ["run.steps=1", "optim.lr=1e-2", "optim.warmup_steps=0"]  # one step moves every weight ~1e-2
    exact = ["rollout_correction=token_tis", "checkpoint.export_at_end=true"]
    # eta = 1, three groups in the engine at once: the boundary carries held and unstarted groups
    carry = ["pipeline=carryover", "pipeline.max_concurrency=12", "checkpoint.every=3"]
    # 2-turn episodes, every one a calculator round trip (tests/support/envs_for_tests.py)
    tools = ["task.env=envs_for_tests:ScriptedToolEnv", "+task.env_args={tools: [calculator]}", "rollout.max_turns=2",
             "rollout.max_total_tokens=64", "rollout.max_prompt_tokens=352", "run.steps=3"]
    odd = ["pipeline=carryover", "task.env=envs_for_tests:OddToolEnv"]  # one or two turns: steps stop between them
    # a harness of two chat requests per episode against each rank's endpoint (tests/support/agents_for_tests.py)
    agent = ["task.agent=agents_for_tests:two_turns", "rollout.max_turns=2", "rollout.max_total_tokens=64",
             "rollout.max_prompt_tokens=352"]
    # distillation from the model sync_ref exported (4 steps from the student), with half the task reward,
    # which a reward model and an LLM judge (the tiny model itself) add to
    distill = ["algorithm=distill", f"teacher.path={tmp}/sync_ref/hf_model", "algorithm.distill_reward_weight=0.5",
               f"task.reward_models=[{{path: {tmp}/tiny-rm, weight: 0.5}}]",
               "task.judges=[{path: tiny, name: self, template: 'Is {answer} right? Y or N.', yes: Y, no: N}]"]
    run = [(f"algo_{a}", f"algo_{a}", [f"algorithm={a}", "run.steps=2", *RECIPE_NEEDS.get(a, [])], {})
           for a in ALGORITHMS]
    run += [
        ("grpo_padded", "grpo_padded", ["algorithm=grpo", "run.steps=1", "optim.shared_prefix=off",
                                          "algorithm.kl_metric=true"], {}),
        ("kl_tis", "kl_tis", ["run.steps=2", "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01",
                              f"algorithm.tis_cap={TIS_CAP}", "algorithm.dual_clip_c=3.0"], {}),
        ("dapo_empty_rank", "dapo_empty_rank", ["algorithm=dapo", "run.steps=2",
                                                "task.reward=rewards_for_tests:flat_on_rank1"], {}),
        ("dapo_all_filtered", "dapo_all_filtered", ["algorithm=dapo", "run.steps=2", "algorithm.max_sampling_rounds=2",
                                                    "task.reward=rewards_for_tests:constant"], {}),
        ("dapo_carryover", "dapo_carryover", ["algorithm=dapo", "run.steps=2", "task.reward=rewards_for_tests:flat_on_rank1",
                                              "pipeline.mode=carryover"], {}),
        ("dapo_eta1", "dapo_eta1", ["algorithm=dapo", "run.steps=3", "pipeline=carryover"], {}),
        ("sync_ref", "sync_ref", [*exact, "run.steps=4"], {}),
        ("carryover_eta0", "carryover_eta0", [*exact, "run.steps=4", "pipeline.mode=carryover"], {}),
        ("distill_straight", "distill_straight", [*distill, "run.steps=2"], {}),
        ("distill_first_half", "distill_split", [*distill, "run.steps=1", "checkpoint.every=1"], {}),
        ("distill_other_teacher", "distill_split", [*distill, "run.steps=2", "teacher.path=tiny"], {}),
        ("distill_continued", "distill_split", [*distill, "run.steps=2", "checkpoint.resume=force"], {}),
        ("carry_straight", "carry_straight", [*carry, "run.steps=6"], {}),
        ("carry_first_half", "carry_split", [*carry, "run.steps=3"], {}),
        ("carry_continued", "carry_split", [*carry, "run.steps=6", "checkpoint.resume=force"], {}),
        ("tools_sync", "tools_sync", [*tools, *exact], {}),
        ("tools_carryover_eta0", "tools_carryover_eta0", [*tools, *exact, "pipeline.mode=carryover"], {}),
        ("tools_carry_straight", "tools_carry_straight", [*tools, *odd, "run.steps=4"], {}),
        ("tools_carry_first_half", "tools_carry_split", [*tools, *odd, "run.steps=2", "checkpoint.every=2"], {}),
        ("tools_carry_continued", "tools_carry_split", [*tools, *odd, "run.steps=4", "checkpoint.resume=force"], {}),
        ("agent_straight", "agent_straight", [*agent, "run.steps=2"], {}),
        ("agent_first_half", "agent_split", [*agent, "run.steps=1", "checkpoint.every=1"], {}),
        ("agent_continued", "agent_split", [*agent, "run.steps=2", "checkpoint.resume=force"], {}),
        ("ppo_straight", "ppo_straight", [*ppo, "run.steps=4"], {}),
        ("ppo_first_half", "ppo_split", [*ppo, "run.steps=2"], {}),
        ("ppo_continued", "ppo_split", [*ppo, "run.steps=4", "checkpoint.resume=force"], {}),
        ("ppo_again", "ppo_split", [*ppo, "run.steps=4"], {}),  # finished: nothing to train
        ("ppo_other_seed", "ppo_split", [*ppo, "run.steps=4", "run.seed=1"], {}),  # another run, same folder
        ("hanging_reward", "hanging_reward", ["task.reward=rewards_for_tests:hang_sometimes",
                                              "task.reward_timeout_s=1"], {}),
        ("balance_off", "balance_off", [*balance, "run.balance_lengths=false"], {}),
        ("balance_on", "balance_on", [*balance, "run.balance_lengths=true"], {}),
        ("straggler", "straggler", ["run.fault_inject='1:2+:sleep=1.5'", "logging.straggler_warn_steps=2"], {}),
        ("nan_streak", "nan_streak", ["run.steps=5", "run.fault_inject=0:2+:nan", "run.max_nonfinite_steps=2"], {}),
        ("stale_step", "stale_step", [*stale, "run.fault_inject=0:1:stale_resync"], {}),
        ("stale_allowed", "stale_allowed", [*stale, "run.fault_inject=0:1:stale_resync", "run.allow_engine_mismatch=true"],
         {}),
        ("stale_first", "stale_resume", stale, {}),
        ("stale_resumed", "stale_resume", [*stale, "run.steps=2", "checkpoint.resume=force",
                                           "run.fault_inject=1:1:stale_resync"], {}),
        ("cpu_on_gpu_machine", "cpu_on_gpu_machine", ["run.steps=1", "run.device=cpu"],
         {"CUDA_VISIBLE_DEVICES": "0"}),
        ("lora_wandb", "reused", ["run.steps=1", "model.lora.enabled=true", "checkpoint.export_at_end=true",
                                  "logging.loggers=[console,jsonl,wandb,tensorboard]", "logging.plot_at_end=true"],
         {**WANDB_OFFLINE, "WANDB_DIR": str(tmp / "wandb_home")}),
        ("fresh_over_it", "reused", ["run.steps=1", "checkpoint.resume=never"], {}),
    ]
    run += [(f"refuse_{name}", f"refuse_{name}", overrides, env) for name, (overrides, env, _) in REFUSALS(tmp).items()]
    return run


def REFUSALS(tmp: Path) -> dict[str, tuple[list[str], dict, str]]:  # noqa: N802 - a table
    """name -> (overrides, environment, the one line every rank must stop with)."""
    return {
        "group_size_1": (["algorithm.group_size=1"], {}, "algorithm.advantage=grpo is group-relative and needs "
                                                         "group_size >= 2"),
        "clip_range": (["algorithm.clip_eps_high=0.1"], {}, "need 0 <= algorithm.clip_eps_low <= clip_eps_high"),
        "agg_mode": (["algorithm.loss_agg_mode=bogus"], {}, "algorithm.loss_agg_mode must be one of token-mean"),
        "kl_coef": (["algorithm.kl_coef=-1"], {}, "algorithm.kl_coef must be >= 0"),
        "logger": (["logging.loggers=[jsonl,bogus]"], {}, "logging.loggers must be one of console, jsonl, wandb, "
                                                           "tensorboard; got 'bogus'"),
        "model_folder": ([f"model.path={tmp}/nope"], {}, f"model.path '{tmp}/nope' is not a folder"),
        "prompt_column": (["task=jsonl", f"task.path={tmp}/no_prompt.jsonl"], {},
                          "task.prompt_key 'prompt' is not a column"),
        "empty_dataset": (["task=jsonl", f"task.path={tmp}/empty.jsonl"], {}, "has no rows"),
        "shard_ranks": (["model.shard_ranks=3"], {}, "model.shard_ranks=3 does not divide the world size 2"),
        "lora_target": (["model.lora.enabled=true", "model.lora.target_modules=[no_such_proj]"], {},
                        "model.lora.target_modules=['no_such_proj']"),
        "router_coef": (["model.router_aux_loss_coef=0.01"], {}, "model.router_aux_loss_coef=0.01 but qwen2 has no "
                        "experts to balance (a mixture-of-experts model only)"),
        "reward_import": (["task.reward=no_such_module_for_distflow:score"], {},
                          "task.reward 'no_such_module_for_distflow:score' cannot be imported"),
        "env_import": (["task.env=no_such_module_for_distflow:Env", "rollout.max_turns=2"], {},
                       "task.env 'no_such_module_for_distflow:Env' cannot be imported"),
        "gpus_visible": ([], {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"},
                         "GPUs are visible or allocated (CUDA_VISIBLE_DEVICES=0,1, SLURM_GPUS_ON_NODE=2) but torch "
                         f"{torch.__version__} is a CPU-only build"),
    }


@contextlib.contextmanager
def _environment(env: dict):
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_one(overrides: list[str], out: Path, env: dict) -> dict:
    from distflow.config import ConfigError
    from distflow.errors import RunAborted, RunComplete
    from distflow.trainer import Trainer

    with _environment(env):
        cfg = compose([*BASE, *overrides, f"run.output_dir={out}"])
        try:
            trainer = Trainer(cfg)
        except ConfigError as e:
            return {"outcome": "refused", "message": str(e)}
        except RunComplete as e:
            return {"outcome": "complete", "message": str(e)}
        try:
            trainer.train()
            result = {"outcome": "trained"}
        except RunAborted as e:
            result = {"outcome": "aborted", "message": str(e)}
        finally:
            trainer.close()
    return result


def _worker(rank, world, tmp):
    results = {}
    for name, folder, overrides, env in cases(Path(tmp)):
        out = Path(tmp) / folder
        if name == "fresh_over_it" and rank == 0:  # the user's own files beside the earlier run's
            for rel, text in FOREIGN.items():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_text(text)
            results["before_fresh"] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        result = _run_one(overrides, out, env)
        result["ranks"] = gathered(result.get("message"))  # what every rank said
        if rank == 0:
            metrics = out / "metrics.jsonl"
            log = out / "logs" / "rank_0.log"
            result["rows"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            result["log"] = log.read_text() if log.is_file() else None
            result["files"] = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
            result["tree"] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) \
                if out.is_dir() else []
        results[name] = result
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("trainer_loop")
    build_reward_model(tiny_model_dir, tmp / "tiny-rm")
    return {**run_distributed(_worker, 2, str(tmp), timeout=900), "tmp": tmp}


def _trained(runs, name, steps=None) -> list[dict]:
    r = runs[name]
    assert r["outcome"] == "trained", (name, r.get("message"), (r.get("log") or "")[-3000:])
    if steps is not None:
        assert [row["step"] for row in r["rows"]] == list(range(1, steps + 1)), (name, r["rows"])
    return r["rows"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_recipe_trains(runs, algorithm):
    rows = _trained(runs, f"algo_{algorithm}", steps=2)
    for key in ["loss/policy", "clip/fraction_low", "clip/fraction_high", *SPECIFIC.get(algorithm, [])]:
        assert key in rows[-1], (algorithm, key)
    assert all(r["sync/max_abs_logprob_diff"] <= 1e-5 for r in rows)
    assert all(math.isfinite(r["loss/policy"]) and r["update/nonfinite_skipped"] == 0 for r in rows)


def test_packed_rows_take_the_step_padded_rows_take(runs):
    """The default packs each group's prompt once (optim.shared_prefix=auto, 4 samples a prompt);
    a run on padded rows draws the same samples and must take the same first step. The padded run
    also measures the KL to a reference (algorithm.kl_metric), which must leave its step alone."""
    packed, padded = _trained(runs, "algo_grpo", steps=2)[0], _trained(runs, "grpo_padded", steps=1)[0]
    for key in ("reward/mean", "response_length/mean", "loss/policy", "grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-8), (key, packed[key], padded[key])
    assert max(packed["sync/max_abs_logprob_diff"], padded["sync/max_abs_logprob_diff"]) <= 1e-5
    assert packed["update/forward_tokens"] < padded["update/forward_tokens"]
    assert "loss/kl" not in packed and padded["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy


def test_models_in_the_loop_train_and_resume_exactly(runs):
    """Distillation: a teacher that is the student gives zero advantage on every token, so no
    gradient at all; a trained teacher (sync_ref's export) gives a positive reverse KL and a
    gradient. With a reward model and a judge scoring beside the reward function, a run stopped
    after step 1 and continued equals one run straight through (the models are frozen: nothing of
    theirs is saved), and resuming with another teacher is refused as another run."""
    for r in _trained(runs, "algo_distill", steps=2):
        assert r["distill/reverse_kl_mean"] == 0.0 and r["distill/reverse_kl_max"] == 0.0, r
        assert r["grad_norm"] == 0.0 and r["update/zero_gradient_skipped"] == 1, r
    straight = _trained(runs, "distill_straight", steps=2)
    assert all(r["distill/reverse_kl_mean"] > 0 and r["grad_norm"] > 0 for r in straight), straight
    assert all(r["distill/reverse_kl_p99"] <= r["distill/reverse_kl_max"] * 1.13 for r in straight), straight
    for r in straight:  # the judge's P(Y) / (P(Y) + P(N)) is in (0, 1); a random classifier's scores vary
        assert 0 < r["judge/self/mean"] < 1 and r["reward_model/tiny-rm/std"] > 0, r
        assert r["timing/score_judge_self_s"] > 0 and r["timing/score_reward_model_tiny-rm_s"] > 0, r
    _trained(runs, "distill_first_half", steps=1)
    refused = runs["distill_other_teacher"]
    assert refused["outcome"] == "refused" and "teacher.path: " in refused["message"], refused
    assert [stable_metrics(r) for r in straight] == [stable_metrics(r) for r in _trained(runs, "distill_continued", steps=2)]


def test_harness_episodes_train_and_resume_exactly(runs):
    """A harness's episodes through each rank's endpoint: two requests each, the first with two
    choices (each episode trains two rows: the second choice is a branch), every request continuing
    its trajectory (no restart), the probe exact after each resync; a run stopped after step 1 and
    continued equals one run straight through (agent.wait=wave: the engine's batches, hence its
    logprobs, do not depend on when the harnesses' requests arrived)."""
    straight = _trained(runs, "agent_straight", steps=2)
    for r in straight:
        assert r["agent/requests_mean"] == 2 and r["turns/mean"] == 2, r
        assert r["agent/restarts"] == r["agent/cut"] == r["agent/failed"] == 0, r
        assert r["agent/branches"] == r["agent/requests"] / 2 > 0, r  # the second choice: a row of its own
        assert r["sync/max_abs_logprob_diff"] <= 1e-5 and r["grad_norm"] > 0, r
    _trained(runs, "agent_first_half", steps=1)
    assert [stable_metrics(r) for r in straight] == [stable_metrics(r) for r in _trained(runs, "agent_continued", steps=2)]


def test_kl_entropy_tis_and_dual_clip_metrics(runs):
    rows = _trained(runs, "kl_tis", steps=2)
    for key in ["loss/kl", "loss/entropy", "rollout_corr/weight_mean", "clip/fraction_dual"]:
        assert key in rows[-1], key
    assert rows[-1]["loss/entropy"] > 0
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert rows[-1]["loss/kl"] > 0
    for r in rows:
        weight, dual = r["rollout_corr/weight_mean"], r["clip/fraction_dual"]
        # The engine samples with the policy's own weights (the probe checks them to 1e-5), so every
        # token's pi_old / pi_engine is ~1, above the cap: the cap fires on every trained token (a token
        # whose engine logprob were misaligned with the trainer's would pull the mean below it). The
        # run sets the cap with the old key algorithm.tis_cap, which still means token-level TIS.
        assert weight == pytest.approx(TIS_CAP, abs=1e-5), r
        assert r["rollout_corr/tokens_clipped_frac"] == 1.0 and r["rollout_corr/tokens_masked_frac"] == 0.0, r
        assert r["rollout_corr/rho_mean"] == pytest.approx(1.0, abs=1e-5), r
        # one on-policy update per step: the ratio is exactly 1, inside the clip range and below the
        # dual-clip bound c = 3 > 1, so no token may be flagged by any clip
        assert dual == 0.0 and r["clip/fraction_low"] == 0.0 and r["clip/fraction_high"] == 0.0, r
        assert r["sync/max_abs_logprob_diff"] <= 1e-5, r


def test_dynamic_sampling_with_an_empty_rank(runs):
    # rank 1's groups always have equal rewards: it keeps nothing and must still run the same number
    # of FSDP passes as rank 0. Rank 0 keeps at most 2 groups a round, so reaching the global target
    # of 4 takes at least 2 rounds (or all 3 when some of its groups tie too).
    for r in _trained(runs, "dapo_empty_rank", steps=2):
        assert r["dynamic_sampling/rounds"] >= 2
        assert r["dynamic_sampling/kept_groups"] >= 4 or r["dynamic_sampling/rounds"] == 3
        assert r["dynamic_sampling/generated_groups"] == 4 * r["dynamic_sampling/rounds"]
        assert r["update/skipped"] == 0 and r["grad_norm"] > 0


def test_carryover_at_eta_0_is_the_sync_run_bit_for_bit(runs):
    """Every group is due where it was admitted: the driver makes the synchronous engine calls, so
    the samples, every metric and the final weights are the sync run's (HF engine, 2 ranks)."""
    sync, carry = _trained(runs, "sync_ref", steps=4), _trained(runs, "carryover_eta0", steps=4)
    partial = {"staleness/mean", "staleness/max", "timing/reprefill_s"} | {k for k in carry[0] if k.startswith("partial/")}
    assert all(r["partial/carried_groups"] == 0 and r["staleness/max"] == 0 for r in carry)
    assert [stable_metrics(r) for r in sync] == [{k: v for k, v in stable_metrics(r).items() if k not in partial}
                                                  for r in carry]
    weights = [(runs["tmp"] / name / "hf_model" / "model.safetensors").read_bytes() for name in ("sync_ref", "carryover_eta0")]
    assert weights[0] == weights[1]
    dapo = [_trained(runs, name, steps=2) for name in ("dapo_empty_rank", "dapo_carryover")]
    assert [stable_metrics(r) for r in dapo[0]] == [{k: v for k, v in stable_metrics(r).items() if k not in partial}
                                                    for r in dapo[1]]


def test_carried_episodes_at_eta_0_are_the_sync_run_and_resume_exactly(runs):
    """Multi-turn episodes are cut between turns: at eta = 0 the sync run bit for bit; at eta = 1 a run
    stopped with episodes carried and continued equals one run straight through."""
    sync, carry = _trained(runs, "tools_sync", steps=3), _trained(runs, "tools_carryover_eta0", steps=3)
    partial = {"staleness/mean", "staleness/max", "timing/reprefill_s"} | {k for k in carry[0] if k.startswith("partial/")}
    assert all(r["turns/mean"] > 1.0 and r["tool/calls"] > 0 for r in sync), sync
    assert [stable_metrics(r) for r in sync] == [{k: v for k, v in stable_metrics(r).items() if k not in partial}
                                                  for r in carry]
    weights = [(runs["tmp"] / n / "hf_model" / "model.safetensors").read_bytes() for n in ("tools_sync", "tools_carryover_eta0")]
    assert weights[0] == weights[1]
    straight = _trained(runs, "tools_carry_straight", steps=4)
    _trained(runs, "tools_carry_first_half", steps=2)
    continued = _trained(runs, "tools_carry_continued", steps=4)
    saved = json.loads((runs["tmp"] / "tools_carry_split" / "checkpoints" / "step_000002" / "rank_0.json").read_text())
    assert saved["carry"]["groups"], "the checkpoint must hold carried episodes for this check"
    assert [stable_metrics(r) for r in straight] == [stable_metrics(r) for r in continued]
    assert all(r["staleness/max"] <= 1 and r["tool/calls"] > 0 for r in straight), straight
    assert any(r["partial/reprefill_tokens"] > 0 for r in straight), straight  # episodes cut between turns


def test_carryover_keeps_its_bound_and_resumes_exactly_with_groups_carried(runs):
    straight = _trained(runs, "carry_straight", steps=6)
    _trained(runs, "carry_first_half", steps=3)
    continued = _trained(runs, "carry_continued", steps=6)
    assert "resumed from step 3" in runs["carry_continued"]["log"]
    saved = json.loads((runs["tmp"] / "carry_split" / "checkpoints" / "step_000003" / "rank_0.json").read_text())
    assert saved["carry"]["groups"], "the checkpoint must hold carried groups for this check"
    assert [stable_metrics(r) for r in straight] == [stable_metrics(r) for r in continued]
    for r in straight:  # eta = 1: a group trains at most one step late, every step trains its quota
        assert r["staleness/max"] <= 1 and r["partial/carried_groups"] > 0 and r["grad_norm"] > 0, r
    assert any(r["staleness/max"] == 1 for r in straight)
    for r in straight:  # the correction's statistics by version lag: carried tokens are one version old
        lags = [r.get(f"rollout_corr/lag{k}/tokens", 0) for k in range(4)]
        assert lags[0] + lags[1] > 0 and lags[2] == lags[3] == 0, r
        assert (lags[1] > 0) == (r["staleness/max"] == 1), r
    for r in _trained(runs, "dapo_eta1", steps=3):  # dynamic sampling's rounds under carry-over
        assert r["staleness/max"] <= 1 and r["dynamic_sampling/rounds"] >= 1 and r["update/nonfinite_skipped"] == 0, r


def test_everything_filtered_skips_the_update(runs):
    rows = _trained(runs, "dapo_all_filtered", steps=2)
    assert "every group was filtered out; update skipped" in runs["dapo_all_filtered"]["log"]
    for r in rows:
        assert r["update/skipped"] == 1 and r["dynamic_sampling/kept_groups"] == 0
        assert r["dynamic_sampling/rounds"] == 2


def test_ppo_critic_warmup_and_a_bit_exact_resume(runs):
    a = _trained(runs, "ppo_straight", steps=4)
    _trained(runs, "ppo_first_half", steps=2)
    b = _trained(runs, "ppo_continued", steps=4)
    assert "resumed from step 2" in runs["ppo_continued"]["log"]
    # step 1 trains only the critic; later steps train both
    assert a[0]["update/actor_skipped"] == 1 and a[0]["grad_norm"] == 0 and a[0]["critic/grad_norm"] > 0
    assert all(r["update/actor_skipped"] == 0 and r["grad_norm"] > 0 for r in a[1:])
    assert all(k in a[-1] for k in ("value/loss", "value/clip_fraction", "value/mean", "value/rmse"))
    assert a[-1]["value/rmse"] < a[0]["value/rmse"]  # the critic learns the returns at lr 1e-3
    # critic weights, both optimizers and schedules restored exactly; metrics.jsonl kept steps 1-2
    assert [stable_metrics(r) for r in a] == [stable_metrics(r) for r in b]


def test_a_finished_run_is_not_retrained_and_another_run_is_refused(runs):
    again, other = runs["ppo_again"], runs["ppo_other_seed"]
    assert again["outcome"] == "complete" and again["ranks"] == [again["message"]] * 2
    assert "already at step 4 of run.steps=4; nothing to train" in again["message"]
    assert again["rows"] == runs["ppo_continued"]["rows"]  # metrics.jsonl untouched
    assert other["outcome"] == "refused" and other["ranks"] == [other["message"]] * 2
    assert "holds a different run (run.seed: 0 -> 1)" in other["message"]
    assert other["log"] == again["log"]  # refused before anything was written


def test_a_hanging_reward_costs_at_most_its_timeout_per_call(runs):
    """rewards_for_tests:hang_sometimes never returns on ~1 completion in 6. With a 1 s timeout the run
    finishes, the hangs are counted, and each step's reward time stays within the timeout per hang."""
    rows = _trained(runs, "hanging_reward", steps=3)
    assert sum(r["reward/timeouts"] for r in rows) > 0, rows
    assert all(r["reward/errors"] == 0 and r["reward/invalid"] == 0 for r in rows), rows
    for r in rows:
        # Without hangs scoring takes ~0.01 s a step. Timeouts are summed over ranks and the reward time
        # is the slowest rank's, so this allows the full timeout for every hang plus 4 s for when both
        # workers of a rank hang at once and the rest waits for a replacement to start.
        assert r["timing/reward_s"] <= 1.0 * r["reward/timeouts"] + 4.0, r
    assert "timed out" in runs["hanging_reward"]["log"]


def test_length_balancing_moves_groups_and_keeps_the_step(runs):
    off, on = _trained(runs, "balance_off", steps=2), _trained(runs, "balance_on", steps=2)
    for rows in (off, on):  # run.sync_probe_every=5: a probe at step 1, none at step 2
        assert rows[0]["sync/max_abs_logprob_diff"] <= 1e-5 and math.isnan(rows[1]["sync/max_abs_logprob_diff"])
    on, off = on[0], off[0]
    assert on["balance/moved_groups"] > 0 and on["balance/tokens_after_max"] < on["balance/tokens_before_max"]
    # the same samples were generated and scored (summed in float32 on other ranks: rounding differs)
    assert on["reward/mean"] == pytest.approx(off["reward/mean"], rel=1e-6)
    for key in ("loss/policy", "grad_norm"):
        assert abs(on[key] - off[key]) <= 1e-5 * max(abs(off[key]), 1e-8), (key, on[key], off[key])


def test_a_lagging_rank_shows_in_the_wait_clock_and_is_named(runs):
    rows = _trained(runs, "straggler", steps=3)
    for r in rows:
        assert 0 <= r["timing/wait_min_s"] <= r["timing/wait_s"] < r["timing/step_s"], r
        assert r["timing/compute_min_s"] <= r["timing/compute_s"] <= r["timing/step_s"], r
        assert r["timing/update_min_s"] <= r["timing/update_s"] and r["timing/slowest_rank"] in (0, 1), r
    # rank 1 sleeps 1.5 s before each update from step 2: rank 0 waits for it at the update's first
    # collective (the bounds leave room for the ranks' own noise on a loaded machine)
    for r in rows[1:]:
        assert r["timing/wait_s"] >= 1.0 and r["timing/wait_s"] - r["timing/wait_min_s"] >= 0.5, r
        assert r["timing/slowest_rank"] == 1 and r["timing/compute_s"] - r["timing/compute_min_s"] >= 0.5, r
    # step 1 may already have found rank 1 slower by chance, so the streak of 2 ends on step 2 or 3
    log = runs["straggler"]["log"]
    assert "step 2: rank 1 was the slowest for 2 consecutive steps" in log or \
        "step 3: rank 1 was the slowest for 2 consecutive steps" in log, log[-3000:]


def test_nonfinite_steps_in_a_row_stop_every_rank(runs):
    r = runs["nan_streak"]
    message = ("step 3: the loss or gradient norm was not finite for 2 consecutive steps (run.max_nonfinite_steps); "
               "stopping")
    assert r["outcome"] == "aborted" and r["ranks"] == [message, message], r["ranks"]
    assert [row["step"] for row in r["rows"]] == [1, 2, 3]
    assert [row["update/nonfinite_skipped"] for row in r["rows"]] == [0.0, 1.0, 1.0]
    assert "checkpoints" not in r["files"]  # no checkpoint of a run that stopped


def test_an_engine_that_does_not_hold_the_policy_stops_the_run(runs):
    """One tensor left out of a resync (the embedding, trained at lr 1e-2): the probe after it stops
    every rank with the same line, at step 1 of a fresh run and at the start-up of a resumed one,
    before any step trains on it; run.allow_engine_mismatch turns the stop into a warning."""
    step, resumed = runs["stale_step"], runs["stale_resumed"]
    for r, when in ((step, "step 1: "), (resumed, "start-up: ")):
        assert r["outcome"] == "aborted" and r["ranks"][0] == r["ranks"][1], r["ranks"]
        line = r["ranks"][0]
        assert line.startswith(f"{when}the engine's logprobs differ from the policy's by up to ") and "(qwen2, float32;" \
            in line and line.endswith("run.allow_engine_mismatch=true trains anyway"), line
        assert float(line.split("by up to ")[1].split()[0]) > 1e-3, line
    assert step["rows"] == [] and "checkpoints" not in step["files"]  # stopped inside step 1
    assert [row["step"] for row in resumed["rows"]] == [1]  # the resumed run stopped before its step 2
    assert "resumed from step 1" in resumed["log"]
    rows = _trained(runs, "stale_allowed", steps=1)
    assert rows[0]["sync/max_abs_logprob_diff"] > 1e-3
    assert "step 1: the engine's logprobs differ" in runs["stale_allowed"]["log"]
    # a healthy run: the start-up probe reads float32 noise, within its bound
    line = next(x for x in runs["stale_first"]["log"].splitlines() if "start-up probe (float32): " in x)
    assert line.endswith(", within the float32 bound 0.001") and "max |engine - policy| logprob " in line, line
    assert float(line.split("logprob ")[1].split(",")[0]) <= 1e-5, line


def test_run_device_cpu_trains_on_a_machine_that_shows_gpus(runs):
    _trained(runs, "cpu_on_gpu_machine", steps=1)


def test_a_fresh_start_sets_an_earlier_lora_and_wandb_run_aside_and_nothing_else(runs):
    earlier = _trained(runs, "lora_wandb", steps=1)
    # the engine got base + adapters merged: it computes what the LoRA policy computes
    assert earlier[0]["sync/max_abs_logprob_diff"] <= 1e-5 and earlier[0]["grad_norm"] > 0, earlier
    assert "summary.json" in runs["lora_wandb"]["files"]
    written = [f for f in runs["before_fresh"] if f not in FOREIGN]
    for artifact in (".distflow-run", "config.json", "metrics.jsonl", "summary.json", "training.png", "wandb_run_id",
                     "logs/rank_0.log", "logs/rank_1.log", "hf_model/model.safetensors",
                     "adapter/adapter_model.safetensors"):
        assert artifact in written, (artifact, written)
    for folder in ("checkpoints/step_000001/", "wandb/", "tb/"):
        assert any(f.startswith(folder) for f in written), (folder, written)
    _trained(runs, "fresh_over_it", steps=1)
    tree = runs["fresh_over_it"]["tree"]
    (stamp,) = {f.split("/")[1] for f in tree if f.startswith("previous/")}
    # every file the earlier run wrote moved, exactly where it was below previous/<time>/
    assert sorted(f.split("/", 2)[2] for f in tree if f.startswith("previous/")) == written
    # the user's files stayed, and the new run has its own artifacts
    assert all(f in tree for f in FOREIGN)
    assert {"config.json", "metrics.jsonl", ".distflow-run", "logs/rank_0.log"} <= set(tree)
    assert not any(f.startswith(("wandb", "tb/", "adapter/", "hf_model/")) for f in tree), tree
    assert f"were moved to {runs['tmp'] / 'reused' / 'previous' / stamp}" in runs["fresh_over_it"]["log"]


@pytest.mark.parametrize("name", sorted(REFUSALS(Path("."))))
def test_every_rank_refuses_before_any_weights_load(runs, name):
    r, needle = runs[f"refuse_{name}"], REFUSALS(runs["tmp"])[name][2]
    assert r["outcome"] == "refused" and r["ranks"] == [r["message"]] * 2 and needle in r["message"], r["ranks"]
    assert r["log"] is None or "loading weights" not in r["log"], r["log"]
    if name in ("group_size_1", "clip_range", "agg_mode", "kl_coef", "logger", "model_folder", "gpus_visible"):
        assert r["files"] == [] and r["log"] is None  # config-only: refused before anything was written
