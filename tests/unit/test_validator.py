"""The validator decides when held-out evaluation runs; the trainer only asks after each step."""

from distflow.config import ValidationConfig
from distflow.rollout import Validator


def _calls(v: ValidationConfig, steps: int, resumed_at: int = 0) -> tuple[list[int], dict]:
    ran: list[int] = []
    state = {"step": resumed_at}

    def evaluate(tag: str):
        assert tag == ("before" if state["step"] == 0 else "after" if state["step"] == steps else f"step{state['step']}")
        ran.append(state["step"])
        return {"val/pass@1": float(state["step"])}

    val = Validator(v, steps, evaluate)
    val.before_training(resumed_at)
    for s in range(resumed_at + 1, steps + 1):
        state["step"] = s
        out = val.after_step(s)
        assert (out != {}) == (s in ran[-1:]), (s, out, ran)
    return ran, val.evaluations


def test_before_every_and_at_end():
    ran, evals = _calls(ValidationConfig(before_train=True, every=2, at_end=True), 5)
    assert ran == [0, 2, 4, 5]  # the last step evaluates once, as "after"
    assert evals == {"before": {"val/pass@1": 0.0}, "after": {"val/pass@1": 5.0}}


def test_every_step_that_is_also_the_last_counts_once():
    ran, evals = _calls(ValidationConfig(before_train=False, every=2, at_end=True), 4)
    assert ran == [2, 4] and set(evals) == {"after"}


def test_off_at_the_end_and_not_again_after_a_resume():
    ran, evals = _calls(ValidationConfig(before_train=True, every=0, at_end=False), 3)
    assert ran == [0] and set(evals) == {"before"}
    ran, _ = _calls(ValidationConfig(before_train=True, every=0, at_end=True), 3, resumed_at=2)
    assert ran == [3]  # a resumed run does not evaluate "before" again
