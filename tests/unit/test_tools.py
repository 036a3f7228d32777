"""Tool-call parsing and the built-in tools; the python tool runs real sandboxed subprocesses."""

from __future__ import annotations

import os
import time

import pytest

from distflow.config import ConfigError
from distflow.tasks.envs.parsers import PARSERS, ToolCall, ToolCallError, hermes_tool_calls, load_parser
from distflow.tasks.envs import BUILTIN_TOOLS, build_tools
from distflow.tasks.envs.calculator import Calculator
from distflow.tasks.envs.python_tool import PythonExecutor
from distflow.tasks.envs.tools import ToolResult, truncate


class FallbackExecutor(PythonExecutor):
    """The python tool where no sandbox works and the environment allows that (allow_unisolated), on a machine
    without user namespaces: the audit-hook network block only."""

    _mechanisms = ()
    _try_netns = False

    def __init__(self, **kwargs):
        super().__init__(allow_unisolated=True, **kwargs)


@pytest.fixture(scope="module")
def python() -> PythonExecutor:
    return PythonExecutor(timeout_s=5)


@pytest.fixture(scope="module")
def quick() -> PythonExecutor:
    return PythonExecutor(timeout_s=1, max_output_chars=100)


# --- parser ------------------------------------------------------------------------------------------------------


def test_hermes_single_and_multiple_calls_in_order():
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert hermes_tool_calls(text) == [ToolCall("calculator", {"expression": "2+2"})]
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and then '
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call> done'
    )
    assert hermes_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]})]


def test_hermes_string_arguments_whitespace_and_missing_arguments():
    text = '<tool_call>\n  {"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
    assert hermes_tool_calls(text) == [ToolCall("python", {"code": "print(1)"})]
    assert hermes_tool_calls('<tool_call>\n{"name": "noargs"}\n\n</tool_call>') == [ToolCall("noargs", {})]


