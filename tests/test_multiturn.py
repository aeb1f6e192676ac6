"""Multi-turn rollouts: tools, the hermes parser, environments and the trajectories' tokens.

The MultiTurn tests here drive it with a scripted engine: a fake at the engine's boundary that
answers each turn with tokens the test chose, so each test can make the model call a tool, fail,
think or run long. The runs through the real engine and the real CLI are in test_train_cli.py
and test_async.py (tools in colocated, server and async runs) and the vLLM suite.
"""

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ENV, cli_here, command, killed_past_step, same_collectives, train, versions_within
from tandem.demo import addition_rows, write_jsonl
from tandem.init_model import CHAT_TEMPLATE, build_tokenizer, save, warmup_sft
from tandem.rollout.multiturn import MultiTurn, Prompt, RolloutFunction, TemplateGlue, TrajectoryError, encode_conversation, turn_seed
from tandem.rollout.tool_workers import ToolWorkers
from tandem.rollout.tools import ToolCall, ToolRunner, calculator, environment_tools, load_tools, make_tool, parse_hermes
from tandem.rewards import NamedReward, score
from tandem.rollout.types import Completion, SamplingParams

# --------------------------------------------------------------------------- the calculator


def test_calculator_is_exact_on_numbers_too_long_for_floats():
    assert calculator("123456789123 * 987654321987") == str(123456789123 * 987654321987)
    assert calculator("(7 - 10) * 2 ** 3 // 5") == str((7 - 10) * 2**3 // 5)
    assert calculator("7 / 2") == "3.5"
    assert calculator("6 / 3") == "2"  # a float that is whole prints as an integer


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "x + 1", "(1).real", "[1, 2][0]", "'a' * 3", "lambda: 1", "9 ** 9 ** 9", "(10 ** 100) ** 5000",
     "9 ** 4000 * 9 ** 4000 % 7", "(2 ** 10000 - 1) * (2 ** 10000 - 1) // 3"],
)
def test_calculator_runs_nothing_but_arithmetic(expression):
    # names, calls, attributes, subscripts, strings and lambdas are refused before anything runs;
    # so is a power whose result would take the CPU for hours (9 ** 9 ** 9 has 370 million digits),
    # and a product past about 4,300 digits: % and // on products of large powers held the GIL for
    # seconds, past tool_timeout (a thread cannot be stopped)
    with pytest.raises(ValueError):
        calculator(expression)


# --------------------------------------------------------------------------- parsing calls


@pytest.mark.quick
def test_hermes_finds_each_call_and_turns_malformed_ones_into_errors():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3*3"}}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call><tool_call>{\"name\": \"x\""
    )
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "2+2"}), ("calculator", {"expression": "3*3"})]
    assert [c.error is None for c in calls] == [True, True, False, False, False]
    assert "not valid JSON" in calls[2].error and '{"name"' in calls[3].error and "not closed" in calls[4].error
    assert parse_hermes("no call here") == []


def test_a_call_the_parser_cannot_read_gives_the_model_an_error():
    # ~1000 nested arrays ran json past the stack (RecursionError), an integer of 5,000 digits past
    # Python's conversion limit (ValueError): both ended the run from inside the parser.
    for body in ["[" * 100_000 + "]" * 100_000, '{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}"]:
        (call,) = parse_hermes(f"<tool_call>{body}</tool_call>")
        assert call.name == "invalid_call" and call.error.startswith(("the tool call cannot be read", "the tool call is not valid JSON")), call.error


# --------------------------------------------------------------------------- running tools


@pytest.mark.quick
def test_a_tool_that_fails_in_any_way_gives_the_model_an_error_and_the_run_goes_on():
    def boom(x: int) -> str:
        """Raise.

        Args:
            x: ignored
        """
        raise RuntimeError("out of paper")

    def unusable() -> object:
        """Return something that is not text or JSON."""
        return object()

    async def slow() -> str:
        """Sleep past the timeout."""
        await asyncio.sleep(30)

    tools = {t.name: t for t in [make_tool(f, f.__name__) for f in (boom, unusable, slow)] + load_tools(["calculator"])}
    runner = ToolRunner(timeout=0.5)
    calls = [ToolCall("boom", {"x": 1}), ToolCall("unusable", {}), ToolCall("slow", {}), ToolCall("calculator", {"expr": "1"}),
             ToolCall("nope", {}), ToolCall("invalid_call", {}, "the tool call is not valid JSON"), ToolCall("calculator", {"expression": "6*7"})]  # fmt: skip
    results = runner.run([(tools, c) for c in calls])
    assert [r.ok for r in results] == [False] * 6 + [True]
    contents = [r.content for r in results]
    assert "RuntimeError: out of paper" in contents[0] and "neither text nor JSON" in contents[1]
    assert "longer than tool_timeout (0.5s)" in contents[2] and "unexpected keyword argument 'expr'" in contents[3]
    assert "there is no tool 'nope'" in contents[4] and results[4].name == "unknown_tool" and "not valid JSON" in contents[5]
    assert contents[6] == "42" and all(c.startswith("error: ") for c in contents[:6])
    runner.close()


def test_a_tool_that_calls_sys_exit_is_a_failed_call_naming_it():
    # Tools run in the trainer's process: a tool's sys.exit(0) ended runs with code 0 after training nothing.
    def quits(x: int) -> str:
        """Exit.

        Args:
            x: ignored
        """
        raise SystemExit(0)

    async def quits_async(x: int) -> str:
        """Exit.

        Args:
            x: ignored
        """
        raise SystemExit(3)

    tools = {t.name: t for t in [make_tool(f, f.__name__) for f in (quits, quits_async)]}
    runner = ToolRunner(timeout=5)
    results = runner.run([(tools, ToolCall("quits", {"x": 1})), (tools, ToolCall("quits_async", {"x": 1}))])
    assert [r.content for r in results] == ["error: quits called sys.exit(0); a tool must return its result",
                                           "error: quits_async called sys.exit(3); a tool must return its result"]  # fmt: skip
    assert runner.run([(tools, ToolCall("nope", {}))])[0].name == "unknown_tool"  # the runner, and its loop, go on
    runner.close()


def test_what_async_tools_rewards_and_agents_keep_across_rounds_stays_usable():
    # Each round ran in a fresh asyncio.run: a lock (a semaphore, an HTTP client) made in round 0
    # was bound to round 0's loop, and every later round's calls failed with it. The agent holds
    # its lock across its generate call, so the other trajectory waits on the lock, not on
    # generate: its batch goes once no call has come for a moment (it used to wait forever).
    kept = {}

    async def guarded(x: int) -> str:
        """Use a lock made at the first call.

        Args:
            x: a number
        """
        lock = kept.setdefault("tool", asyncio.Lock())
        async with lock:
            await asyncio.sleep(0)
            return str(x)

    tools = {"guarded": make_tool(guarded, "guarded")}
    runner = ToolRunner(timeout=5)
    for round_ in range(3):  # two calls at once, so the lock is waited on
        assert [r.content for r in runner.run([(tools, ToolCall("guarded", {"x": round_}))] * 2)] == [str(round_)] * 2
    runner.close()

    async def judge(prompts, completions, **kw):
        lock = kept.setdefault("reward", asyncio.Lock())
        async with lock:
            await asyncio.sleep(0)
            return [1.0] * len(completions)

    rewards = [NamedReward("judge", judge, 1.0), NamedReward("judge_too", judge, 1.0)]
    for _ in range(3):
        assert score(rewards, ["p"], ["c"]).tolist() == [[1.0, 1.0]]

    async def agent(prompt, generate, tokenizer):
        lock = kept.setdefault("agent", asyncio.Lock())
        async with lock:
            out = await generate(prompt["prompt_ids"])
        return {"completion_ids": out["token_ids"], "loss_mask": [1] * len(out["token_ids"])}

    rf = RolloutFunction(agent, "agent.py:agent", TOKENIZER, 400)
    for _ in range(3):
        engine = ScriptedEngine([["a"], ["b"]])
        engine.start(["Q one", "Q two"])
        assert len(rf.generate(engine, _prompts(TOKENIZER, [], ["Q one", "Q two"]), SamplingParams(max_tokens=10), [1, 2], 0)) == 2


@pytest.mark.parametrize("kind", ["async", "plain"])
def test_the_calls_of_many_trajectories_run_concurrently(kind):
    # Each call waits until all four have started: run one after another, the first would wait
    # past the timeout and fail.
    n, started = 4, []
    if kind == "async":

        async def meet() -> str:
            """Wait for the others."""
            started.append(1)
            while len(started) < n:
                await asyncio.sleep(0.01)
            return "met"

    else:
        barrier = threading.Barrier(n, timeout=5)

        def meet() -> str:
            """Wait for the others."""
            barrier.wait()
            return "met"

    tools = {"meet": make_tool(meet, "meet")}
    results = ToolRunner(timeout=5).run([(tools, ToolCall("meet", {})) for _ in range(n)])
    assert [r.content for r in results] == ["met"] * n


def test_a_tool_needs_type_hints_and_a_docstring_for_its_schema():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="type hint"):
        make_tool(bare, "tools entry 'f.py:bare'")
    assert load_tools(["calculator"])[0].schema["function"]["parameters"]["required"] == ["expression"]


