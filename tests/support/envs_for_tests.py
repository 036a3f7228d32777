"""Environments used by the tests (loaded with task.env=envs_for_tests:NAME).

A random tiny model never writes a well-formed tool call, so `ScriptedToolEnv` stands in for
the model's first turn with a scripted calculator call whose expression depends on what the
model generated; the real ToolEnv then parses it, runs the tool and answers. Every episode thus
has two turns with a real tool observation in between, deterministically.
"""

from __future__ import annotations

import os
import signal
import time

from distflow.tasks.envs import Step, ToolEnv


class ScriptedToolEnv(ToolEnv):
    """Turn 1: calculator on (characters of the model's turn) * 7 + the answer; turn 2 ends with a
    reward of 0.05 per character of it (a reward that varies for a random model)."""

    def step(self, item: dict, transcript: list[dict]) -> Step:
        text = transcript[-1]["content"]
        if len(transcript) == 1:
            expr = f"{len(text)} * 7 + {item['answer']}"
            call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
            return super().step(item, [{"role": "assistant", "content": call}])
        return Step(reward=0.05 * len(text), done=True)


class OddToolEnv(ScriptedToolEnv):
    """ScriptedToolEnv's round trip for items with an odd answer; an even one ends after the first
    turn. Episodes of one step then take one or two turns, so a carry-over step can stop between
    them with episodes open."""

    def step(self, item: dict, transcript: list[dict]) -> Step:
        if int(item["answer"]) % 2 == 0:
            return Step(reward=0.05 * len(transcript[-1]["content"]), done=True)
        return super().step(item, transcript)


class EchoEnv:
    """A plain environment (no tools): echoes the length of each turn as a user message, forever.
    `mode` misbehaves on turn 2 of items whose answer is in `on` ("hang", "kill", "raise", "bad"); every
    step takes `delay` seconds at least (a slow tool)."""

    def __init__(self, mode: str = "", on: tuple = (), prefix: str = "", delay: float = 0.0):
        self.mode, self.on, self.prefix, self.delay = mode, {str(a) for a in on}, prefix, delay

    def reset(self, item: dict, messages: list[dict]) -> list[dict]:
        return [*messages[:-1], {"role": messages[-1]["role"], "content": self.prefix + messages[-1]["content"]}]

    def step(self, item: dict, transcript: list[dict]):
        time.sleep(self.delay)
        if len(transcript) >= 3 and str(item["answer"]) in self.on:
            if self.mode == "hang":
                while True:
                    time.sleep(60)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "raise":
                raise RuntimeError("deliberate environment failure")
            if self.mode == "bad":
                return "not a Step"
        return Step([{"role": "user", "content": f"{len(transcript[-1]['content'])} characters; go on"}],
                    reward=0.5)


class EnvironEnv:
    """Answers every turn with what its worker process sees: the names and values of its environment
    variables and the size of its `blob` argument (a large task.env_args must arrive whole)."""

    def __init__(self, blob: str = ""):
        self.blob = blob

    def reset(self, item: dict, messages: list[dict]) -> list[dict]:
        return messages

    def step(self, item: dict, transcript: list[dict]) -> Step:
        import json

        seen = {"environ": dict(os.environ), "blob_chars": len(self.blob), "blob_tail": self.blob[-16:]}
        return Step([{"role": "user", "content": json.dumps(seen)}], done=True)