def test_hermes_no_call():
    assert hermes_tool_calls("The answer is 42.") == []
    assert hermes_tool_calls("") == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "a", "arguments": {', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', "non-empty string"),
        ('{"name": 3, "arguments": {}}', "non-empty string"),
        ('{"name": "a", "arguments": [1]}', "must be a JSON object, got list"),
        ('{"name": "a", "arguments": null}', "must be a JSON object, got NoneType"),
        ('{"name": "a", "arguments": "[1]"}', "must be a JSON object, got list"),
        ('{"name": "a", "arguments": "{oops"}', "(a string) is not valid JSON"),
    ],
)
def test_hermes_malformed_calls_raise(body, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hermes_tool_calls(f"ok <tool_call>{body}</tool_call>")


def test_hermes_unclosed_call_raises():
    with pytest.raises(ToolCallError, match="without a closing </tool_call>"):
        hermes_tool_calls('<tool_call>{"name": "a", "arguments": {}}')
    with pytest.raises(ToolCallError, match="closing"):  # one good call does not excuse a broken one after it
        hermes_tool_calls('<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b"}')


def test_load_parser():
    assert load_parser("hermes") is hermes_tool_calls is PARSERS["hermes"]
    assert load_parser("distflow.tasks.envs.parsers:hermes_tool_calls") is hermes_tool_calls


@pytest.mark.parametrize(
    "spec, message",
    [
        ("qwen", "neither a built-in"),
        ("no_such_module_for_tests:fn", "cannot be imported"),
        ("distflow.tasks.envs.parsers:no_such_function", "cannot be imported"),
        ("distflow.tasks.envs.parsers:OPEN_TAG", "not callable"),
    ],
)
def test_load_parser_bad_specs(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_parser(spec)
    assert "\n" not in str(e.value)


# --- truncate ------------------------------------------------------------------------------------------------------


def test_truncate_boundary():
    assert truncate("abcde", 5) == "abcde"
    assert truncate("abcdef", 5) == "abcde\n...[truncated 1 chars]"
    assert truncate("x" * 100, 10) == "x" * 10 + "\n...[truncated 90 chars]"
    assert truncate("", 3) == ""


# --- calculator ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, output",
    [
        ("123456789*987654321", str(123456789 * 987654321)),
        ("2**100", str(2**100)),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-3**2", "-9"),
        ("-(2 - 5)", "3"),
        ("+4 - -1", "5"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1.5 * 4", "6"),
        ("1e20", "1e+20"),
        ("2**-2", "0.25"),
        (" 2 ** 0.5 ", "1.4142135623730951"),
    ],
)
def test_calculator_values(expression, output):
    assert Calculator()({"expression": expression}) == ToolResult(output)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("10**999 * 10", "more than 1000 digits"),
        ("2**1001", "exponent"),
        ("(-8) ** (1/3)", "not a real number"),
        ("10.0 ** 400", "too large"),
        ("2 *", "invalid syntax"),
        ("__import__('os')", "Call is not allowed"),
        ("x + 1", "unknown name 'x'"),
        ("abs(-1)", "Call is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("True + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1 < 2", "Compare is not allowed"),
        ("-" * 1500 + "1", "nested too deeply"),
    ],
)
def test_calculator_errors(expression, message):
    result = Calculator()({"expression": expression})
    assert result.error and result.output.startswith("error: ") and message in result.output


def test_calculator_refuses_huge_powers_quickly():
    start = time.monotonic()
    result = Calculator()({"expression": "9**9**9"})
    assert result.error and "exponent" in result.output
    assert time.monotonic() - start < 1


def test_calculator_bad_arguments_and_output_limit():
    assert Calculator()({}) == ToolResult('error: missing argument "expression"', error=True)
    assert Calculator()({"expression": 3}).error
    limited = Calculator(max_output_chars=10)({"expression": "10**20"})
    assert limited.output == "1" + "0" * 9 + "\n...[truncated 11 chars]"


# --- python --------------------------------------------------------------------------------------------------------


def test_python_prints(python):
    assert python({"code": "print(6*7)"}) == ToolResult("42\n")
    assert python({"code": "print('é→😀')"}).output == "é→😀\n"
    assert python({"code": "import sys; sys.stdout.buffer.write(b'\\xff!')"}).output == "\ufffd!"


def test_python_exception_is_an_error_with_the_traceback(python):
    result = python({"code": "print('before')\n1/0"})
    assert result.error and not result.timed_out
    assert "before\n" in result.output and "ZeroDivisionError" in result.output and "1/0" in result.output
    result = python({"code": "import sys; sys.exit(3)"})
    assert result.error and "exit code 3" in result.output
    assert "SyntaxError" in python({"code": "def f(:"}).output


def test_python_timeout_kills_the_program(quick):
    start = time.monotonic()
    result = quick({"code": "print('partial')\nwhile True: pass"})
    assert time.monotonic() - start < 3
    assert result.timed_out and result.error
    assert result.output.startswith("error: timed out after 1s") and "partial" in result.output


def test_python_output_flood_is_truncated(quick):
    start = time.monotonic()
    result = quick({"code": "while True: print('x' * 10**6)"})
    assert time.monotonic() - start < 3
    assert result.timed_out and "x" * 100 + "\n...[truncated " in result.output
    assert len(result.output) < 200


def test_python_memory_limit(python):
    result = python({"code": "x = bytearray(10**10)"})
    assert result.error and "MemoryError" in result.output
    small = PythonExecutor(memory_mib=64)
    assert small({"code": "x = [b' ' * 2**20 for _ in range(200)]"}).error


@pytest.mark.parametrize("executor", [PythonExecutor, FallbackExecutor], ids=["default", "fallback"])
@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket; socket.socket().connect(('1.1.1.1', 80))",
        "import _socket; s = _socket.socket(); s.connect(('1.1.1.1', 80))",
    ],
)
def test_python_has_no_network(executor, code):
    result = executor(timeout_s=5)({"code": code})
    assert result.error and not result.timed_out
    assert "Network is unreachable" in result.output or "network is disabled in the sandbox" in result.output