# --------------------------------------------------------------------------- trajectories

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id


class ScriptedEngine:
    """The engine's boundary, faked: turn k of trajectory i is replies[i][k] as tokens (with its
    stop token), each with a log-prob the test can recognise. Records what it was asked."""

    def __init__(self, replies: list[list[str]], version: int = 3):
        self.replies, self.version, self.calls = replies, version, []
        self.turn = 0

    def generate(self, prompts, params, seeds, min_version=0):
        self.calls.append((prompts, params.max_tokens, seeds, min_version))
        outs = []
        for ids in prompts:
            i = self._owner(ids)
            text = self.replies[i][min(self._turns_done(i), len(self.replies[i]) - 1)]
            tokens = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]
            finish = "stop" if len(tokens) <= params.max_tokens else "length"
            tokens = tokens[: params.max_tokens]
            outs.append(Completion(tokens, [-(k + 1) / 100 for k in range(len(tokens))], finish, self.version))
        return outs

    def _owner(self, ids):
        text = TOKENIZER.decode(ids)
        return next(i for i, r in enumerate(self.prompts) if r in text)

    def _turns_done(self, i):
        self.done[i] += 1
        return self.done[i] - 1

    def start(self, questions):
        self.prompts, self.done = questions, [0] * len(questions)


def _call(expression: str) -> str:
    return f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}</tool_call>'


def _multi_turn(template=None, environment_factory=None, max_iterations=3, max_length=400, tools=("calculator",), max_response=None, timeout=5):
    tok = TOKENIZER
    if template is not None:
        tok = build_tokenizer()
        tok.chat_template = template
    schemas = [t.schema for t in load_tools(list(tools))]
    env_tools = environment_tools(environment_factory()) if environment_factory else []
    mt = MultiTurn(tok, {"tools": schemas}, "the test's tokenizer", load_tools(list(tools)), environment_factory, env_tools, "hermes",
                   max_iterations, max_length, tool_timeout=timeout, max_tool_response_tokens=max_response)  # fmt: skip
    return mt, tok, schemas


