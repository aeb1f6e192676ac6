"""Tools a model calls during a rollout: loading them, their JSON schemas, parsing the model's
calls, and running them bounded in time. A tool is a plain Python function (plain or async def)
with type hints and a docstring, as TRL's `tools`; an environment's public methods are tools too.

A call that cannot be run (bad JSON, unknown tool, wrong arguments), raises, times out or returns
something that is not text or JSON gives the model an error message as its result and counts as
a failure; it never stops the run.
"""

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import time
from dataclasses import dataclass, replace
from typing import Callable

from tandem.aio import DaemonPool, user_loop
from tandem.loading import GIVEN, load_object

INVALID_CALL = "invalid_call"  # the name failures of unparseable calls are counted under
UNKNOWN_TOOL = "unknown_tool"  # ... and of calls to a tool that does not exist


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {...}}, as chat templates take it
    # What a worker process calls it by: a spec it loads ("file.py:fn", a built-in name) or, given
    # to the Python API, the function (pickled by reference); None: an environment's method
    spec: str | Callable | None = None


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # why it cannot be run, or None


@dataclass
class ToolResult:
    name: str
    content: str  # what the model is shown
    ok: bool
    seconds: float


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals with + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "123456789 * 987654321".
    """
    return _format_number(_evaluate(ast.parse(expression, mode="eval").body))


BUILTIN_TOOLS = {"calculator": calculator}
_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
# Every number the calculator makes is at most this many bits (about 4,300 digits, the most
# Python prints): past it, a product of large powers made % and // run quadratic big-integer
# arithmetic that held the GIL for seconds, past tool_timeout (which cannot stop a thread).
_MAX_BITS = 14_000


def _evaluate(node):
    """Numbers and operators only: no names, attributes, calls or subscripts, so nothing but
    arithmetic runs; each operation's result is bounded before it is computed."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if _result_bits(node.op, left, right) > _MAX_BITS:
            raise ValueError(f"{ast.unparse(node)!r} is too large to compute (more than about 4,300 digits)")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def _result_bits(op: ast.operator, left, right) -> float:
    """An upper bound of the bits of `left op right` (floats count as small: they overflow to an error)."""
    bits = [abs(x).bit_length() if isinstance(x, int) else 64 for x in (left, right)]
    if isinstance(op, ast.Pow):
        return max(1.0, math.log2(abs(left) or 1)) * abs(right)
    if isinstance(op, ast.Mult):
        return bits[0] + bits[1]
    return max(bits) + 1


def _format_number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def load_tools(specs: list[str], given: dict | None = None) -> list[Tool]:
    """Built-in names (calculator), "path/file.py:fn" / "module:fn", or functions the Python API was
    given (loading.GIVEN specs, held in `given`)."""
    tools = [replace(make_tool(BUILTIN_TOOLS[s] if s in BUILTIN_TOOLS else load_object(s, "tools entry", given=given), f"tools entry {s!r}"),
                     spec=given[s] if s.startswith(GIVEN) else s) for s in specs]  # fmt: skip
    _check_unique(tools, "tools")
    return tools


def environment_tools(env) -> list[Tool]:
    """An environment's public methods, except reset, step and get_reward, as tools."""
    methods = [getattr(env, n) for n in dir(env) if not n.startswith("_") and n not in ("reset", "step", "get_reward")]
    tools = [make_tool(m, f"environment method {m.__name__!r}") for m in methods if inspect.ismethod(m)]
    _check_unique(tools, "environment_factory")
    return tools


def make_tool(fn: Callable, where: str) -> Tool:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own error types for each missing piece
        raise ValueError(f"{where}: no JSON schema can be made of it ({exc}); give every argument a type hint and the "
                         "function a docstring with an Args: section") from None  # fmt: skip
    return Tool(fn.__name__, fn, schema)