def test_python_network_mechanism():
    """In the sandbox sockets exist but reach nothing (only a loopback device, down); the fallback refuses them."""
    code = "import socket; socket.socket().close(); print(socket.if_nameindex())"
    isolated, fallback = PythonExecutor()({"code": code}), FallbackExecutor()({"code": code})
    assert "network is disabled in the sandbox" in fallback.output
    assert isolated.output == "[(1, 'lo')]\n"


def test_python_fallback_keeps_local_tools_but_refuses_programs():
    tool = FallbackExecutor()
    assert tool({"code": "import asyncio; asyncio.run(asyncio.sleep(0)); print('ok')"}).output == "ok\n"
    result = tool({"code": "import subprocess; subprocess.run(['true'])"})
    assert result.error and "starting programs is disabled" in result.output
    assert "disabled" in tool({"code": "import ctypes; ctypes.CDLL(None).socket(2, 1, 0)"}).output


def test_python_runs_in_a_private_temporary_folder_with_a_minimal_environment(python):
    code = ("import os; print(os.path.exists('scratch.txt')); open('scratch.txt', 'w').write('x'); "
            "print(os.getcwd(), sorted(os.environ), os.environ['HOME'])")
    first, second = python({"code": code}).output, python({"code": code}).output
    assert first == second == "False\n/tmp ['HOME', 'LANG', 'LC_ALL', 'PATH'] /tmp\n"  # nothing persists
    assert not os.path.exists("/tmp/scratch.txt")


def test_python_fallback_runs_in_a_temporary_directory_removed_afterwards():
    code = "import os; open('scratch.txt', 'w').write('x'); print(os.getcwd()); print(sorted(os.environ))"
    cwd, env = FallbackExecutor()({"code": code}).output.splitlines()
    assert os.path.basename(cwd).startswith("distflow-python-") and cwd != os.getcwd()
    assert not os.path.exists(cwd)
    assert "PATH" in env and "HOME" not in env and "VIRTUAL_ENV" not in env


def test_python_fallback_kills_the_whole_process_group():
    python = FallbackExecutor()
    code = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\nprint(pid)"
    pid = int(python({"code": code}).output)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # dead, waiting for its new parent to reap it
        except FileNotFoundError:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the program's child {pid} outlived the call")


def test_python_program_killed_by_a_signal(python):
    result = python({"code": "import os; os.kill(os.getpid(), 9)"})
    assert result == ToolResult("error: killed by SIGKILL", error=True)


def test_python_bad_arguments(python):
    assert python({}) == ToolResult('error: missing argument "code"', error=True)
    assert python({"code": ["print(1)"]}).error
    assert python({"code": "x" * 200_000}).error


# --- build_tools ---------------------------------------------------------------------------------------------------


def test_build_tools():
    tools = build_tools(["calculator", "python"], timeout_s=2.5, memory_mib=256, max_output_chars=50)
    calculator, python = tools["calculator"], tools["python"]
    assert isinstance(calculator, Calculator) and calculator.max_output_chars == 50
    assert isinstance(python, PythonExecutor) and (python.timeout_s, python.memory_mib) == (2.5, 256)
    assert python.sandbox is not None and "standard library only" in python.description
    for name, tool in tools.items():
        assert tool.name == name and tool.description and tool.parameters["type"] == "object"
    assert set(BUILTIN_TOOLS) == {"calculator", "python"}


def test_build_tools_rejects_unknown_repeated_and_bad_limits():
    with pytest.raises(ConfigError, match="unknown tool 'search'.*calculator, python"):
        build_tools(["calculator", "search"])
    with pytest.raises(ConfigError, match="twice"):
        build_tools(["python", "python"])
    with pytest.raises(ConfigError, match="timeout_s"):
        build_tools(["python"], timeout_s=0)
    with pytest.raises(ConfigError, match="max_output_chars"):
        build_tools(["calculator"], max_output_chars=0)
