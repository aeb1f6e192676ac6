"""agent_func: agents written against OpenAI's API, trained through sessions of the endpoint.

The agents here are real clients: OpenAI's own Python client (async, and sync in a thread, with
and without stream) and the OpenAI Agents SDK, unmodified, talking HTTP to the trainer's
endpoint (a real uvicorn server). The engine is the real transformers engine on the tiny model.
What is checked: every trained token is the engine's, generated on exactly the tokens before it,
from the seed of its turn; a rewritten history starts a row and is never spliced; bounds, hangs
and failures end an episode with a metric; sessions refuse what they cannot honour. The modes
(colocated, server sync and async, 2 processes, resume) are trained through the CLI below.
"""

import asyncio
import functools
import json
import time
from dataclasses import replace

import openai
import pydantic
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.engines.engine import TransformersEngine, eos_token_ids
from tandem.rollout.agents import AgentFunction, AgentOptions
from tandem.rollout.multiturn import Prompt, Trajectory, turn_seed
from tandem.rollout.types import Completion, SamplingParams
from tandem.server import openai_protocol as O
from tandem.server.sessions import Bounds, SessionServing, SessionStore

PARAMS = SamplingParams(max_tokens=64)
QUESTIONS = ["2+3=", "4+1="]


@pytest.fixture(scope="module")
def local(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model)
    return TransformersEngine(lm, eos_token_ids(tok, lm.generation_config, str(tiny_model)), tok.pad_token_id, tokenizer=tok), tok


def _run(local, fn, seeds=(11, 22), timeout=30.0, failure="drop", max_turns=8, max_len=64, min_version=0, max_prompt=None, name="test:agent", workers=0,
         rows="all"):  # fmt: skip
    engine, tok = local
    agents = AgentFunction(fn, name, tok, SessionServing(SessionStore(), tok, "policy", PARAMS, {}, "hermes", max_context=1024),
                           AgentOptions(timeout, Bounds(max_turns, max_len, max_prompt, 1024), failure, workers, rows))  # fmt: skip
    prompts = []
    for q in QUESTIONS[: len(seeds)]:
        messages = [{"role": "user", "content": q}]
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(ids, messages, {"answer": "5"}))
    try:
        return agents.generate(engine, prompts, PARAMS, list(seeds), min_version), agents
    finally:
        agents.close()


def _turn_starts(mask: list[int]) -> list[int]:
    return [k for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1])]


def _assert_engine_tokens(local, traj, seed: int, grammars=None):
    """Each run of trained tokens is what the engine generates on the tokens before it, from the
    seed of its turn of the session (the trained row's turns are the session's last): token ids
    and behaviour log-probs alike. `grammars`: each turn's, where they were constrained."""
    engine, _ = local
    first_turn = traj.info["agent"]["requests"] - traj.info["turns"]
    starts = _turn_starts(traj.loss_mask)
    assert len(starts) == traj.info["turns"] >= 1
    for k, pos in enumerate(starts):
        end = next((j for j in range(pos, len(traj.loss_mask)) if not traj.loss_mask[j]), len(traj.loss_mask))
        params = replace(PARAMS, max_tokens=max(PARAMS.max_tokens, end - pos), grammar=grammars[k] if grammars else None)
        (want,) = engine.generate([traj.prompt_ids + traj.token_ids[:pos]], params, [turn_seed(seed, first_turn + k)])
        assert traj.token_ids[pos:end] == want.token_ids[: end - pos]
        assert traj.logprobs[pos:end] == pytest.approx(want.logprobs[: end - pos], abs=1e-5)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)


async def _ask_twice(row, client):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="any", messages=messages, max_tokens=6, logprobs=True)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="any", messages=messages, max_tokens=6)
    return float(second.choices[0].message.content == row["answer"])