def _prompts(tok, schemas, questions):
    out = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        ids = tok(tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        out.append(Prompt(ids, messages, {"answer": "x"}))
    return out


def _run(mt, tok, schemas, questions, replies, max_tokens=400, version=3):
    engine = ScriptedEngine(replies, version)
    engine.start(questions)
    trajectories = mt.generate(engine, _prompts(tok, schemas, questions), SamplingParams(max_tokens=max_tokens), [11, 22][: len(questions)], 2)
    return trajectories, engine


def _model_tokens(t):
    return [x for x, m in zip(t.token_ids, t.loss_mask) if m]


@pytest.mark.quick
def test_trained_tokens_are_the_engines_and_the_rest_is_the_templates_rendering():
    mt, tok, schemas = _multi_turn()
    replies = [["I will compute. " + _call("123456789*987654321"), "It is 121932631112635269."], ["No tool needed: 4."]]
    (t0, t1), engine = _run(mt, tok, schemas, ["Q one: big product?", "Q two: 2+2?"], replies)
    # what the engine produced, token for token, and nothing else is trained
    expected = [tok(r, add_special_tokens=False)["input_ids"] + [EOS] for r in replies[0]]
    assert _model_tokens(t0) == expected[0] + expected[1]
    assert [lp for lp, m in zip(t0.logprobs, t0.loss_mask) if m] == [-(k + 1) / 100 for k in range(len(expected[0]))] + [
        -(k + 1) / 100 for k in range(len(expected[1]))
    ]
    assert all(lp == 0.0 for lp, m in zip(t0.logprobs, t0.loss_mask) if not m)
    # the whole sequence is the chat template's rendering of the conversation, tool result included
    conversation = [{"role": "user", "content": "Q one: big product?"}, {"role": "assistant", "content": replies[0][0]},
                    {"role": "tool", "name": "calculator", "content": "121932631112635269"}, {"role": "assistant", "content": replies[0][1]}]  # fmt: skip
    rendered = tok.apply_chat_template(conversation, tools=schemas, tokenize=False)
    prompt = _prompts(tok, schemas, ["Q one: big product?"])[0].ids
    assert tok.decode(prompt + t0.token_ids) + "\n" == rendered  # the template closes the last turn with a newline
    assert t0.info["turns"] == 2 and t0.info["template_rewrites"] == 0 and t0.finish_reason == "stop"
    assert t0.info["tool_calls"][0]["name"] == "calculator" and t0.info["tool_calls"][0]["ok"]
    assert [m["role"] for m in t0.info["messages"]] == ["assistant", "tool", "assistant"]
    assert t0.info["messages"][0]["tool_calls"] == [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123456789*987654321"}}}]
    # a trajectory that calls no tool is the single completion, from the completion's own seed
    assert t1.loss_mask == [1] * len(t1.token_ids) and t1.info["turns"] == 1
    assert engine.calls[0][2] == [11, 22] and engine.calls[1][2] == [turn_seed(11, 1)] and turn_seed(11, 1) != 11
    # every turn asks for the round's version; the second only for the trajectory still going
    assert [c[3] for c in engine.calls] == [2, 2] and len(engine.calls[1][0]) == 1
    assert t0.info["versions"] == [3, 3] and t0.version == 3


# A Qwen3-style template: an assistant turn before the last user message loses its <think> block,
# and the conversation's last assistant turn gets an empty one.
REWRITING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{% else %}{% set ns = namespace(later_user=false) %}"
    "{% for m in messages[loop.index0 + 1:] %}{% if m['role'] == 'user' %}{% set ns.later_user = true %}{% endif %}{% endfor %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and ns.later_user and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{% if message['role'] == 'assistant' and loop.last and '</think>' not in content %}{% set content = '<think>\\n\\n</think>\\n\\n' + content %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content }}",
)


class Guess:
    """An environment that is not tool calls: the model guesses, step() answers."""

    def reset(self, **row):
        self.guesses = 0
        return " (you have two guesses)"

    def step(self, text: str):
        self.guesses += 1
        return None if self.guesses == 2 else "Wrong, again."

    def get_reward(self) -> float:
        return float(self.guesses)


class Safe(Guess):
    """Guess with a tool method: the code opens once the model has tried it twice."""

    def reset(self, **row):
        self.tries = 0
        return super().reset(**row)

    def try_code(self, code: str) -> str:
        """Try a code on the safe.

        Args:
            code: the code
        """
        self.tries += 1
        return "open" if self.tries == 2 else f"locked ({self.tries} tries)"


@pytest.mark.quick
def test_a_trajectory_in_flight_gets_its_environment_back_by_replay_and_a_nondeterministic_one_is_refused():
    # Partial rollouts save trajectories in flight without their environment: restoring one
    # asks a new environment what the old one was asked (steps and tool methods) and checks
    # each answer. Then both go on alike.
    mt, tok, _ = _multi_turn(environment_factory=Safe, tools=())
    prompt = _prompts(tok, [], ["Open the safe"])[0]
    live = mt.begin(prompt, 7)

    def turn(t, text):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [EOS]
        said = mt.take(t, Completion(ids, [-0.5] * len(ids), "stop", 2))
        mt.respond([(t, said)])

    turn(live, _call_safe("1234"))  # a tool method of the environment
    turn(live, "I give up")  # a step
    saved = json.loads(json.dumps(live.saved()))  # as the checkpoint holds it
    assert [e.get("tool", "step") for e in saved["env_log"]] == ["try_code", "step"]
    back = mt.restore(saved, prompt)
    assert (back.env.tries, back.env.guesses) == (live.env.tries, live.env.guesses) == (1, 1)
    for t in (live, back):
        turn(t, _call_safe("9999"))
    assert live.shown[-1] == back.shown[-1] == {"role": "tool", "name": "try_code", "content": "open"}
    assert mt.finish(back).token_ids == mt.finish(live).token_ids

    class Drifting(Safe):  # its answers depend on how many safes were made before it
        made = 0

        def reset(self, **row):
            Drifting.made += 1
            return super().reset(**row)

        def step(self, text: str):
            return f"guess {Drifting.made}"

    mt, tok, _ = _multi_turn(environment_factory=Drifting, tools=())
    live = mt.begin(prompt, 7)
    turn(live, "3")
    with pytest.raises(TrajectoryError, match=r"its call 1 of 1 \(step\) answered otherwise than before the checkpoint"):
        mt.restore(json.loads(json.dumps(live.saved())), prompt)


def _call_safe(code: str) -> str:
    return f'<tool_call>{json.dumps({"name": "try_code", "arguments": {"code": code}})}</tool_call>'


@pytest.mark.quick
def test_a_template_that_rewrites_earlier_turns_is_detected_and_the_models_tokens_are_kept():
    assert REWRITING_TEMPLATE != CHAT_TEMPLATE
    mt, tok, schemas = _multi_turn(template=REWRITING_TEMPLATE, environment_factory=Guess, tools=())
    replies = [["<think>maybe 3</think> 3", "<think>then 4</think> 4"]]
    (t,), _ = _run(mt, tok, [], ["Guess the number"], replies)
    expected = [tok(r, add_special_tokens=False)["input_ids"] + [EOS] for r in replies[0]]
    assert _model_tokens(t) == expected[0] + expected[1]  # the <think> the template would drop is still there
    assert t.info["template_rewrites"] == 1 and t.info["turns"] == 2 and t.info["environment_reward"] == 2.0
    assert t.prompt_ids is not None and tok.decode(t.prompt_ids).endswith("Guess the number (you have two guesses)<|im_end|>\n<|im_start|>assistant\n")
    assert [m["role"] for m in t.info["messages"]] == ["assistant", "user", "assistant"]
    # the same conversation under a template that keeps history: no rewrite counted
    mt, tok, _ = _multi_turn(environment_factory=Guess, tools=())
    (t,), _ = _run(mt, tok, [], ["Guess the number"], replies)
    assert t.info["template_rewrites"] == 0 and _model_tokens(t) == expected[0] + expected[1]


def test_an_environment_that_raises_stops_the_round_naming_what_raised():
    class Broken(Guess):
        def step(self, text):
            raise KeyError("no such room")

    mt, tok, _ = _multi_turn(environment_factory=Broken, tools=())
    with pytest.raises(TrajectoryError, match="environment_factory: step raised KeyError: 'no such room'"):
        _run(mt, tok, [], ["Guess the number"], [["3"]])

    class Stuck(Guess):
        def step(self, text):
            time.sleep(0.5)

    # reset and the constructor were called outside the bound: one that slept held the round
    # until SIGTERM's (still running at 200 s with tool_timeout 3)
    class StuckReset(Guess):
        def reset(self, **row):
            time.sleep(0.5)

    class StuckStart(Guess):
        def __init__(self):
            if not getattr(StuckStart, "schema_made", False):  # the first one only makes the tools' schemas
                StuckStart.schema_made = True
                return
            time.sleep(0.5)

    for stuck, what in [(Stuck, "step"), (StuckReset, "reset"), (StuckStart, "its constructor")]:
        mt, tok, _ = _multi_turn(environment_factory=stuck, tools=(), timeout=0.1)
        with pytest.raises(TrajectoryError, match=rf"environment_factory: {what} took longer than tool_timeout \(0.1s\)"):
            _run(mt, tok, [], ["Guess the number"], [["3"]])


def test_the_environments_of_a_round_step_concurrently():
    # Each step waits until both trajectories' steps have started: one after the other, the first
    # would wait past the barrier's timeout and the round would stop naming it.
    barrier = threading.Barrier(2, timeout=5)

    class Meeting(Guess):
        def step(self, text):
            barrier.wait()
            return super().step(text)

    mt, tok, _ = _multi_turn(environment_factory=Meeting, tools=())
    trajectories, _ = _run(mt, tok, [], ["Guess one", "Guess two"], [["3", "4"], ["5", "6"]])
    assert [t.info["turns"] for t in trajectories] == [2, 2]
    assert [t.info["environment_reward"] for t in trajectories] == [2.0, 2.0]


def test_max_completion_length_bounds_model_and_inserted_tokens_together():
    call = _call("123456789*987654321")
    limit = len(call) + 1 + 150  # the call and its stop token (one token a character), then 150 for the rest
    mt, tok, schemas = _multi_turn(max_length=limit, max_response=5)
    # the result of 18 digits is cut to 5 tokens; the second turn gets what is left of the limit and is cut there
    (t,), engine = _run(mt, tok, schemas, ["Q"], [[call, "x" * 100]])
    assert len(t.token_ids) == limit and t.finish_reason == "length"
    assert t.info["messages"][1]["content"] == "12193 [cut at max_tool_response_tokens]"
    second_turn_starts = t.loss_mask.index(1, t.loss_mask.index(0))
    assert engine.calls[1][1] == limit - second_turn_starts and t.loss_mask[-1] == 1
    # a limit the inserted tokens reach ends the trajectory there, without another turn
    mt, tok, schemas = _multi_turn(max_length=len(call) + 10)
    (t,), engine = _run(mt, tok, schemas, ["Q"], [[call, "x"]])
    assert len(t.token_ids) == len(call) + 10 and t.finish_reason == "length" and t.loss_mask[-1] == 0 and len(engine.calls) == 1


def test_max_tool_calling_iterations_ends_a_model_that_keeps_calling():
    mt, tok, schemas = _multi_turn(max_iterations=2)
    (t,), engine = _run(mt, tok, schemas, ["Q"], [[_call("1+1")]])
    assert t.info["turns"] == 3 and len(t.info["tool_calls"]) == 2 and t.finish_reason == "stop" and len(engine.calls) == 3


def test_a_warm_up_conversation_is_laid_out_as_a_trajectory_holds_it():
    mt, tok, schemas = _multi_turn()
    replies = [[_call("6*7"), "42"]]
    (t,), _ = _run(mt, tok, schemas, ["Q"], replies)
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": replies[0][0]},
                {"role": "tool", "name": "calculator", "content": "42"}, {"role": "assistant", "content": "42"}]  # fmt: skip
    ids, labels = encode_conversation(tok, TemplateGlue(tok, {"tools": schemas}, "test"), messages)
    prompt = _prompts(tok, schemas, ["Q"])[0].ids
    assert ids == prompt + t.token_ids
    assert [x != -100 for x in labels] == [False] * len(prompt) + [bool(m) for m in t.loss_mask]


