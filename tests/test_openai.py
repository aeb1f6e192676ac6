"""The OpenAI-compatible endpoint of `tandem rollout`, through OpenAI's own Python client (sync
and async, streamed and not) against a real server process: what agents written against
OpenAI's API see, and that the token ids it answers with are the engine's."""

import asyncio

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.engines.engine import TransformersEngine, eos_token_ids
from tandem.rollout.sampling import mix64
from tandem.rollout.types import Completion, SamplingParams
from tandem.server.openai_protocol import ChatCompletionRequest
from tandem.server.openai_serving import OpenAIServing

pytestmark = pytest.mark.quick

MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]


@pytest.fixture
def client(server, tiny_model):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0), str(tiny_model)


def test_a_chat_answer_is_the_engines_completion_of_the_rendered_prompt(client, tiny_model):
    api, model = client
    assert [m.id for m in api.models.list().data] == [tiny_model.name]  # the folder's name (requests may also name the path)
    answer = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=5, n=2, logprobs=True)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    extra = answer.model_extra
    assert extra["prompt_token_ids"] == prompt and extra["version"] == 0
    # the same completions from a local engine on the same weights, with the seeds the server derives
    lm = AutoModelForCausalLM.from_pretrained(tiny_model)
    local = TransformersEngine(lm, eos_token_ids(tok, lm.generation_config, str(tiny_model)), tok.pad_token_id)
    expected = local.generate([prompt, prompt], SamplingParams(max_tokens=8), [mix64(5 ^ i) & (2**63 - 1) for i in range(2)])
    for choice, want in zip(answer.choices, expected):
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.message.content == tok.decode(want.token_ids, skip_special_tokens=True)
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want.logprobs, abs=1e-5)
        assert choice.finish_reason == want.finish_reason
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == sum(len(w.token_ids) for w in expected)
    # the same seed, the same answer; a stop string ends the text where it begins
    again = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=5)
    assert again.choices[0].model_extra["token_ids"] == answer.choices[0].model_extra["token_ids"]
    text = answer.choices[0].message.content
    if len(text) > 2:
        cut = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=5, stop=[text[1:3]])
        assert cut.choices[0].message.content == text[:1] and cut.choices[0].finish_reason == "stop"


def test_a_streamed_answer_through_the_async_client_is_the_same_answer(client):
    api, model = client

    async def both():
        async_api = openai.AsyncOpenAI(base_url=api.base_url, api_key="none", max_retries=0)
        plain = await async_api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=9)
        stream = await async_api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=9, stream=True,
                                                         stream_options={"include_usage": True})  # fmt: skip
        chunks = [chunk async for chunk in stream]
        return plain, chunks

    plain, chunks = asyncio.run(both())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_the_completions_endpoint_takes_text_or_token_ids(client, tiny_model):
    api, model = client
    tok = AutoTokenizer.from_pretrained(tiny_model)
    by_text = api.completions.create(model=model, prompt="3+4=", max_tokens=6, seed=2, logprobs=0)
    by_ids = api.completions.create(model=model, prompt=tok("3+4=")["input_ids"], max_tokens=6, seed=2)
    assert by_text.choices[0].text == by_ids.choices[0].text and len(by_text.choices[0].logprobs.token_logprobs) == by_text.usage.completion_tokens


# What vllm-router 0.1.17 writes into the requests it forwards (captured from it), beside the client's own fields.
ROUTER_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}  # fmt: skip
ROUTER_COMPLETION = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}


def test_a_request_forwarded_by_vllm_router_is_answered_as_the_clients_own(client):
    # vllm-router re-serialises each request with vLLM's and SGLang's switches at the values that
    # ask for what tandem does anyway: accepted, with the answer the plain request gets.
    api, model = client
    plain = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, seed=4)
    routed = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, seed=4, extra_body=ROUTER_CHAT)
    assert routed.choices[0].message.content == plain.choices[0].message.content
    plain = api.completions.create(model=model, prompt="3+4=", max_tokens=6, seed=4)
    routed = api.completions.create(model=model, prompt="3+4=", max_tokens=6, seed=4, extra_body=ROUTER_COMPLETION)
    assert routed.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs is not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}, "does not declare"),
        ({"tool_choice": {"type": "allowed_tools"}}, "not supported"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"extra_body": {"ignore_eos": True}}, "ignore_eos True is not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format: cannot be enforced"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "images are not supported"),
        ({"prediction": {"type": "content", "content": "3+4=7"}}, "prediction is not supported"),
    ],
)
def test_what_the_server_cannot_honour_is_a_400_naming_it(client, fields, named):
    api, model = client
    with pytest.raises(openai.BadRequestError, match=named):
        api.chat.completions.create(model=model, **{"messages": MESSAGES, "max_tokens": 4, **fields})
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        api.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)