@pytest.mark.quick
def test_an_agents_turns_are_the_engines_tokens_with_the_glue_between_them_out_of_the_loss(local):
    (t0, t1), _ = _run(local, _ask_twice, min_version=0)
    _, tok = local
    for traj, seed in ((t0, 11), (t1, 22)):
        _assert_engine_tokens(local, traj, seed)
        assert traj.info["turns"] == 2 and traj.info["versions"] == [0, 0] and traj.info["agent"]["new_rows"] == 0
        # between the turns: the template's glue and the user's "Sure?", never trained
        glue = tok.decode([i for i, m in zip(traj.token_ids, traj.loss_mask) if not m])
        assert "Sure?" in glue and "<|im_start|>user" in glue
        assert [m["role"] for m in traj.info["messages"]] == ["assistant", "user", "assistant"]
        assert traj.info["environment_reward"] in (0.0, 1.0) and traj.finish_reason in ("stop", "length")
    assert t0.token_ids != t1.token_ids  # sessions draw from seeds of their own
    # the same seeds, the same trajectories (a deterministic agent is reproducible from the run's
    # seed); the log-probs to rounding, as the turns may batch otherwise (on AVX2 a row's last bits
    # move with the rows beside it: 5e-7 measured)
    (again, _), _ = _run(local, _ask_twice)
    assert again.token_ids == t0.token_ids and again.logprobs == pytest.approx(t0.logprobs, abs=1e-5)


REFUSED: list[str] = []


async def _floods(row, client):
    # 10^5 messages (3.4 MB) kept a colocated run past agent_timeout (20 s: still running at
    # 240 s); one 30 MB message took 171 s to refuse. 5,000 here: openai's client itself takes
    # 15 s to send 10^5 (it transforms every message).
    for messages in ([{"role": "user", "content": "hi there"}] * 5_000, [{"role": "user", "content": "x" * 30 * 2**20}]):
        try:
            await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        except openai.BadRequestError as exc:
            REFUSED.append(exc.message)
    await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)  # the session goes on
    return 1.0


def test_a_request_that_cannot_fit_the_context_is_refused_before_it_is_rendered(local):
    start = time.monotonic()
    (traj,), _ = _run(local, _floods, seeds=(5,), timeout=20.0)
    assert time.monotonic() - start < 10, time.monotonic() - start
    assert len(REFUSED) == 2 and "5000 messages cannot fit the model's context of 1024 tokens" in REFUSED[0], REFUSED
    assert "characters cannot fit the model's context of 1024 tokens" in REFUSED[1], REFUSED
    assert traj.info["agent"]["error"] is False and traj.info["environment_reward"] == 1.0 and traj.info["turns"] == 1