def _agent(cheat: bool):
    async def agent(prompt, generate, tokenizer):
        """Two turns with a note of its own between them, as a user's agent might."""
        first = await generate(prompt["prompt_ids"])
        note = tokenizer("\nnote\n", add_special_tokens=False)["input_ids"]
        second = await generate(prompt["prompt_ids"] + first["token_ids"] + note, max_tokens=5)
        ids = first["token_ids"] + note + second["token_ids"]
        return {"completion_ids": ids, "loss_mask": [1] * len(first["token_ids"]) + [int(cheat)] * len(note) + [1] * len(second["token_ids"])}

    return agent


@pytest.mark.quick
def test_a_rollout_function_trains_only_the_tokens_its_generate_calls_returned():
    questions = ["Q one", "Q two"]
    prompts = _prompts(TOKENIZER, [], questions)
    engine = ScriptedEngine([["first answer", "second answer"], ["other", "more words"]])
    engine.start(questions)
    rf = RolloutFunction(_agent(cheat=False), "agent.py:agent", TOKENIZER, 400)
    t0, t1 = rf.generate(engine, prompts, SamplingParams(max_tokens=100), [11, 22], 1)
    # each turn of both trajectories went to the engine as one call, with the round's version
    assert [len(c[0]) for c in engine.calls] == [2, 2] and [c[3] for c in engine.calls] == [1, 1] and engine.calls[1][1] == 5
    first = TOKENIZER("first answer", add_special_tokens=False)["input_ids"] + [EOS]
    second = TOKENIZER("secon", add_special_tokens=False)["input_ids"]  # cut at its max_tokens
    assert _model_tokens(t0) == first + second and t0.finish_reason == "length"
    assert t0.logprobs == [-(k + 1) / 100 for k in range(len(first))] + [0.0] * 6 + [-(k + 1) / 100 for k in range(5)]
    assert t0.info["turns"] == 2 and t0.info["versions"] == [3, 3]
    engine.start(questions)
    with pytest.raises(TrajectoryError, match=r"agent.py:agent: the model tokens \(loss_mask 1\) at completion_ids\[\d+:\] are not the whole answer"):
        RolloutFunction(_agent(cheat=True), "agent.py:agent", TOKENIZER, 400).generate(engine, prompts, SamplingParams(max_tokens=100), [11, 22], 1)


def test_a_rollout_functions_concurrent_calls_draw_from_seeds_of_their_own_and_drafts_it_drops_are_not_trained():
    # Best-of-3 through asyncio.gather: the calls are made together and return together. Each
    # takes its seed by the order it was made in (they all took turn 0's while none had returned).
    async def best_of_three(prompt, generate, tokenizer):
        drafts = await asyncio.gather(*(generate(prompt["prompt_ids"]) for _ in range(3)))
        best = max(drafts, key=lambda d: len(d["token_ids"]))
        return {"completion_ids": best["token_ids"], "loss_mask": [1] * len(best["token_ids"])}

    questions = ["Q one"]
    engine = ScriptedEngine([["a", "three", "bb"]])
    engine.start(questions)
    (t,) = RolloutFunction(best_of_three, "agent.py:best", TOKENIZER, 400).generate(engine, _prompts(TOKENIZER, [], questions), SamplingParams(max_tokens=100), [11], 1)
    assert [seed for call in engine.calls for seed in call[2]] == [turn_seed(11, 0), turn_seed(11, 1), turn_seed(11, 2)]
    assert t.token_ids == TOKENIZER("three", add_special_tokens=False)["input_ids"] + [EOS] and t.info["turns"] == 1
    assert t.logprobs == [-(k + 1) / 100 for k in range(6)]


def test_a_rollout_function_whose_next_call_saw_other_tokens_than_it_returns_is_refused():
    # The second call is made on the first answer and one note; the trajectory returns another note
    # in its place, so the second answer's log-probs were computed after tokens it does not hold.
    async def rerendered(prompt, generate, tokenizer):
        first = await generate(prompt["prompt_ids"])
        asked = tokenizer("\nnote\n", add_special_tokens=False)["input_ids"]
        shown = tokenizer("\nNote\n", add_special_tokens=False)["input_ids"]
        second = await generate(prompt["prompt_ids"] + first["token_ids"] + asked)
        ids = first["token_ids"] + shown + second["token_ids"]
        return {"completion_ids": ids, "loss_mask": [1] * len(first["token_ids"]) + [0] * len(shown) + [1] * len(second["token_ids"])}

    questions = ["Q one"]
    engine = ScriptedEngine([["first", "second"]])
    engine.start(questions)
    start = len(TOKENIZER("first", add_special_tokens=False)["input_ids"]) + 1 + 6
    with pytest.raises(TrajectoryError, match=rf"agent.py:re: the model tokens at completion_ids\[{start}:\] were generated after other tokens"):
        RolloutFunction(rerendered, "agent.py:re", TOKENIZER, 400).generate(engine, _prompts(TOKENIZER, [], questions), SamplingParams(max_tokens=100), [11], 1)


def test_a_generate_call_a_rollout_function_gave_up_on_is_dropped():
    # Trajectory 0 stops waiting for its call (asyncio.wait_for) while trajectory 1 has not asked
    # yet, so the call is still queued; it then asks again. The dropped call used to be sent, and
    # its result set on the cancelled future: InvalidStateError failed the round.
    async def impatient(prompt, generate, tokenizer):
        if prompt["prompt"][0]["content"] == "Q one":
            try:
                await asyncio.wait_for(generate(prompt["prompt_ids"]), 0.01)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(0.2)
        out = await generate(prompt["prompt_ids"])
        return {"completion_ids": out["token_ids"], "loss_mask": [1] * len(out["token_ids"])}

    engine = ScriptedEngine([["a"], ["b"]])
    engine.start(["Q one", "Q two"])
    t0, t1 = RolloutFunction(impatient, "agent.py:impatient", TOKENIZER, 400).generate(engine, _prompts(TOKENIZER, [], ["Q one", "Q two"]),
                                                                                         SamplingParams(max_tokens=10), [1, 2], 0)  # fmt: skip
    assert sum(len(c[0]) for c in engine.calls) == 2  # one call each: the given-up one never reached the engine
    assert t0.token_ids == TOKENIZER("a", add_special_tokens=False)["input_ids"] + [EOS]


def test_a_huge_tool_result_is_cut_before_it_is_tokenized_and_logged_as_cut(monkeypatch):
    # 1 MB of digits, no max_tool_response_tokens: the trajectory's 400 tokens bound it. Cut to
    # what they can hold in characters first (tokenized whole, 100 MB took 12 GB), and shown cut.
    def flood(n: int) -> str:
        """Return a lot.

        Args:
            n: ignored
        """
        return "7" * 1_000_000

    mt = MultiTurn(TOKENIZER, {"tools": [make_tool(flood, "flood").schema]}, "test", [make_tool(flood, "flood")], None, [], "hermes", 1, 400,
                   tool_timeout=5, max_tool_response_tokens=None)  # fmt: skip
    seen = []  # the length of every text tokenized
    tokenize = type(TOKENIZER).__call__
    monkeypatch.setattr(type(TOKENIZER), "__call__", lambda self, text, **kw: (seen.append(len(text)), tokenize(self, text, **kw))[1])
    call = '<tool_call>{"name": "flood", "arguments": {"n": 1}}</tool_call>'
    engine = ScriptedEngine([[call, "done"]])
    engine.start(["Q"])
    (t,) = mt.generate(engine, _prompts(TOKENIZER, [make_tool(flood, "flood").schema], ["Q"]), SamplingParams(max_tokens=400), [11], 2)
    result = t.info["messages"][1]["content"]
    assert result.endswith(" [cut at max_completion_length]") and len(result) < 400 * mt.longest_token and max(seen) < 400 * mt.longest_token + 1000
    assert len(t.token_ids) == 400 and t.finish_reason == "length"
    mt.close()