def test_tool_calls_in_the_models_text_come_back_as_openais_tool_calls(tiny_model):
    # The tiny model does not call tools by itself: its answer is given here, as the engine's
    # tokens, to the serving logic with the server's parser (hermes).
    tok = AutoTokenizer.from_pretrained(tiny_model)
    serving = OpenAIServing(service=None, model_name="m")
    serving.tokenizer = tok
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    req = ChatCompletionRequest(model="m", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "add"}}])
    choice = serving._chat_choice(0, Completion(ids, [-0.5] * len(ids), "stop", 3), req, parse=True)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("add", '{"a": 3, "b": 4}')]
    assert choice.token_ids == ids  # the engine's tokens, whatever the text became


def test_what_clients_send_for_their_own_bookkeeping_is_accepted_and_changes_nothing(client, tiny_model):
    # Refused before as "Extra inputs are not permitted": the Agents SDK, LangChain and litellm
    # send some of these by default. The model is also answered by its folder's name, the id
    # /v1/models gives (a path as an id reads as a provider prefix to the Agents SDK).
    api, path = client
    (card,) = api.models.list().data
    assert card.id == tiny_model.name
    plain = api.chat.completions.create(model=path, messages=MESSAGES, max_tokens=6, seed=4)
    kept = api.chat.completions.create(
        model=card.id, messages=MESSAGES, max_tokens=6, seed=4, store=False, metadata={"task": "t1"}, service_tier="auto", user="u",
        reasoning_effort="low", modalities=["text"], prediction={"type": "content", "content": ""}, response_format={"type": "text"},
        parallel_tool_calls=True, extra_body={"chat_template_kwargs": {}},
    )  # fmt: skip
    assert kept.choices[0].token_ids == plain.choices[0].token_ids and kept.prompt_token_ids == plain.prompt_token_ids
    # a function with no parameters (OpenAI's API leaves them optional) renders: a 500 once, then a 400
    tools = [{"type": "function", "function": {"name": "now"}}]
    assert api.chat.completions.create(model=card.id, messages=MESSAGES, max_tokens=2, tools=tools).prompt_token_ids


def test_one_call_at_most_without_parallel_tool_calls_and_calls_to_undeclared_tools_stay_text(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    serving = OpenAIServing(service=None, model_name="m")
    serving.tokenizer = tok
    call = '<tool_call>{{"name": "{}", "arguments": {{"a": 3}}}}</tool_call>'
    text = call.format("add") + " and " + call.format("add")
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    out = Completion(ids, [-0.5] * len(ids), "stop", 3)
    tools = [{"type": "function", "function": {"name": "add"}}]
    both = serving._chat_choice(0, out, ChatCompletionRequest(model="m", messages=MESSAGES, tools=tools), parse=True)
    one = serving._chat_choice(0, out, ChatCompletionRequest(model="m", messages=MESSAGES, tools=tools, parallel_tool_calls=False), parse=True)
    assert len(both.message.tool_calls) == 2 and both.token_ids == ids
    # the answer ends with the first call: its tokens are what is trained, the rest never was
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert tok.decode(one.token_ids) == call.format("add") and one.token_ids == ids[: len(one.token_ids)]
    # a call to a tool the request did not declare is the model's text, not a call
    other = serving._chat_choice(0, out, ChatCompletionRequest(model="m", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "mul"}}]),
                                 parse=True)  # fmt: skip
    assert other.message.tool_calls is None and other.message.content == text and other.finish_reason == "stop"


def test_the_responses_api_answers_as_chat_does_streamed_or_not(client, tiny_model):
    api, model = client
    chat = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    answer = api.responses.create(model=tiny_model.name, instructions="Add.", input="3+4=", max_output_tokens=4, store=False, truncation="disabled")
    assert answer.model_extra["prompt_token_ids"] == chat.prompt_token_ids  # instructions are the system message
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens == len(chat.prompt_token_ids)
    assert answer.output_text == AutoTokenizer.from_pretrained(tiny_model).decode(answer.model_extra["output_token_ids"], skip_special_tokens=True)
    # cut at max_output_tokens, the stream ends as OpenAI's does then: response.incomplete
    events = list(api.responses.create(model=model, input=[{"role": "user", "content": "3+4="}], max_output_tokens=4, stream=True))
    text, final = "".join(e.delta for e in events if e.type == "response.output_text.delta"), events[-1].response
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert text == final.output_text and final.id.startswith("resp_") and [e.sequence_number for e in events] == list(range(len(events)))
    later = api.responses.create(model=model, previous_response_id=final.id, input="Sure?", max_output_tokens=2)
    assert later.model_extra["prompt_token_ids"][: len(final.model_extra["prompt_token_ids"])] == final.model_extra["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        api.responses.create(model=model, previous_response_id="resp_unknown", input="?", max_output_tokens=2)