async def _rewrites(row, client):
    first = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)
    reply = first.choices[0].message.content
    # the agent edits its history: its own earlier reply, summarised
    edited = [*row["prompt"], {"role": "assistant", "content": reply + "!"}, {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="any", messages=edited, max_tokens=4)
    edited += [{"role": "assistant", "content": second.choices[0].message.content}, {"role": "user", "content": "Once more."}]
    await client.chat.completions.create(model="any", messages=edited, max_tokens=4)


@pytest.mark.quick
def test_an_agent_that_rewrites_its_history_starts_a_new_row_and_nothing_is_spliced(local):
    (traj,), _ = _run(local, _rewrites, seeds=(7,))
    _, tok = local
    # the last row begins at the rewritten request, rendered whole as its prompt: the edited
    # reply is prompt, not trained there; its two turns (session turns 1 and 2) are the engine's
    assert traj.info["agent"]["new_rows"] == 1 and traj.info["agent"]["rows"] == 2 and traj.info["turns"] == 2
    assert "Again." in tok.decode(traj.prompt_ids) and "Once more." in tok.decode(traj.token_ids)
    _assert_engine_tokens(local, traj, 7)
    # the first row, the session's turn 0 as the engine answered it, trains too (agent_train_rows: all)
    (first,) = traj.earlier
    assert first["prompt_ids"] == traj.prompt_ids[: len(first["prompt_ids"])] and sum(first["loss_mask"]) == len(first["completion_ids"]) >= 1
    row = Trajectory(first["completion_ids"], first["behav_logprobs"], first["loss_mask"], traj.finish_reason, first["version"],
                     first["prompt_ids"], {"turns": 1, "agent": {"requests": 1}})  # fmt: skip
    _assert_engine_tokens(local, row, 7)
    (last,), _ = _run(local, _rewrites, seeds=(7,), rows="last")
    assert last.earlier is None and last.info["agent"]["rows"] == 1 and last.token_ids == traj.token_ids


async def _streams(row, client):
    # a sync client in a thread, streamed; then the async one, streamed, in the same session
    sync = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    chunks = await asyncio.to_thread(lambda: list(sync.chat.completions.create(model="any", messages=row["prompt"], max_tokens=5, stream=True)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages = [*row["prompt"], {"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
    stream = await client.chat.completions.create(model="any", messages=messages, max_tokens=5, stream=True)
    async for _ in stream:
        pass


def test_streamed_turns_from_the_sync_and_async_clients_continue_one_row(local):
    (traj,), _ = _run(local, _streams, seeds=(3,))
    assert traj.info["turns"] == 2 and traj.info["agent"]["new_rows"] == 0
    _assert_engine_tokens(local, traj, 3)


async def _hangs(row, client):
    await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)
    await asyncio.Event().wait()  # never returns


async def _raises(row, client):
    await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def _too_long(row, client):
    messages = list(row["prompt"])
    for _ in range(10):  # past max_turns: the next request is refused, and the agent raises on it
        answer = await client.chat.completions.create(model="any", messages=messages, max_tokens=2)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content}, {"role": "user", "content": "More."}]


def test_an_agent_that_hangs_raises_or_overruns_its_bounds_ends_with_a_metric_and_the_round_goes_on(local):
    t = time.monotonic()
    (hung,), _ = _run(local, _hangs, seeds=(5,), timeout=2.0)
    assert time.monotonic() - t < 2.0 + 5.0
    assert hung.info["agent"]["timeout"] and hung.finish_reason == "error"  # dropped: no reward, no loss
    (raised,), _ = _run(local, _raises, seeds=(5,), failure="zero")
    assert raised.info["agent"]["error"] and "the agent's own bug" in raised.info["agent"]["why"]
    assert raised.info["zero_reward"] and raised.finish_reason != "error" and raised.info["turns"] == 1  # scored 0, its turn trained
    (bounded,), _ = _run(local, _too_long, seeds=(5,), max_turns=3)
    # the refused 4th request ended the episode: not an error, its 3 turns train
    assert not bounded.info["agent"]["error"] and bounded.info["turns"] == 3 and "max_turns=3" in bounded.info["agent"]["why"]
    _assert_engine_tokens(local, bounded, 5)


@pytest.mark.quick
def test_a_session_refuses_what_it_cannot_honour_and_is_gone_once_its_episode_ends(local):
    seen = {}

    async def probe(row, client):
        seen["url"], key = str(client.base_url), client.api_key
        refused = {}
        for name, extra in [("temperature", {"temperature": 0.5}), ("n", {"n": 2}), ("seed", {"seed": 1})]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2, **extra)
            refused[name] = info.value.message
        other = openai.AsyncOpenAI(base_url=seen["url"].replace(seen["url"].split("/")[-2], "x" * 24), api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await other.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2)
        no_key = openai.AsyncOpenAI(base_url=seen["url"], api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await no_key.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2)
        seen["refused"] = refused
        seen["models"] = [m.id for m in (await client.models.list()).data]
        seen["key"] = key
        await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2)

    (traj,), _ = _run(local, probe, seeds=(1,))
    assert all(name in message for name, message in seen["refused"].items()), seen["refused"]
    assert seen["models"] == ["policy"] and traj.info["turns"] == 1  # refused requests are no turns
    # after the episode, its session is closed (and the endpoint with the round's agents)
    with pytest.raises((openai.NotFoundError, openai.APIConnectionError)):
        openai.OpenAI(base_url=seen["url"], api_key=seen["key"], max_retries=0).chat.completions.create(model="any", messages=[{"role": "user", "content": "?"}])