def _check_unique(tools: list[Tool], option: str) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{option}: two tools are named alike ({', '.join(names)}); the model could not tell them apart")


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5's and
    Qwen3's format), in order; an unclosed or malformed one becomes a call with its error."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(INVALID_CALL, {}, f"the tool call is not valid JSON ({exc.msg})"))
            continue
        except (ValueError, RecursionError) as exc:  # an integer of over 4,300 digits; arrays nested past the stack
            calls.append(ToolCall(INVALID_CALL, {}, f"the tool call cannot be read ({type(exc).__name__}: {str(exc)[:200]})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
            calls.append(ToolCall(INVALID_CALL, {}, 'a tool call is {"name": "...", "arguments": {...}}'))
            continue
        calls.append(ToolCall(call["name"], call.get("arguments", {})))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall(INVALID_CALL, {}, "a <tool_call> is not closed by </tool_call>"))
    return calls


TOOL_PARSERS = {"hermes": parse_hermes}


class ToolRunner:
    """Runs the calls of many trajectories at once: async tools awaited together on the process's
    loop for user coroutines (tandem.aio), plain ones in a bounded pool of daemon threads, each
    call bounded by `timeout` seconds. A plain function past its timeout cannot be stopped (Python
    has no way to kill a thread): its thread stays busy until it returns, the model is told it
    timed out, and the thread never holds the process at exit. With `processes` (tool_workers),
    plain tools given in `tools` run in worker processes instead (tandem.rollout.tool_workers),
    whose death or timeout ends only the worker."""

    def __init__(self, timeout: float, workers: int = 8, processes=None):
        self.timeout = timeout
        self.processes = processes
        self.pool = DaemonPool(max(workers, processes.count if processes else 0), "tandem-tool")

    def run(self, calls: list[tuple[dict[str, Tool], ToolCall]]) -> list[ToolResult]:
        """One result per (tools by name, call), in order."""
        return user_loop().run(self._all(calls)) if calls else []

    async def _all(self, calls) -> list[ToolResult]:
        return list(await asyncio.gather(*(self._one(tools, call) for tools, call in calls)))

    async def _one(self, tools: dict[str, Tool], call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        name, ok, content = call.name, False, call.error
        if content is None and call.name not in tools:
            name, content = UNKNOWN_TOOL, f"there is no tool {call.name!r}; the tools are {', '.join(sorted(tools))}"
        if content is None:
            tool = tools[call.name]
            if self.processes is not None and tool.spec is not None and not inspect.iscoroutinefunction(tool.fn):
                ok, content = await asyncio.wrap_future(self.pool.submit(self.processes.call, tool.spec, call.name, call.arguments, self.timeout))
            else:
                ok, content = await self._call(tool.fn, call)
        return ToolResult(name, content if ok else f"error: {content}", ok, time.perf_counter() - start)

    async def _call(self, fn: Callable, call: ToolCall) -> tuple[bool, str]:
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(_contained(fn(**call.arguments)), self.timeout)
            else:
                value = await asyncio.wait_for(asyncio.wrap_future(self.pool.submit(lambda: fn(**call.arguments))), self.timeout)
        except asyncio.TimeoutError:
            return False, f"{call.name} took longer than tool_timeout ({self.timeout:g}s)"
        except (SystemExit, _Exited) as exc:  # a tool runs in the trainer's process: its sys.exit must not end the run
            return False, f"{call.name} called sys.exit({exc.code!r}); a tool must return its result"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to see, not the run's end
            return False, f"{call.name} raised {type(exc).__name__}: {exc}"
        return as_text(value, call.name)

    def close(self) -> None:
        self.pool.shutdown()
        if self.processes is not None:
            self.processes.close()


class _Exited(Exception):
    """An async tool's sys.exit, as an ordinary exception: raised out of a task, SystemExit would
    stop the event loop itself."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


async def _contained(coro):
    try:
        return await coro
    except SystemExit as exc:
        raise _Exited(exc.code) from None


def as_text(value, name: str) -> tuple[bool, str]:
    if isinstance(value, str):
        return True, value
    if isinstance(value, float) and not math.isfinite(value):
        return False, f"{name} returned {value}"
    try:
        return True, json.dumps(value)
    except (TypeError, ValueError):
        return False, f"{name} returned a {type(value).__name__}, which is neither text nor JSON"
