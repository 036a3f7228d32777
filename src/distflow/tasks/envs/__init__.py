"""Environments: what answers the model's turns in a multi-turn episode (distflow.rollout.episodes).

`task.env` names the class ("tools" for `ToolEnv`, or "package.module:Class"); it is built
with `task.env_args` as keyword arguments, once in the trainer's process (by its Task,
distflow.tasks.task) and once in each worker process of the task. Two methods:

    class MyEnv:
        def reset(self, item: dict, messages: list[dict]) -> list[dict]:
            # The episode's first messages, from the dataset row and the messages its prompt
            # column gave (task.system_prompt included). Runs where the dataset loads, in the
            # trainer's process: it must be quick and deterministic.
        def step(self, item: dict, transcript: list[dict]) -> Step:
            # transcript: the messages after the first ones, ending with the model's latest turn
            # ({"role": "assistant", "content": text}). Returns the observation messages to
            # append (tool results, a user's reply), a reward contribution, and done.

`step` runs in the reward pool's worker processes under task.reward_timeout_s: a step that
hangs or kills its worker ends that episode (counted in tool/timeouts or tool/errors) and the
worker is replaced; no rank stalls. Environments keep no state between calls: the transcript
is the state, so any worker can take any step and a replaced worker loses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from distflow.config import ConfigError
from distflow.config.specs import resolve
from distflow.tasks.envs.calculator import Calculator
from distflow.tasks.envs.parsers import ToolCallError, load_parser
from distflow.tasks.envs.python_tool import STARTUP_ALLOWANCE_S, PythonExecutor
from distflow.tasks.envs.tools import Tool, truncate


@dataclass
class Step:
    """An environment's answer to one model turn."""

    messages: list[dict] = field(default_factory=list)  # appended after the turn; [] with done
    reward: float = 0.0  # added to the episode's reward (with the task's reward on the final turn)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, tools that failed
    tool_timeouts: int = 0


TOOLS_INSTRUCTION = (
    "To call a tool, write <tool_call>{{\"name\": NAME, \"arguments\": {{...}}}}</tool_call> and end your turn; "
    "its result comes back in a tool message. Reply without a tool call to give the answer. Tools:\n{tools}"
)