async def _sdk_agent(row, client):
    """An OpenAI Agents SDK agent with a function tool, as its docs write one; then a second run
    on its history with the question rewritten (as an agent that summarises or edits its memory)."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 2+2.
        """
        return str(eval(expression, {"__builtins__": {}}))  # the test's own tool, on the test's own inputs

    agent = Agent(name="adder", model=OpenAIChatCompletionsModel(model="policy", openai_client=client), tools=[calculator])
    first = await Runner.run(agent, row["prompt"][-1]["content"], max_turns=2)
    history = first.to_input_list()
    history[0] = {"role": "user", "content": "Once more: " + row["prompt"][-1]["content"]}
    await Runner.run(agent, history + [{"role": "user", "content": "Sure?"}], max_turns=2)


def test_an_unmodified_agents_sdk_agent_trains_on_the_engines_tokens_after_it_rewrites_its_history(local):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (./setup.sh installs it; the vLLM environment cannot: websockets<17)")
    (traj,), _ = _run(local, _sdk_agent, seeds=(9,))
    _, tok = local
    assert traj.info["agent"]["why"] is None, traj.info["agent"]["why"]
    # the second run rewrote the first question: a new row, rendered from its request, whose turns are the engine's
    assert traj.info["agent"]["new_rows"] == 1 and "Once more:" in tok.decode(traj.prompt_ids)
    _assert_engine_tokens(local, traj, 9)


@pytest.mark.quick
def test_a_sessions_turns_join_as_the_template_renders_them_and_each_answer_reports_its_own_prompt(local):
    # The engine's answers are scripted here (the session's one boundary: submit): turns that
    # end with the model's own <|im_end|>, which a random tiny model rarely writes.
    _, tok = local
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = [tok.encode("Hi", add_special_tokens=False) + [im_end], tok.encode("Yes", add_special_tokens=False) + [im_end],
               tok.encode("Maybe so, yes", add_special_tokens=False)]  # fmt: skip

    async def submit(ids, max_tokens, seed, grammar):
        ids = answers.pop(0)
        return Completion(ids, [-0.5] * len(ids), "stop" if ids[-1] == im_end else "length", 0)

    store = SessionStore()
    serving = SessionServing(store, tok, "policy", PARAMS, {}, "hermes", max_context=1024)
    session = store.open(1, submit, Bounds(8, 64))
    messages = [{"role": "user", "content": "2+3="}]

    async def conversation():
        replies = []
        for follow_up, stop in (("Sure?", None), ("Why?", None), (None, [" so"])):
            reply = await serving.session_chat(session.id, O.ChatCompletionRequest(model="policy", messages=messages, stop=stop))
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return replies

    first, second, third = asyncio.run(conversation())
    (row,) = store.close(session.id)
    # 1. one <|im_end|> after each finished turn: the row is what the template renders
    through_second = len(second.prompt_token_ids) + len(second.choices[0].token_ids)
    rendered = tok.apply_chat_template(messages[:4], tokenize=False)  # the prompt and the first two turns
    assert tok.decode((row.prompt_ids + row.ids)[:through_second], skip_special_tokens=False) == rendered.rstrip("\n")
    assert "<|im_end|><|im_end|>" not in tok.decode(row.ids, skip_special_tokens=False)
    # 2. each answer's prompt is the context before it (it was read after the answer joined the row)
    assert first.prompt_token_ids == row.prompt_ids and first.usage.prompt_tokens == len(row.prompt_ids)
    assert second.prompt_token_ids + second.choices[0].token_ids == (row.prompt_ids + row.ids)[: len(second.prompt_token_ids) + len(second.choices[0].token_ids)]
    assert third.prompt_token_ids == (row.prompt_ids + row.ids)[: len(third.prompt_token_ids)]
    # 3. a turn cut at a stop string is answered and trained as stopped, not as truncated
    assert third.choices[0].finish_reason == "stop" and third.choices[0].message.content == "Maybe" and row.finish == "stop"
    # the glue leaves out the start of what the template writes only where the model wrote it as
    # its stop token: a turn cut after a "<" keeps the template's <|im_end|>
    glue, more = serving.glue(None), [{"role": "user", "content": "q"}]
    assert glue.inserted("x<|im_end|>", more)[0] != im_end and glue.inserted("x<", more)[0] == im_end


