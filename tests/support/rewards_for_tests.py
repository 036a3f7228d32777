"""Custom rewards used by end-to-end tests (loaded via task.reward=rewards_for_tests:NAME)."""


def digit_fraction(prompt, completion, completion_ids, item):
    """Varies across samples even for a random model, so every step has a non-zero gradient."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


# --- RewardPool tests: one function whose misbehaviour is chosen per call by item["mode"] ---
def misbehave(prompt, completion, completion_ids, item):
    """Returns float(len(completion)) when item["mode"] is "ok"; otherwise misbehaves as named."""
    import math
    import os
    import signal
    import time

    mode = item.get("mode", "ok")
    if mode == "raise":
        raise ValueError("deliberate failure in misbehave")
    if mode == "hang":
        while True:
            time.sleep(60)
    if mode == "exit":
        os._exit(1)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    return {"nan": math.nan, "inf": math.inf, "none": None, "str": "1.0", "list": [1.0],
            "true": True}.get(mode, float(len(completion)))


def slow_ok(prompt, completion, completion_ids, item):
    """Sleeps item["sleep"] seconds, then returns 1.0."""
    import time

    time.sleep(item.get("sleep", 0.0))
    return 1.0


def pid(prompt, completion, completion_ids, item):
    """The worker's process id, to see calls spread over workers and workers replaced."""
    import os

    return float(os.getpid())


class _Unpicklable:
    def __call__(self, prompt, completion, completion_ids, item):
        return 2.0

    def __reduce__(self):
        raise TypeError("not picklable")


unpicklable = _Unpicklable()  # must work: workers resolve the spec by name, nothing is pickled


def flat_on_rank1(prompt, completion, completion_ids, item):
    """All-equal rewards for every group generated on rank 1 (reward workers inherit RANK)."""
    import os

    return 0.0 if os.environ.get("RANK") == "1" else digit_fraction(prompt, completion, completion_ids, item)


def constant(prompt, completion, completion_ids, item):
    return 1.0


def hang_sometimes(prompt, completion, completion_ids, item):
    """Hangs forever on about one completion in six (chosen by a hash of its text, so the same
    completion always hangs), else digit_fraction: the pool's timeout must keep the run moving."""
    import time
    import zlib

    if zlib.crc32(completion.encode("utf-8", "replace")) % 6 == 0:
        while True:
            time.sleep(60)
    return digit_fraction(prompt, completion, completion_ids, item)
