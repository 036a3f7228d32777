"""An environment with a fixed latency per turn, for benchmarks: each model turn but the last is answered
after `delay` seconds with a short user message, so every episode takes `turns` turns and spends
(turns - 1) x delay at the environment (a tool call's or a sandbox's round trip)."""

from __future__ import annotations

import time

from distflow.tasks.envs import Step


class SlowEnv:
    def __init__(self, delay: float = 0.05, turns: int = 3):
        self.delay, self.turns = delay, turns

    def reset(self, item: dict, messages: list[dict]) -> list[dict]:
        return messages

    def step(self, item: dict, transcript: list[dict]) -> Step:
        time.sleep(self.delay)
        if sum(m["role"] == "assistant" for m in transcript) >= self.turns:
            return Step(done=True)
        return Step([{"role": "user", "content": "go on"}])