async def _past_bounds(row, client):
    """Requests past each bound an agent can reach; each is refused to it, and the episode ends
    with one that fits."""
    refused = {}
    asks = {
        "context": lambda: client.chat.completions.create(model="any", messages=[{"role": "user", "content": " 7" * 1500}], max_tokens=2),
        "max_prompt_length": lambda: client.chat.completions.create(model="any", messages=[{"role": "user", "content": " 7" * 300}], max_tokens=2),
        "vocabulary": lambda: client.completions.create(model="any", prompt=[1, 2, 10**6], max_tokens=2),
        "negative": lambda: client.completions.create(model="any", prompt=[1, -3], max_tokens=2),
    }
    for name, ask in asks.items():
        try:
            await ask()
        except openai.BadRequestError as exc:
            refused[name] = exc.message
    REFUSED[:] = [refused]
    answer = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=3)
    return float(bool(answer.choices[0].token_ids))


def test_a_request_past_the_context_the_prompt_bound_or_the_vocabulary_is_that_agents_400_and_the_round_goes_on(local):
    # Before, the over-long prompt trained past the model's 1,024 positions colocated (and
    # stopped the run in server mode), and the ids outside the vocabulary failed the round.
    (traj, other), _ = _run(local, _past_bounds, seeds=(5, 6), max_prompt=200)
    (refused,) = REFUSED
    assert "model's context (1024" in refused["context"] and "max_prompt_length=200" in refused["max_prompt_length"], refused
    assert "token id 1000000 is outside the model's vocabulary" in refused["vocabulary"] and "token id -3" in refused["negative"], refused
    # the agents' last requests trained; a refusal by a bound is no error of theirs
    for t in (traj, other):
        assert not t.info["agent"]["error"] and t.info["environment_reward"] == 1.0 and t.info["turns"] == 1
    _assert_engine_tokens(local, traj, 5)


async def _exits(row, client):
    await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=2)
    raise SystemExit(3)


async def _interrupts(row, client):
    raise KeyboardInterrupt


async def _cancels_itself(row, client):
    raise asyncio.CancelledError


async def _absurd(row, client):
    return 10**400


async def _ignores_cancellation(row, client):
    while True:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # and goes on


@pytest.mark.quick
def test_every_way_an_agent_ends_is_its_own_failure_never_the_runs(local):
    # Each of these ended the run before (sys.exit's code as the run's, rc -2, a traceback), or
    # held it for ever (an agent that swallows its cancellation).
    for fn, expected in [(_exits, "sys.exit(3)"), (_interrupts, "KeyboardInterrupt"), (_cancels_itself, "CancelledError: the agent raised it"),
                         (_absurd, "an integer of 1329 bits; return a finite number")]:  # fmt: skip
        (traj,), _ = _run(local, fn, seeds=(5,))
        assert traj.info["agent"]["error"] and expected in traj.info["agent"]["why"], traj.info["agent"]
        assert traj.finish_reason == "error"  # dropped (agent_failure drop)

    async def one_stuck(row, client):
        return await (_ignores_cancellation if row["prompt"][-1]["content"] == QUESTIONS[0] else _ask_twice)(row, client)

    start = time.monotonic()
    (stuck, fine), _ = _run(local, one_stuck, timeout=3.0)
    assert time.monotonic() - start < 3.0 + 5.0 and stuck.info["agent"]["timeout"] and not fine.info["agent"]["timeout"]


def test_glues_kept_for_the_tools_agents_send_are_bounded(local):
    # An agent that sends tools of its own each time (one list per task) grew the trainer by a
    # glue each: 250 MB a step.
    _, tok = local
    serving = SessionServing(SessionStore(), tok, "policy", PARAMS, {}, "hermes", max_context=1024)
    for k in range(3 * SessionServing.GLUES):
        serving.glue([{"type": "function", "function": {"name": f"tool_{k}", "parameters": {"type": "object", "properties": {}}}}])
    assert len(serving._glues) == SessionServing.GLUES
    assert serving.glue(None) is serving.glue(None)  # the one in use stays kept