def test_an_answer_ending_on_its_stop_token_at_max_completion_length_is_finished_not_truncated():
    # "42" and its stop token are 3 tokens: with max_completion_length 3 the answer is whole, as
    # one turn reports it (stop), so mask_truncated_completions keeps it; one token less cuts it.
    for limit, finish in ((3, "stop"), (2, "length")):
        mt, tok, schemas = _multi_turn(max_length=limit)
        (t,), _ = _run(mt, tok, schemas, ["Q"], [["42"]])
        assert (len(t.token_ids), t.finish_reason) == (limit, finish)

    async def answer(prompt, generate, tokenizer):
        out = await generate(prompt["prompt_ids"])
        return {"completion_ids": out["token_ids"], "loss_mask": [1] * len(out["token_ids"])}

    for limit, finish in ((3, "stop"), (2, "length")):
        engine = ScriptedEngine([["42"]])
        engine.start(["Q"])
        (t,) = RolloutFunction(answer, "agent.py:answer", TOKENIZER, limit).generate(engine, _prompts(TOKENIZER, [], ["Q"]), SamplingParams(max_tokens=limit), [11], 1)
        assert (len(t.token_ids), t.finish_reason) == (limit, finish)


# --------------------------------------------------------------------------- real runs

# An environment that is not tool calls, so any model's text makes several turns: after each
# turn step() answers once more, twice, then ends it. Its reward is the digits the model wrote.
ROUNDS = '''
class Rounds:
    def reset(self, **row):
        self.turns, self.digits = 0, 0
        return None

    def step(self, text: str):
        self.turns += 1
        self.digits += sum(ch.isdigit() for ch in text)
        return None if self.turns == 3 else "Once more."

    def get_reward(self) -> float:
        return min(self.digits, 8) / 8
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multiturn")
    (folder / "rounds.py").write_text(ROUNDS)
    data = write_jsonl(addition_rows(0), folder / "data.jsonl")
    return folder, data


# Rounds whose reward is numpy's float32, as many environments compute it.
NUMPY_ROUNDS = ROUNDS.replace("return min(self.digits, 8) / 8", "import numpy\n        return numpy.float32(min(self.digits, 8) / 8)").replace("class Rounds", "class NumpyRounds")
# An environment whose step never returns (a game server that hangs).
STUCK = """
import time

class Stuck:
    def step(self, text: str):
        time.sleep(3600)
"""


def test_a_numpy_reward_from_get_reward_is_trained_logged_and_saved(tiny_model, files, tmp_path):
    # np.float32 from get_reward() stopped the run at the first completions.jsonl line (json.dumps).
    folder, data = files
    (folder / "numpy_rounds.py").write_text(NUMPY_ROUNDS)
    out = tmp_path / "run"
    train(1, _args(tiny_model, data, out, 8, "--max_steps", "2", "--save_steps", "1", "--max_completion_length", "24",
                   "--environment_factory", f"{folder / 'numpy_rounds.py'}:NumpyRounds", "--reward_funcs", "environment"))  # fmt: skip
    metrics, completions = _read(out)
    assert [m["step"] for m in metrics] == [1, 2] and (out / "checkpoint-2").is_dir()
    assert all(isinstance(c["turns"]["environment_reward"], float) for c in completions)


def test_a_step_that_never_returns_ends_the_run_and_its_process_at_once(tiny_model, files, tmp_path):
    # The round stops past tool_timeout; the stuck thread used to hold the process at its exit
    # (the tools' pool was joined), for as long as the step slept.
    folder, data = files
    (folder / "stuck.py").write_text(STUCK)
    start = time.monotonic()
    proc = subprocess.run(command(1, _args(tiny_model, data, tmp_path / "run", 8, "--max_steps", "2", "--max_completion_length", "24",
                                           "--environment_factory", f"{folder / 'stuck.py'}:Stuck", "--reward_funcs", "exact_match",
                                           "--tool_timeout", "1")), capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "tandem: environment_factory: step took longer than tool_timeout (1s)" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60


def _calculator_glue(tok) -> TemplateGlue:
    return TemplateGlue(tok, {"tools": [t.schema for t in load_tools(["calculator"])]}, "tiny")


def _calling(a: int, b: int) -> list[dict]:
    """"a+b=", answered by a call on "a+b", its result and the sum."""
    return [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": _call(f"{a}+{b}")},
            {"role": "tool", "name": "calculator", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]  # fmt: skip


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory):
    return warmed_up_on_tools(tiny_model, tmp_path_factory.mktemp("model") / "tools")


def warmed_up_on_tools(base: Path, out: Path) -> Path:
    """The model at `base` after a short warm-up on the calculator ("a+b=" -> a call on "a+b", its
    result, the sum) and on answering without it, wrong: it calls in about half of its replies,
    and a call pays. It also learns to end each of Rounds' three turns (below). Saved at `out`."""
    model, tok = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    glue = _calculator_glue(tok)
    questions = [(a, b) for a in range(10) for b in range(10)]
    rows = [encode_conversation(tok, glue, _calling(a, b)) for a, b in questions]
    guesses = [(a, b, (7 * a + 3 * b) % 19) for a, b in questions if (7 * a + 3 * b) % 19 != a + b][:66]
    rows += [encode_conversation(tok, glue, [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(guess)}])
             for a, b, guess in guesses]  # fmt: skip
    # Rounds' turns, each ended: the sum, then "Once more." and the sum again, twice.
    once_more = [{"role": "user", "content": "Once more."}, {"role": "assistant", "content": "{}"}]
    rows += [encode_conversation(tok, TemplateGlue(tok, {}, "tiny"), [
        {"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
        *[{**m, "content": m["content"].format(a + b)} for m in once_more * 2]])
        for a, b in questions[::2]]  # fmt: skip
    # Warmed up on calls alone (80 steps at 1e-2), the model called in 2 to 13 replies of 16 and
    # ended Rounds' turns by chance, as the warm-up's seed (or its float rounding) fell. With this
    # mix, for each of the warm-up's seeds 0-3: 6 to 10 calls of 16, three turns in Rounds.
    warmup_sft(model, tok, rows=rows, steps=120, lr=5e-3)
    save(model, tok, out)
    return out


def test_the_warm_ups_loss_and_gradients_are_those_of_transformers_own_loss_with_the_padding_masked(tiny_model):
    # warmup_sft leaves the attention mask out and runs the output layer on the positions in the
    # loss only; transformers' `labels=` loss, on the same padded batch with its mask, is the plain
    # reference. Conversations of 2 and 4 turns: rows of several lengths, labels in several spans.
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    glue = _calculator_glue(tok)
    rows = [encode_conversation(tok, glue, [{"role": "user", "content": "12+345="}, {"role": "assistant", "content": "357"}]),
            encode_conversation(tok, glue, _calling(1, 2))]  # fmt: skip
    drawn = [rows[i] for i in torch.randint(len(rows), (4,), generator=torch.Generator().manual_seed(5)).tolist()]  # warmup_sft's draw
    assert len({len(ids) for ids, _ in drawn}) == 2
    (loss,) = warmup_sft(model, tok, rows=rows, steps=1, lr=0.0, batch_size=4, seed=5)  # lr 0: the weights stay
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    width = max(len(ids) for ids, _ in drawn)
    ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in drawn])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in drawn])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in drawn])
    model.zero_grad()
    reference = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    reference.backward()
    assert loss == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), name


def _args(model, data, out, batch, *extra):
    return ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", out, "--num_generations", "4",
            "--per_device_train_batch_size", batch, "--max_completion_length", "192", "--learning_rate", "1e-2",
            "--disable_tqdm", "true", "--num_completions_to_log", "64", *extra]  # fmt: skip


def _read(out):
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tools", "nowhere.py:fn"], "tools entry 'nowhere.py:fn': file nowhere.py does not exist"),
        (["--tools", "calculator", "--dataset_name", "PLAIN"], "tools and environment_factory need chat prompts"),
        (["--rollout_func", "AGENTS:plain"], "must be an async def fn(prompt, generate, tokenizer)"),
        (["--agent_func", "AGENTS:plain"], "agents.py:plain must be an async def fn(row, client)"),
        (["--agent_func", "AGENTS:plain", "--tools", "calculator"], "agent_func="),
        (["--agent_func", "AGENTS:plain", "--fsdp", "full_shard"], "an agent_func with a sharded colocated engine is not built"),
        (["--environment_factory", "AGENTS:Untyped"], "environment method 'act': no JSON schema can be made of it"),
    ],
)
def test_tools_that_cannot_work_stop_the_run_at_start_naming_them(tiny_model, files, tmp_path, extra, message):
    folder, data = files
    (folder / "agents.py").write_text("def plain(prompt, generate, tokenizer):\n    return {}\n\n"
                                      "class Untyped:\n    def act(self, x):\n        return x\n")  # fmt: skip
    plain = write_jsonl([{"prompt": "1+1=", "answer": "2"}], folder / "plain.jsonl")
    extra = [str(plain) if e == "PLAIN" else e.replace("AGENTS", str(folder / "agents.py")) for e in extra]
    proc = cli_here("train", *_args(tiny_model, data, tmp_path / "run", 4, "--reward_funcs", "exact_match", *extra))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_a_colocated_run_calls_the_tool_and_shows_each_turn(tool_model, files, tmp_path):
    _, data = files
    out = tmp_path / "run"
    train(1, _args(tool_model, data, out, 16, "--max_steps", "2", "--reward_funcs", "exact_match", "--tools", "calculator",
                   "--max_tool_calling_iterations", "1", "--learning_rate", "1e-4"))  # fmt: skip
    # (A small step: Adam's first moves every weight by about the learning rate, and at 1e-2 it
    # turned calling off at step 2 for some warm-up seeds. What is tested is how calls run and show.)
    metrics, completions = _read(out)
    assert all(m["tools/calculator/call_frequency"] > 0.2 for m in metrics), [m["tools/calculator/call_frequency"] for m in metrics]
    assert all(m["multi_turn/turns/max"] == 2 for m in metrics)
    for m in metrics:  # every completion is logged: the metrics count what they show
        results = [t for c in completions if c["step"] == m["step"] for t in c["turns"]["messages"] if t.get("name") == "calculator"]
        assert m["tools/calculator/call_frequency"] == len(results) / 16
        assert m["tools/calculator/failure_frequency"] == sum(r["content"].startswith("error: ") for r in results) / len(results)
    called = [c for c in completions if c["step"] == 2 and any(t["name"] == "calculator" for t in c["turns"]["tool_calls"])]
    assert called and all(c["turns"]["messages"][1]["role"] == "tool" for c in called)
    result = called[0]["turns"]["messages"][1]["content"]
    assert f"<tool_response>\n{result}\n</tool_response>" in called[0]["completion"]  # inserted as the template renders it
    shown = cli_here("show", out, "--width", "200").stdout
    assert "model (v1) calls calculator(" in shown and f"calculator returned: {result}" in shown


TOOL_RESULTS = "def tool_results(completions, **kwargs):\n    return [float(sum(m['role'] == 'tool' for m in c)) for c in completions]\n"


def test_a_lora_run_trains_only_its_adapters_on_the_model_turns_of_its_tool_calls(tool_model, files, tmp_path):
    # LoRA in the colocated engine, which generates every turn with the adapter layers. The reward
    # counts tool results, so groups differ and each step has a gradient through the model turns.
    _, data = files
    out = tmp_path / "run"
    (tmp_path / "uses.py").write_text(TOOL_RESULTS)
    train(1, _args(tool_model, data, out, 16, "--max_steps", "2", "--reward_funcs", f"{tmp_path / 'uses.py'}:tool_results",
                   "--tools", "calculator", "--max_tool_calling_iterations", "1", "--use_peft", "true",
                   "--lora_target_modules", "all-linear", "--save_steps", "2", "--learning_rate", "1e-3"))  # fmt: skip
    metrics, _ = _read(out)
    assert all(m["tools/calculator/call_frequency"] > 0 and m["multi_turn/turns/max"] == 2 for m in metrics)
    assert all(m["grad_norm"] > 0 for m in metrics)
    saved = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved) and not (out / "checkpoint-2" / "model.safetensors").exists()
    assert any(saved[name].abs().max() > 0 for name in saved if "lora_B" in name)  # B starts at zero: it trained


def test_two_processes_train_an_async_multi_turn_run_exactly_like_one(tool_model, files, server, tmp_path):
    # Every turn of round r is generated at version max(0, r - 1), and two processes with half
    # the batch train as one: the same trajectories, rewards and losses.
    folder, data = files
    extra = ["--max_steps", "4", "--reward_funcs", "environment", "--environment_factory", f"{folder / 'rounds.py'}:Rounds",
             "--rollout_mode", "server", "--rollout_server_urls", server.url, "--off_policy_correction", "none",
             "--async_generate", "true", "--max_staleness", "1", "--learning_rate", "1e-3"]  # fmt: skip
    # (At 1e-2 Rounds' reward, digits, drove completions to max_completion_length within three
    # steps, ending trajectories before their third turn.)
    train(1, _args(tool_model, data, tmp_path / "one", 16, *extra))  # its turns end (the random model's seldom do)
    train(2, _args(tool_model, data, tmp_path / "two", 8, *extra), trace=tmp_path / "trace")
    assert same_collectives(tmp_path / "trace").count("sum turn counts") == 4
    (one, one_c), (two, two_c) = _read(tmp_path / "one"), _read(tmp_path / "two")
    for c in one_c + two_c:  # three turns, unless max_completion_length ends it first
        turns = c["turns"]["versions"]
        assert turns == [max(0, c["round"] - 1)] * len(turns) and (len(turns) == 3 or c["finish_reason"] == "length"), (c["round"], turns)
    assert all(m["multi_turn/turns/max"] == 3 for m in one + two)
    # Round 0 is trained at the version that generated it: the trainer's log-probs of the model's
    # tokens, recomputed around the inserted ones, are the server's to the last bits.
    assert one[0]["kl_behav_proximal"] < 1e-9 and two[0]["kl_behav_proximal"] < 1e-9
    assert [m["reward"] for m in one] == [m["reward"] for m in two] and len({m["reward"] for m in one}) > 1
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    # rank 0's trajectories are the first half of each round's in both
    assert [c["completion"] for c in one_c if c["round"] == 1][:8] == [c["completion"] for c in two_c if c["round"] == 1][:8]


def _whole_and_killed(tool_model, data, tmp_path, extra: list) -> Path:
    """The run whole (tmp_path/whole), and again (tmp_path/killed) killed past step 3: its latest checkpoint."""
    train(1, _args(tool_model, data, tmp_path / "whole", 16, *extra))
    out = tmp_path / "killed"
    return killed_past_step(_args(tool_model, data, out, 16, *extra), out, 3)


def _assert_resumes_bitwise(tool_model, data, tmp_path, extra: list, steps: int) -> None:
    """The killed run resumed to its end trains as the whole one: every loss and reward, and the weights, bitwise."""
    out = tmp_path / "killed"
    train(1, _args(tool_model, data, out, 16, *extra, "--resume_from_checkpoint", "latest"))
    (m_whole, _), (m_resumed, _) = _read(tmp_path / "whole"), _read(out)
    assert [m["step"] for m in m_resumed] == list(range(1, steps + 1))
    assert [m["loss"] for m in m_resumed] == [m["loss"] for m in m_whole] and [m["reward"] for m in m_resumed] == [m["reward"] for m in m_whole]
    whole, resumed = load_file(tmp_path / "whole" / f"checkpoint-{steps}" / "model.safetensors"), load_file(out / f"checkpoint-{steps}" / "model.safetensors")
    assert all((whole[k] == resumed[k]).all() for k in whole), "weights must be bitwise equal"


def test_a_killed_async_multi_turn_run_resumes_bitwise_from_rounds_saved_whole(tool_model, files, server, tmp_path):
    folder, data = files
    # At 1e-3, as above: at 1e-2 Rounds' trajectories soon end before their third turn.
    extra = ["--max_steps", "8", "--save_steps", "2", "--reward_funcs", "environment", "--environment_factory", f"{folder / 'rounds.py'}:Rounds",
             "--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true", "--learning_rate", "1e-3"]  # fmt: skip
    latest = _whole_and_killed(tool_model, data, tmp_path, extra)
    assert latest.name in ("checkpoint-2", "checkpoint-4", "checkpoint-6")
    # the round generated ahead is in the checkpoint whole: its trajectories' turns and masks
    ahead = [r for rnd in json.loads((latest / "rounds_0.json").read_text()) for r in rnd["rollouts"]]
    several = [r for r in ahead if r["turns"]["turns"] > 1]
    assert several and all(0 in r["loss_mask"] and len(r["loss_mask"]) == len(r["completion_ids"]) for r in several)
    _assert_resumes_bitwise(tool_model, data, tmp_path, extra, steps=8)


def test_a_killed_partial_rollouts_run_with_tools_resumes_bitwise_with_turns_across_versions(tool_model, files, server, tmp_path):
    # Partial rollouts with the calculator: a model turn continues across versions in calls of 16
    # tokens, its tool runs when the turn ends, and the next turn goes on at the next version.
    folder, data = files
    (folder / "uses.py").write_text(TOOL_RESULTS)  # a reward that varies within groups: every step trains
    extra = ["--max_steps", "6", "--save_steps", "2", "--reward_funcs", f"{folder / 'uses.py'}:tool_results", "--tools", "calculator", "--max_tool_calling_iterations",
             "1", "--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true", "--max_staleness", "3",
             "--max_tokens_per_round", "16", "--learning_rate", "1e-4"]  # fmt: skip
    latest = _whole_and_killed(tool_model, data, tmp_path, extra)
    metrics, completions = _read(tmp_path / "whole")
    for c in completions:  # each model token of round r is of a version in [r - 3, r - 1] (round 0: 0)
        assert versions_within(c, 3), (c["round"], c["token_versions"])
        assert c["turns"]["versions"][0] == c["policy_version"] == c["token_versions"][0][0]
    called = [c for c in completions if c["turns"]["tool_calls"]]
    assert called and all(c["turns"]["messages"][1]["role"] == "tool" for c in called)
    assert any(len(c["token_versions"]) > 1 for c in called), "a trajectory with a tool call spans versions"
    assert all(m["staleness/max"] <= 3 and m["tools/calculator/call_frequency"] > 0 and m["grad_norm"] > 0 for m in metrics)
    in_flight = json.loads((latest / "in_flight_0.json").read_text())  # trajectories saved mid-way, with their turns
    assert any(t["finish"] is None and t["ids"] for f in in_flight["flights"] for t in f["seqs"])
    _assert_resumes_bitwise(tool_model, data, tmp_path, extra, steps=6)


def test_a_killed_partial_rollouts_run_with_an_environment_resumes_bitwise_by_replaying_its_steps(tool_model, files, server, tmp_path):
    # Rounds' three turns in calls of 8 tokens: a turn spans versions, and the checkpoint holds
    # trajectories in flight without their environments, which the resumed run makes again by
    # replaying the steps each saw (its reward counts the digits of every turn).
    folder, data = files
    extra = ["--max_steps", "6", "--save_steps", "2", "--reward_funcs", "environment", "--environment_factory", f"{folder / 'rounds.py'}:Rounds",
             "--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true", "--max_staleness", "3",
             "--max_tokens_per_round", "8", "--learning_rate", "1e-3"]  # fmt: skip
    latest = _whole_and_killed(tool_model, data, tmp_path, extra)
    metrics, completions = _read(tmp_path / "whole")
    assert any(len(c["token_versions"]) > 1 and c["turns"]["turns"] > 1 for c in completions), "a trajectory of several turns spans versions"
    assert all(versions_within(c, 3) for c in completions)
    in_flight = [t for f in json.loads((latest / "in_flight_0.json").read_text())["flights"] for t in f["seqs"]]
    assert any(t["finish"] is None and t["env_log"] for t in in_flight), "a trajectory saved after a step of its environment"
    _assert_resumes_bitwise(tool_model, data, tmp_path, extra, steps=6)


# Rounds as an agent written against OpenAI's API (agent_func): three turns, "Once more." between
# them, its reward the digits the model wrote. `rewriting` edits its history before the third
# request where the first answer is of odd length, which starts a second row of its session:
# both train (agent_train_rows: all).
ROUNDS_AGENT = """
import openai

async def rounds(row, client, edit=False):
    messages, digits = list(row["prompt"]), 0
    try:
        for turn in range(3):
            if edit and turn == 2 and len(messages[len(row["prompt"])]["content"]) % 2:
                messages[len(row["prompt"]) + 1] = {"role": "user", "content": "Once more, please."}
            answer = await client.chat.completions.create(model="policy", messages=messages)
            text = answer.choices[0].message.content
            digits += sum(ch.isdigit() for ch in text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Once more."}]
    except openai.BadRequestError:  # max_completion_length reached: the episode ends there
        pass
    return min(digits, 8) / 8

async def rewriting(row, client):
    return await rounds(row, client, edit=True)
"""


def _agent_extra(folder, server, *more):
    (folder / "rounds_agent.py").write_text(ROUNDS_AGENT)
    return ["--reward_funcs", "environment", "--agent_func", f"{folder / 'rounds_agent.py'}:rewriting", "--rollout_mode", "server",
            "--rollout_server_urls", server.url, "--async_generate", "true", "--learning_rate", "1e-3", *more]  # fmt: skip


def test_two_processes_train_an_async_agent_run_exactly_like_one_with_every_turn_at_its_rounds_version(tool_model, files, server, tmp_path):
    # The agent's requests go to the trainer's endpoint, which generates them on the rollout
    # server with the round's version floor: every turn of round r at version max(0, r - 1).
    # Its sessions are one row or two, so the two processes train different numbers of rows, and
    # still as one process does.
    folder, data = files
    extra = _agent_extra(folder, server, "--max_steps", "4", "--off_policy_correction", "none", "--max_staleness", "1")
    train(1, _args(tool_model, data, tmp_path / "one", 16, *extra))
    train(2, _args(tool_model, data, tmp_path / "two", 8, *extra))
    (one, one_c), (two, two_c) = _read(tmp_path / "one"), _read(tmp_path / "two")
    for c in one_c + two_c:
        turns, rows = c["turns"]["versions"], c["turns"]["agent"]["rows"]
        assert turns == [max(0, c["round"] - 1)] * len(turns) and (rows, len(turns)) in ((2, 1), (1, 3), (1, 2), (1, 1)), (c["round"], turns, rows)
    assert all(m["agents/errors"] == 0 and m["agents/rows_per_trajectory"] == 1 + m["agents/new_rows"] for m in one + two)
    assert 1 < sum(m["agents/rows_per_trajectory"] for m in one) / len(one) < 2
    assert one[0]["kl_behav_proximal"] < 1e-9  # the trainer's log-probs of the agent's tokens are the server's
    assert [m["reward"] for m in one] == [m["reward"] for m in two] and len({m["reward"] for m in one}) > 1
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    assert [c["completion"] for c in one_c if c["round"] == 1][:8] == [c["completion"] for c in two_c if c["round"] == 1][:8]


def test_a_colocated_lora_agent_run_generates_each_turn_with_the_rounds_adapters(tool_model, files, tmp_path):
    # Colocated: the endpoint's requests are generated by the trainer's own engine, under the
    # adapters of the round (version r, synchronous).
    folder, data = files
    (folder / "rounds_agent.py").write_text(ROUNDS_AGENT)
    out = tmp_path / "run"
    train(1, _args(tool_model, data, out, 16, "--max_steps", "2", "--reward_funcs", "environment", "--agent_func", f"{folder / 'rounds_agent.py'}:rounds",
                   "--use_peft", "true", "--lora_target_modules", "all-linear", "--save_steps", "2", "--learning_rate", "1e-3"))  # fmt: skip
    metrics, completions = _read(out)
    assert all(m["multi_turn/turns/max"] == 3 and m["grad_norm"] > 0 for m in metrics)
    assert all(c["turns"]["versions"] == [c["round"]] * c["turns"]["turns"] for c in completions)
    saved = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert any(saved[name].abs().max() > 0 for name in saved if "lora_B" in name)


def test_a_run_whose_agents_mostly_fail_stops_with_their_first_error_and_keeps_what_it_trained(tool_model, files, tmp_path):
    # Such a run (every agent's request a 404 or a 400) ended with exit code 0 and a warning that
    # blamed the dataset's columns; the agents' error was only in completions.jsonl.
    folder, data = files
    (folder / "broken_agent.py").write_text("async def broken(row, client):\n    raise RuntimeError('the agent cannot reach its tool')\n")
    out = tmp_path / "run"
    proc = cli_here("train", *_args(tool_model, data, out, 8, "--max_steps", "2", "--reward_funcs", "environment",
                                    "--agent_func", f"{folder / 'broken_agent.py'}:broken"))  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "more than half of the agents failed on each of the last 2 steps (100% on the last)" in proc.stderr, proc.stderr[-2000:]
    assert "the first failure here, 16 times: RuntimeError: the agent cannot reach its tool" in proc.stderr  # 8 agents a round, 2 rounds
    assert "trained 2 of 2 steps" in proc.stderr and (out / "checkpoint-2").is_dir() and "Traceback" not in proc.stderr


# Structured output as two frameworks write it: LangChain's with_structured_output (chat's
# response_format json_schema) and the Agents SDK's output_type on its Responses model.
TYPED_AGENT = """
from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Sum(BaseModel):
    sum: int = Field(ge=0, le=99)


async def typed(row, client):
    set_tracing_disabled(True)
    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0, max_tokens=40)
    chained = await llm.with_structured_output(Sum).ainvoke(row["prompt"])
    agent = Agent(name="typed", model=OpenAIResponsesModel(model="policy", openai_client=client), output_type=Sum)
    sdk = await Runner.run(agent, row["prompt"][-1]["content"], max_turns=1)
    return float(chained.sum == sdk.final_output.sum == int(row["answer"]))
"""


def test_frameworks_structured_output_trains_through_a_rollout_server_with_no_agent_error(tool_model, files, server, tmp_path):
    # Both were a 400 before ("response_format ... is not supported"): every episode failed.
    pytest.importorskip("langchain_openai", reason="LangChain (./setup.sh installs the agents extra)")
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (./setup.sh installs it; the vLLM environment cannot: websockets<17)")
    folder, data = files
    (folder / "typed_agent.py").write_text(TYPED_AGENT)
    out = tmp_path / "run"
    train(1, _args(tool_model, data, out, 8, "--max_steps", "2", "--reward_funcs", "environment", "--agent_func", f"{folder / 'typed_agent.py'}:typed",
                   "--rollout_mode", "server", "--rollout_server_urls", server.url))  # fmt: skip
    metrics, completions = _read(out)
    assert all(m["agents/errors"] == 0 and m["agents/timeouts"] == 0 for m in metrics), metrics
    answers = [json.loads(c["completion"].removesuffix("<|im_end|>")) for c in completions]  # the SDK's, the row trained
    assert len(answers) == 16 and all(0 <= a["sum"] <= 99 for a in answers)


def test_a_killed_async_agent_run_resumes_bitwise_from_rounds_of_whole_sessions(tool_model, files, server, tmp_path):
    # Without the off-policy correction: the server batches the agents' requests as they arrive
    # over HTTP, which can move the last bits of the behaviour log-probs (never a token), and the
    # correction would carry them into the loss (measured: 5e-6 of a loss once in CI).
    folder, data = files
    extra = _agent_extra(folder, server, "--max_steps", "6", "--save_steps", "2", "--off_policy_correction", "none")
    latest = _whole_and_killed(tool_model, data, tmp_path, extra)
    ahead = [r for rnd in json.loads((latest / "rounds_0.json").read_text()) for r in rnd["rollouts"]]
    assert ahead and all(r["turns"]["agent"] is not None and 0 in r["loss_mask"] for r in ahead if r["turns"]["turns"] > 1)
    assert any(r["earlier"] and 0 in r["earlier"][0]["loss_mask"] for r in ahead)  # a session's first row, saved with its last
    _assert_resumes_bitwise(tool_model, data, tmp_path, extra, steps=6)


# Tools that take their process down with them, or flood its output.
UNRULY = '''
import os, sys, time