class ToolEnv:
    """The built-in tool-using environment (task.env=tools).

    A model turn with tool calls (parsed by `parser`: "hermes" = Qwen2/Hermes
    `<tool_call>{json}</tool_call>`, or "package.module:function") gets one tool message per
    call back; a turn without one is the final answer and ends the episode (the task's reward
    scores it). A malformed call or an unknown tool is answered with an error message the model
    can read, and counted; every output is cut at max_output_chars with a marker.

    `demo`: messages of a worked example (a user turn, the model's call, the tool's answer, the
    model's answer) put before the episode's own messages: a small model that never calls a
    tool from the instructions alone does from one example.

    `max_calls_per_turn`: calls of a tool that runs under timeout_s (the python tool) one turn
    may make; the ones past it are answered with an error, not run. A turn's step must end within
    task.reward_timeout_s, which the reward pool checks at start-up (check_step_timeout).
    `allow_unisolated`: let the python tool run without a sandbox where none works (its code then
    runs with the worker's rights; see distflow.tasks.envs.python_tool).
    """

    def __init__(self, tools: list[str] = ("calculator",), parser: str = "hermes", timeout_s: float = 5.0,
                 memory_mib: int = 512, max_output_chars: int = 2000, demo: list[dict] = (),
                 max_calls_per_turn: int = 1, allow_unisolated: bool = False):
        if not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ConfigError(f"task.env_args.max_calls_per_turn must be an integer >= 1, got {max_calls_per_turn!r}")
        self.tools = build_tools(list(tools), timeout_s=timeout_s, memory_mib=memory_mib,
                                 max_output_chars=max_output_chars, allow_unisolated=allow_unisolated)
        self.max_calls_per_turn = max_calls_per_turn
        self.parse = load_parser(parser)
        self.max_output_chars = max_output_chars
        self.demo = [{"role": str(m["role"]), "content": str(m["content"])} for m in demo]

    def instruction(self) -> str:
        lines = [f"- {t.name} {_signature(t.parameters)}: {t.description}" for t in self.tools.values()]
        return TOOLS_INSTRUCTION.format(tools="\n".join(lines))

    def reset(self, item: dict, messages: list[dict]) -> list[dict]:
        """The tool instructions go first in the system message (a new one if there is none), then
        the demonstration, then the episode's messages."""
        system = self.instruction()
        if messages and messages[0]["role"] == "system":
            system, messages = f"{system}\n\n{messages[0]['content']}", messages[1:]
        return [{"role": "system", "content": system}, *self.demo, *messages]

    def step(self, item: dict, transcript: list[dict]) -> Step:
        try:
            calls = self.parse(transcript[-1]["content"])
        except ToolCallError as e:
            return Step([self._message(f"error: {e}")], tool_calls=1, tool_errors=1)
        if not calls:
            return Step(done=True)
        step, timed = Step(tool_calls=len(calls)), 0
        for call in calls:
            tool = self.tools.get(call.name)
            if tool is None:
                step.tool_errors += 1
                step.messages.append(self._message(f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}"))
                continue
            if getattr(tool, "max_call_s", None) is not None:
                timed += 1
                if timed > self.max_calls_per_turn:
                    step.tool_errors += 1
                    step.messages.append(self._message(
                        f"error: not run; a turn may make at most {self.max_calls_per_turn} {call.name} call(s)"))
                    continue
            result = tool(call.arguments)
            step.tool_errors += result.error and not result.timed_out
            step.tool_timeouts += result.timed_out
            step.messages.append(self._message(result.output))
        return step

    def _message(self, text: str) -> dict:
        return {"role": "tool", "content": truncate(text, self.max_output_chars)}

    def check_step_timeout(self, step_timeout_s: float) -> None:
        """A ConfigError when a turn's calls could outlast the reward pool's limit on a step (the worker
        would be killed in the middle of the turn, and the episode lost)."""
        slowest = max((t.max_call_s for t in self.tools.values() if getattr(t, "max_call_s", None)), default=0.0)
        if slowest and self.max_calls_per_turn * slowest >= step_timeout_s:
            raise ConfigError(
                f"task.env_args.max_calls_per_turn={self.max_calls_per_turn} python calls of up to {slowest:g} s "
                f"each (timeout_s + {STARTUP_ALLOWANCE_S:g} s start-up) do not fit in task.reward_timeout_s="
                f"{step_timeout_s:g}: lower max_calls_per_turn or timeout_s, or raise task.reward_timeout_s")


def _signature(schema: dict) -> str:
    """A tool's arguments object in one short line, e.g. {"expression": string}."""
    props = schema.get("properties", {})
    return "{" + ", ".join(f"{json.dumps(k)}: {v.get('type', 'any')}" for k, v in props.items()) + "}"


BUILTIN_TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonExecutor}


def build_tools(
    names: list[str], *, timeout_s: float = 5.0, memory_mib: int = 512, max_output_chars: int = 2000,
    allow_unisolated: bool = False,
) -> dict[str, Tool]:
    """The named built-in tools, by name; ConfigError for an unknown or repeated name."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"unknown tool {name!r}; the built-in tools are {', '.join(BUILTIN_TOOLS)}")
        if name in tools:
            raise ConfigError(f"tool {name!r} is listed twice")
        if name == "python":
            tools[name] = PythonExecutor(timeout_s=timeout_s, memory_mib=memory_mib, max_output_chars=max_output_chars,
                                         allow_unisolated=allow_unisolated)
        else:
            tools[name] = BUILTIN_TOOLS[name](max_output_chars=max_output_chars)
    return tools


BUILTIN_ENVS = {"tools": ToolEnv}


def load_env_class(spec: str) -> type:
    return resolve(spec, BUILTIN_ENVS, "task.env", form="module:Class")


def build_env(spec: str, args: dict):
    """An environment instance; any problem building it is a one-line ConfigError."""
    cls = load_env_class(spec)
    try:
        env = cls(**args)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - unknown or bad keyword arguments, or the class's own checks
        raise ConfigError(f"task.env {spec!r} with task.env_args {args}: {type(e).__name__}: {e}") from e
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(f"task.env {spec!r} has no {method}() method (see distflow.tasks.envs)")
    return env