async def _responds(row, client):
    """The Responses API as the openai client calls it: text input with instructions, then
    previous_response_id streamed, then the whole conversation as items."""
    question = row["prompt"][-1]["content"]
    first = await client.responses.create(model="any", instructions="Add.", input=question, max_output_tokens=4)
    stream = await client.responses.create(model="any", previous_response_id=first.id, input=[{"role": "user", "content": "Sure?"}],
                                           max_output_tokens=4, stream=True)  # fmt: skip
    events = [event async for event in stream]
    second = events[-1].response
    items = [{"role": "user", "content": question}, *[o.model_dump() for o in first.output], {"role": "user", "content": "Sure?"},
             *[o.model_dump() for o in second.output], {"role": "user", "content": [{"type": "input_text", "text": "Once more."}]}]  # fmt: skip
    third = await client.responses.create(model="any", instructions="Add.", input=items, max_output_tokens=4)
    REFUSED[:] = [[e.type for e in events], first, third]
    return 1.0


def test_the_responses_api_in_a_session_continues_one_row_as_chat_does(local):
    (traj,), _ = _run(local, _responds, seeds=(4,), max_len=200)  # the glue is some 30 tokens of this tokenizer a turn
    assert traj.info["agent"]["why"] is None, traj.info["agent"]["why"]
    kinds, first, third = REFUSED
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete") and "response.output_item.done" in kinds
    assert first.output_text and first.output_token_ids and third.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    # three requests, one row: each extends the conversation, whichever way it was sent
    assert traj.info["agent"]["new_rows"] == 0 and traj.info["turns"] == 3, traj.info["agent"]
    _assert_engine_tokens(local, traj, 4)


def test_a_responses_function_call_comes_back_as_an_item_and_its_output_continues_the_row(local):
    _, tok = local
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.encode('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', add_special_tokens=False) + [im_end]
    answers = [call, tok.encode("5", add_special_tokens=False) + [im_end]]

    async def submit(ids, max_tokens, seed, grammar):
        ids = answers.pop(0)
        return Completion(ids, [-0.5] * len(ids), "stop", 0)

    store = SessionStore()
    serving = SessionServing(store, tok, "policy", PARAMS, {}, "hermes", max_context=1024)
    session = store.open(1, submit, Bounds(8, 256))
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}]

    async def conversation():
        first = await serving.session_responses(session.id, O.ResponsesRequest(model="policy", input="2+3=", tools=tools))
        (item,) = first.output
        output = {"type": "function_call_output", "call_id": item["call_id"], "output": "5"}
        second = await serving.session_responses(session.id, O.ResponsesRequest(model="policy", input=[output], tools=tools, previous_response_id=first.id))
        return item, second

    item, second = asyncio.run(conversation())
    (row,) = store.close(session.id)
    assert item["type"] == "function_call" and item["name"] == "add" and json.loads(item["arguments"]) == {"a": 2, "b": 3}
    assert second.output[0]["content"][0]["text"] == "5" and len(row.versions) == 2
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(row.ids) and row.mask.count(1) == len(call) + 2


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}  # a random model's numbers are long otherwise
ADD = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"]}}},
       {"type": "function", "function": {"name": "now"}}]  # fmt: skip
SUM = {"type": "json_schema", "json_schema": {"name": "sum", "schema": {"type": "object", "properties": {"sum": DIGIT}, "required": ["sum"], "additionalProperties": False}, "strict": True}}