def quits(x: int) -> str:
    """End the process.

    Args:
        x: its exit code
    """
    os._exit(x)

def floods(x: int) -> str:
    """Print 50 MB, then answer.

    Args:
        x: a number
    """
    line = "y" * 1_000_000
    for _ in range(50):
        print(line)
    return str(x)

def sleeps(x: int) -> str:
    """Sleep x seconds.

    Args:
        x: seconds
    """
    time.sleep(x)
    return "awake"
'''


def test_tool_workers_contain_a_tool_that_ends_its_process_floods_or_hangs(tmp_path):
    (tmp_path / "unruly.py").write_text(UNRULY)
    tools = {t.name: t for t in load_tools([f"{tmp_path / 'unruly.py'}:{n}" for n in ("quits", "floods", "sleeps")] + ["calculator"])}
    runner = ToolRunner(timeout=3, processes=ToolWorkers(2))
    results = runner.run([(tools, ToolCall("quits", {"x": 0})), (tools, ToolCall("floods", {"x": 7}))])
    assert results[0].content == "error: quits ended its worker process (exit code 0); a tool must return its result"
    assert (results[1].ok, results[1].content) == (True, "7")  # its 50 MB went to /dev/null
    hung = runner.run([(tools, ToolCall("sleeps", {"x": 60}))])[0]
    assert hung.content == "error: sleeps took longer than tool_timeout (3s); its worker process was ended" and hung.seconds < 10
    # fresh workers took the ended ones' places
    assert [r.content for r in runner.run([(tools, ToolCall("calculator", {"expression": "6*7"}))] * 3)] == ["42"] * 3
    runner.close()


def test_a_tool_that_ends_its_process_fails_its_calls_in_a_worker_and_the_run_trains_on(tool_model, files, tmp_path):
    # In the trainer's process, os._exit(0) in a tool ended the run with exit code 0 and no
    # message, after training nothing. In a worker (tool_workers) each call fails, shown and counted.
    # Every call waits for a fresh worker process, and its wait counts against tool_timeout. On a
    # loaded CI machine a later call once got another message (cut off in the log; most likely
    # the default 30 s passed, 16 calls going through 2 workers): the timeout is raised here.
    folder, data = files
    (folder / "exits.py").write_text(UNRULY.replace("def quits(x: int)", "def calculator(expression: str)").replace("os._exit(x)", "os._exit(0)")
                                     .replace("x: its exit code", "expression: ignored"))  # fmt: skip
    out = tmp_path / "run"
    proc = subprocess.run(command(1, _args(tool_model, data, out, 16, "--max_steps", "2", "--reward_funcs", "exact_match", "--tools",
                                           f"{folder / 'exits.py'}:calculator", "--tool_workers", "2", "--max_tool_calling_iterations", "1",
                                           "--learning_rate", "1e-4", "--tool_timeout", "240")), capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics, completions = _read(out)
    assert [m["step"] for m in metrics] == [1, 2] and all(m["tools/calculator/call_frequency"] > 0 for m in metrics)
    assert all(m["tools/calculator/failure_frequency"] == 1.0 for m in metrics)
    results = [t["content"] for c in completions for t in c["turns"]["messages"] if t.get("name") == "calculator"]
    assert results and all(r == "error: calculator ended its worker process (exit code 0); a tool must return its result" for r in results)
