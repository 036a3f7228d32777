"""A reward that holds a run at its first scoring until a test opens the gate: the file named by
DISTFLOW_TEST_GATE exists (at most 60 s). A test uses it to act while a run is surely live."""

from __future__ import annotations

import os
import time

from rewards_for_tests import digit_fraction


def digit_fraction_after_gate(prompt, completion, completion_ids, item):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["DISTFLOW_TEST_GATE"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return digit_fraction(prompt, completion, completion_ids, item)