async def _forced(row, client):
    """What smolagents' ToolCallingAgent and a structured-output agent send: a call forced
    (tool_choice required), its result, then the answer as JSON of a schema."""
    messages = list(row["prompt"])
    called = await client.chat.completions.create(model="any", messages=messages, tools=ADD, tool_choice="required", max_tokens=120)
    (call,) = called.choices[0].message.tool_calls[:1]
    messages += [called.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    answer = await client.chat.completions.create(model="any", messages=messages, tools=ADD, response_format=SUM, max_tokens=64)
    return float(json.loads(answer.choices[0].message.content)["sum"] == 5)


@pytest.mark.quick
def test_a_forced_call_and_a_json_answer_train_as_the_template_renders_them_from_the_masked_engine(local):
    # The random model would never write either: each turn is its grammar by construction, the
    # call re-renders to its own tokens (one row), and the trained tokens are the constrained
    # engine's from the turn's seed.
    (traj,), _ = _run(local, _forced, seeds=(3,), max_len=400)
    assert traj.info["agent"]["why"] is None, traj.info["agent"]["why"]
    assert traj.info["agent"]["new_rows"] == 0 and traj.info["turns"] == 2 and traj.info["environment_reward"] in (0.0, 1.0)
    _, tok = local
    serving = SessionServing(SessionStore(), tok, "policy", PARAMS, {}, "hermes")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    grammars = [serving.grammar(O.ChatCompletionRequest(model="policy", messages=messages, tools=ADD, tool_choice="required")),
                serving.grammar(O.ChatCompletionRequest(model="policy", messages=messages, tools=ADD, response_format=SUM))]  # fmt: skip
    _assert_engine_tokens(local, traj, 3, grammars)


async def _sdk_responses_agent(row, client):
    """The Agents SDK's default model, the Responses API (Agent(model=...) with its default
    client set), with a function tool: its docs' way, the way that was a bare 404."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))  # the test's own tool, on the test's own inputs

    agent = Agent(name="adder", instructions="Add.", model="policy", tools=[calculator])
    first = await Runner.run(agent, row["prompt"][-1]["content"], max_turns=2)
    await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "Sure?"}], max_turns=2)


def test_the_agents_sdks_default_responses_model_trains_on_the_engines_tokens(local):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (./setup.sh installs it; the vLLM environment cannot: websockets<17)")
    (traj,), _ = _run(local, _sdk_responses_agent, seeds=(8,), max_len=200)
    assert traj.info["agent"]["why"] is None, traj.info["agent"]["why"]
    # its second run sent the first's items back: the same row, continued
    assert traj.info["agent"]["new_rows"] == 0 and traj.info["turns"] == 2, traj.info["agent"]
    _assert_engine_tokens(local, traj, 8)


async def _sdk_structured_agent(row, client):
    """The Agents SDK's structured ways, each a default the endpoint refused before: a tool call
    forced by ModelSettings(tool_choice="required"), then an output_type (the Responses API's
    text.format json_schema)."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from pydantic import BaseModel, Field

    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two numbers."""
        return str(a + b)

    class Sum(BaseModel):
        sum: int = Field(ge=0, le=9)

    forced = Agent(name="adder", instructions="Add.", model="policy", tools=[add], model_settings=ModelSettings(tool_choice="required"),
                   tool_use_behavior="stop_on_first_tool")  # fmt: skip
    called = await Runner.run(forced, row["prompt"][-1]["content"], max_turns=2)
    typed = await Runner.run(Agent(name="typed", instructions="Add.", model="policy", output_type=Sum), row["prompt"][-1]["content"], max_turns=1)
    return float(int(called.final_output) == typed.final_output.sum)


def test_the_agents_sdks_forced_tool_choice_and_output_type_are_enforced(local):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (./setup.sh installs it; the vLLM environment cannot: websockets<17)")
    (traj,), _ = _run(local, _sdk_structured_agent, seeds=(6,), max_len=400)
    assert traj.info["agent"]["why"] is None, traj.info["agent"]["why"]
    assert traj.info["agent"]["requests"] == 2 and traj.info["environment_reward"] in (0.0, 1.0), traj.info["agent"]
    # the row trained is the typed run's: its answer is JSON of the SDK's schema for Sum
    _, tok = local
    answer = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m], skip_special_tokens=True)
    assert 0 <= json.loads(answer)["sum"] <= 9 and traj.info["agent"]["new_rows"] == 1


# ---- the frameworks themselves, as their docs write them (the `agents` extra installs them)


class _Sum(pydantic.BaseModel):
    sum: int = pydantic.Field(ge=0, le=9)  # a random model's numbers are long otherwise


async def _smolagents_agent(row, client):
    """smolagents' ToolCallingAgent: tool_choice "required" on every request, its final answer a
    call of its own final_answer tool. It is synchronous, so it runs in a thread."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def add(a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url), api_key=client.api_key, max_tokens=300)
    agent = ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
    agent.prompt_templates["system_prompt"] = "Call a tool."  # its own is 3.4k tokens of this tokenizer, past the tiny model's context
    answer = await asyncio.to_thread(agent.run, row["prompt"][-1]["content"])
    return float(str(answer) == row["answer"])


async def _langchain_agent(row, client, responses=False):
    """LangChain's with_structured_output at its default (response_format json_schema, strict),
    over chat or, `responses`, the Responses API (text.format)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0, max_tokens=60, use_responses_api=responses)
    out = await llm.with_structured_output(_Sum).ainvoke(row["prompt"])
    return float(out.sum == int(row["answer"]))


async def _pydantic_ai_agent(row, client, responses=False):
    """pydantic-ai's output_type: its answer a forced call of its final_result tool, over chat or,
    `responses`, the Responses API."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = (OpenAIResponsesModel if responses else OpenAIChatModel)("policy", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, output_type=_Sum)
    result = await agent.run(row["prompt"][-1]["content"])
    return float(result.output.sum == int(row["answer"]))


@pytest.mark.parametrize("framework, agent, calls", [
    ("smolagents", _smolagents_agent, True),
    ("langchain_openai", _langchain_agent, False), ("langchain_openai", functools.partial(_langchain_agent, responses=True), False),
    ("pydantic_ai", _pydantic_ai_agent, True), ("pydantic_ai", functools.partial(_pydantic_ai_agent, responses=True), True),
], ids=["smolagents", "langchain", "langchain-responses", "pydantic-ai", "pydantic-ai-responses"])  # fmt: skip
def test_agent_frameworks_as_their_docs_write_them_end_without_an_error_and_train_what_the_template_renders(local, framework, agent, calls):
    # What each sends by default was a 400 before (tool_choice required, response_format): now
    # the answer is forced into shape, the episode ends without an error, and the trained row
    # holds what the template renders of it.
    pytest.importorskip(framework, reason=f"{framework} (./setup.sh installs the agents extra)")
    (traj,), _ = _run(local, agent, seeds=(3,), max_len=400, timeout=60.0)
    assert traj.info["agent"]["why"] is None and not traj.info["agent"]["timeout"], traj.info["agent"]
    _, tok = local
    answer = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m], skip_special_tokens=True)
    if calls:  # a call laid out as the template writes one
        assert answer.startswith('\n<tool_call>{"name": "') and answer.endswith("</tool_call>"), answer
    else:
        assert 0 <= json.loads(answer)["sum"] <= 9


# Agents that take their process down, or hold it: contained only by agent_workers.
UNRULY_AGENTS = """
import os, threading, time

async def agent(row, client):
    answer = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=3)
    question = row["prompt"][-1]["content"]
    if question == "2+3=":
        os._exit(3)
    if question == "4+1=":
        threading.Event().wait()  # blocks its event loop: no await ends it
    return float(len(answer.choices[0].token_ids))
"""


def test_agents_in_worker_processes_take_only_their_worker_with_them(local, tmp_path):
    (tmp_path / "unruly.py").write_text(UNRULY_AGENTS)
    QUESTIONS.append("1+1=")
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("unruly", tmp_path / "unruly.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        start = time.monotonic()
        (exits, blocks, fine), agents = _run(local, module.agent, seeds=(1, 2, 3), timeout=8.0, name=f"{tmp_path / 'unruly.py'}:agent", workers=3)
        took = time.monotonic() - start
    finally:
        QUESTIONS.pop()
    assert "ended its worker process (exit code 3)" in exits.info["agent"]["why"] and exits.info["agent"]["error"], exits.info["agent"]
    # ended at agent_timeout, its worker killed (the workers' start, seconds, is before the episodes' clock)
    assert blocks.info["agent"]["timeout"] and took < 60, took
    assert not fine.info["agent"]["error"] and fine.info["environment_reward"] == 3.0 and fine.info["turns"] == 1
    _assert_engine_tokens(local, fine, 3)
