"""One conformance suite for every engine, each behind a real `tandem rollout` process: seeded
reproducibility, batch invariance, log-probs against the trainer's recompute, the version gate,
atomic commits, fingerprints, bad input, restart recovery. The vLLM engine runs where vLLM is
installed (./setup.sh --vllm)."""

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import KEY, LIMITS, Server, Shared, needs_vllm
from tandem.rollout.client import RolloutClient
from tandem.rollout.types import Rollout, SamplingParams
from tandem.rollout.weights import fingerprint
from tandem.trainer.batch import PrefixSharingLM, collate, completion_logprobs
from test_server import PROMPT, call, gen_body

PROMPTS = [PROMPT, [5, 6, 7], [1, 100, 101, 102, 103]]


@pytest.fixture(scope="module", params=["transformers", pytest.param("vllm", marks=needs_vllm)])
def engine_server(request, model64) -> Shared:
    """The engine's server: vLLM's is the session's (test_vllm trains against it too)."""
    if request.param == "vllm":
        shared = request.getfixturevalue("shared_vllm")
    else:
        shared = Shared(model64, *LIMITS)
        request.addfinalizer(shared.stop)
    shared.engine = request.param
    return shared


@pytest.fixture
def served(engine_server) -> Server:
    server = engine_server.handed_over()
    server.engine = engine_server.engine
    return server


def client_of(server, **kw) -> RolloutClient:
    return RolloutClient([server.url], api_key=KEY, server_timeout=240, **kw)


def perturbed(model_dir, seed: int) -> torch.nn.Module:
    """The model with every weight moved by noise of its own seed: weights no server holds yet."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def recompute(model, pad_id: int, prompts, outs, temperature: float) -> list[list[float]]:
    """The trainer's log-probs of each completion (its own batching and forward)."""
    rollouts = [Rollout(0, 0, p, o.token_ids, o.logprobs, o.finish_reason, 0) for p, o in zip(prompts, outs)]
    with torch.no_grad():
        logps, _ = completion_logprobs(PrefixSharingLM(model), collate(rollouts, pad_id, "cpu", False), temperature)
    return [logps[i, : len(o.token_ids)].tolist() for i, o in enumerate(outs)]


def test_info_names_the_engine_and_the_cores_it_keeps_busy(served):
    info = call(served, "GET", "/info").json()
    half = max(1, len(os.sched_getaffinity(0)) // 2)  # the default on CPU
    # vLLM's engine core keeps most of a core busy besides its worker's threads
    assert (info["engine"], info["threads"]) == {"transformers": ("TransformersEngine", half), "vllm": ("VLLMEngine", half + 1)}[served.engine]


def test_info_counts_the_prompt_tokens_the_prefix_cache_served(served):
    # A conversation's next turn repeats the last one as its prompt. vLLM serves the repeated
    # full blocks of keys and values (128 tokens each on CPU) from its prefix cache; tandem's own
    # engine keeps no cache across calls.
    client = client_of(served)
    params = SamplingParams(max_tokens=4)
    first = [1 + (7 * i) % 200 for i in range(300)]  # two full blocks and part of a third
    before = call(served, "GET", "/info").json()["stats"]
    reply = client.generate([first], params, [1])[0]
    second = first + reply.token_ids + [5, 6, 7]  # the reply and a tool result after it
    client.generate([second], params, [2])
    after = call(served, "GET", "/info").json()["stats"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(first) + len(second)
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert cached == {"transformers": 0, "vllm": 256}[served.engine]


def test_seeded_completions_repeat_and_do_not_depend_on_their_batch(served):
    client = client_of(served)
    params = SamplingParams(max_tokens=12)
    alone = client.generate([PROMPT], params, [11])[0]
    again = client.generate([PROMPT], params, [11])[0]
    # the same prompt and seed among longer and shorter prompts
    batched = client.generate([PROMPTS[1], PROMPT, PROMPTS[2]], params, [5, 11, 7])[1]
    other_seed = client.generate([PROMPT], params, [12])[0]
    client.close()
    assert again.token_ids == alone.token_ids and again.logprobs == alone.logprobs
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-5)  # batch shape moves the last bits only
    assert other_seed.token_ids != alone.token_ids


def test_the_openai_endpoint_answers_the_engines_completions_of_the_rendered_prompt(served, model64):
    # Through OpenAI's own client: the chat answer's tokens are what the engine generates from the
    # prompt the server rendered, with the seeds it derives from the request's (choice i: mix64(seed ^ i)).
    import openai

    from tandem.rollout.sampling import mix64

    api = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "2+2="}]
    answer = api.chat.completions.create(model=str(model64), messages=messages, max_tokens=6, seed=3, n=2, logprobs=True, temperature=0.8)
    tok = AutoTokenizer.from_pretrained(model64)
    prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    assert answer.model_extra["prompt_token_ids"] == prompt
    client = client_of(served)
    outs = client.generate([prompt, prompt], SamplingParams(max_tokens=6, temperature=0.8), [mix64(3 ^ i) & (2**63 - 1) for i in range(2)])
    client.close()
    for choice, out in zip(answer.choices, outs):
        assert choice.model_extra["token_ids"] == out.token_ids
        assert [t.logprob for t in choice.logprobs.content] == out.logprobs
    # the Responses API renders the same prompt, and answers with the engine's tokens
    response = api.responses.create(model=model64.name, input=messages, max_output_tokens=6)
    assert response.model_extra["prompt_token_ids"] == prompt and 1 <= len(response.model_extra["output_token_ids"]) <= 6
    assert response.output_text == tok.decode(response.model_extra["output_token_ids"], skip_special_tokens=True)


@pytest.mark.quick
@pytest.mark.parametrize("transport", ["http", "shm"])
def test_pushed_weights_generate_what_the_trainer_recomputes(served, model64, transport):
    # Each transport delivers other weights; the fingerprint is of the tensors as sent, and the
    # log-probs show the engine generates with them (fp32: equal to rounding).
    model = perturbed(model64, seed=1 if transport == "http" else 2)
    client = client_of(served, transport=transport, weight_bucket_bytes=20_000)  # several buckets
    version = client.fingerprints()[0]["version"] + 1
    client.push_weights(list(model.named_parameters()), version)
    assert client.fingerprints()[0] == {"version": version, "fingerprint": fingerprint(model.named_parameters())}
    outs = client.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.7), [1, 2, 3], min_version=version)
    client.close()
    assert {o.version for o in outs} == {version}
    tokenizer = AutoTokenizer.from_pretrained(model64)
    eos = tokenizer.eos_token_id
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs) and (o.finish_reason == "length") == (len(o.token_ids) == 12)
        assert (o.token_ids[-1] == eos) == (o.finish_reason == "stop") and eos not in o.token_ids[:-1]
    for got, want in zip([o.logprobs for o in outs], recompute(model, tokenizer.pad_token_id, PROMPTS, outs, 0.7)):
        assert got == pytest.approx(want, abs=1e-5)


def test_behaviour_logprobs_are_the_unfiltered_ones_whatever_the_filters(served, model64):
    # Behaviour log-probs are log softmax(logits / T) of the sampled token, before the repetition
    # penalty, top-k, top-p and min-p, as the trainer recomputes them. vLLM's processed log-probs
    # are those of the filtered distribution: each token's then differs by log(kept mass) < 0,
    # here about -0.3 to -2 per token (top_k 20 of 259 tokens of a random model).
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.3)
    client = client_of(served)
    outs = client.generate(PROMPTS, params, [4, 5, 6])
    client.close()
    tokenizer = AutoTokenizer.from_pretrained(model64)
    model = AutoModelForCausalLM.from_pretrained(model64)
    for got, want in zip([o.logprobs for o in outs], recompute(model, tokenizer.pad_token_id, PROMPTS, outs, 0.7)):
        assert got == pytest.approx(want, abs=1e-5)


def masked_logprobs(model, tokenizer, prompt: list[int], out, grammar: str, temperature: float) -> list[float]:
    """Log softmax(logits / T) of each token over what `grammar` allowed at its place: the
    distribution a constrained token is drawn from, recomputed by a full forward."""
    from tandem.rollout.grammar import Grammars

    vocab = model.get_output_embeddings().weight.shape[0]
    masks = Grammars(tokenizer, vocab, [tokenizer.eos_token_id]).masks(grammar, 1)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    got = []
    for k, token in enumerate(out.token_ids):
        row = logits[k : k + 1].clone()
        masks.apply(row, torch.tensor([False]))
        got.append(float(torch.log_softmax(row / temperature, -1)[0, token]))
        masks.advance(torch.tensor([token]), torch.tensor([False]))
    return got


@pytest.mark.quick
def test_constrained_answers_follow_their_grammar_reproducibly_with_the_masked_logprobs(served, model64):
    # tool_choice "required" and a json_schema through OpenAI's client: the answer is a call of a
    # declared tool, or JSON of the schema, whatever the (random) model would write; the tokens
    # repeat for the seed, and the behaviour log-probs are of the masked, renormalised distribution.
    import openai

    from tandem.rollout.grammar import CallLayout, answer_grammar

    api = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}  # a random model's numbers are long otherwise
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                                                                             "required": ["a", "b"], "additionalProperties": False}}}]  # fmt: skip
    ask = dict(model=model64.name, messages=[{"role": "user", "content": "1+2"}], max_tokens=200, seed=5, temperature=0.5)
    called = api.chat.completions.create(**ask, tools=tools, tool_choice="required")
    again = api.chat.completions.create(**ask, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}})
    for answer in (called, again):
        call = answer.choices[0].message.tool_calls[0]
        assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert set(json.loads(call.function.arguments)) == {"a", "b"}
    schema = {"type": "object", "properties": {"answer": DIGIT}, "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema, "strict": True}}
    answers = [api.chat.completions.create(**ask, response_format=fmt) for _ in range(2)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert set(json.loads(answers[0].choices[0].message.content)) == {"answer"}
    model = perturbed(model64, seed=3)  # the weights the server holds after this push
    client = client_of(served)
    version = client.fingerprints()[0]["version"] + 1
    client.push_weights(list(model.named_parameters()), version)
    grammar = answer_grammar(CallLayout(), answer=schema)
    outs = client.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.7, grammar=grammar), [1, 2, 3], min_version=version)
    client.close()
    tokenizer = AutoTokenizer.from_pretrained(model64)
    for prompt, out in zip(PROMPTS, outs):
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason == "length" or set(json.loads(text)) == {"answer"}
        assert out.logprobs == pytest.approx(masked_logprobs(model, tokenizer, prompt, out, grammar, 0.7), abs=1e-5)
        assert max(out.logprobs) <= 0 and any(lp == 0 for lp in out.logprobs)  # the grammar's forced tokens: probability 1


def _begin(server, version, num_tensors, force=False):
    r = call(server, "POST", "/weights/begin", json={"version": version, "num_tensors": num_tensors, "force": force})
    assert r.status_code == 200, r.text
    return r.json()["update_id"]


def test_weight_updates_are_atomic_and_versioned(served, model64):
    model = perturbed(model64, seed=3)
    before = call(served, "GET", "/weights/fingerprint").json()
    probe = gen_body(min_version=before["version"])
    served_before = call(served, "POST", "/generate", json=probe).json()["completions"]
    named = dict(model.named_parameters())
    names = sorted(named)
    version = before["version"] + 1

    # half an update, then commit: refused, nothing changes
    uid = _begin(served, version, len(names))
    half = {n: named[n].detach() for n in names[: len(names) // 2]}
    assert call(served, "PUT", f"/weights/{uid}/chunk", data=save(half)).status_code == 200
    r = call(served, "POST", f"/weights/{uid}/commit")
    assert r.status_code == 400 and "send the rest" in r.json()["error"]
    assert call(served, "GET", "/weights/fingerprint").json() == before
    assert call(served, "POST", "/generate", json=probe).json()["completions"] == served_before  # staged is not live

    # garbage and wrong shapes are refused
    assert call(served, "PUT", f"/weights/{uid}/chunk", data=b"garbage").status_code == 400
    r = call(served, "PUT", f"/weights/{uid}/chunk", data=save({names[0]: torch.zeros(3)}))
    assert r.status_code == 400 and "shape" in r.json()["error"]

    # the rest, then commit: live, version + 1, same bits as ours
    rest = {n: named[n].detach() for n in names[len(names) // 2 :]}
    assert call(served, "PUT", f"/weights/{uid}/chunk", data=save(rest)).json()["staged"] == len(names)
    assert call(served, "POST", f"/weights/{uid}/commit").json()["version"] == version
    assert call(served, "GET", "/weights/fingerprint").json() == {"version": version, "fingerprint": fingerprint(model.named_parameters())}
    after = call(served, "POST", "/generate", json=probe).json()["completions"]
    assert {c["version"] for c in after} == {version} and after != served_before


def test_delta_updates_make_the_weights_a_full_one_does_and_fall_back_where_the_base_differs(served, model64, caplog):
    # An optimizer step moves few of the served words: a delta from the version the server holds
    # sends those only, and leaves the weights bitwise a full push's (the fingerprint). A server
    # whose kept base is not the delta's (another trainer pushed other weights at that version)
    # refuses it at commit, and the client sends the whole instead.
    first = perturbed(model64, seed=6)
    named = list(first.named_parameters())
    client = client_of(served, delta=True, weight_bucket_bytes=20_000)  # several chunks
    version = client.fingerprints()[0]["version"] + 1
    full = sum(t.numel() * t.element_size() for _, t in named)
    client.push_weights(named, version)
    assert client.push_bytes == full  # nothing to be a delta from yet
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in first.parameters():  # about 1% of the elements move
            p.add_(torch.where(torch.rand(p.shape, generator=gen) < 0.01, 1e-3, 0.0))
    client.push_weights(named, version + 1)
    assert 0 < client.push_bytes < full / 10
    assert client.fingerprints()[0] == {"version": version + 1, "fingerprint": fingerprint(first.named_parameters())}

    other = client_of(served, delta=True)
    other.push_weights(list(perturbed(model64, seed=8).named_parameters()), version + 1, force=True)  # kept as the base, at the same version
    other.close()
    with torch.no_grad():
        for p in first.parameters():
            p.mul_(1.001)
    with caplog.at_level("WARNING", logger="tandem"):
        client.push_weights(named, version + 2)
    client_fingerprint = client.fingerprints()[0]
    client.close()
    assert "refused a delta update" in caplog.text and "fingerprint" in caplog.text
    assert client.push_bytes > full  # the delta refused, then the whole
    assert client_fingerprint == {"version": version + 2, "fingerprint": fingerprint(first.named_parameters())}


@pytest.mark.quick
def test_the_version_gate_waits_for_the_update(served, model64):
    client = client_of(served)
    target = client.fingerprints()[0]["version"] + 1
    result = {}

    def ask():
        result["out"] = client.generate([PROMPT], SamplingParams(max_tokens=3), [7], min_version=target, version_timeout=60)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), "the request must wait for the version"
    client.push_weights(list(perturbed(model64, seed=4).named_parameters()), target)
    t.join(timeout=60)
    client.close()
    assert [c.version for c in result["out"]] == [target]


@pytest.mark.parametrize(
    "method, path, kw, status, words",
    [
        ("POST", "/generate", {"json": gen_body(prompts="abc")}, 422, "prompts"),
        ("POST", "/generate", {"json": {"prompts": [PROMPT], "n": 1}}, 422, "seeds"),
        ("POST", "/generate", {"json": gen_body(temperture=1.0)}, 422, "temperture"),
        ("POST", "/generate", {"json": gen_body(sampling={"temperature": -1})}, 422, "temperature"),
        ("POST", "/generate", {"data": b"{not json"}, 422, "invalid request"),
        ("POST", "/generate", {"json": gen_body(prompts=[[99999]], seeds=[1, 2])}, 400, "vocabulary"),
        ("POST", "/generate", {"json": gen_body(seeds=[1])}, 400, "seeds"),
        ("POST", "/generate", {"json": gen_body(prompts=[[]])}, 400, "empty"),
        ("POST", "/generate", {"json": gen_body(sampling={"max_tokens": 5000})}, 400, "max_model_len"),
        ("POST", "/generate", {"json": gen_body(prompts=[PROMPT * 20000], seeds=[1, 2])}, 413, "limit"),
        ("POST", "/generate", {"json": gen_body(min_version=999, version_timeout=0.2)}, 409, "min_version 999"),
        ("POST", "/generate", {"json": gen_body(instance_id="0" * 32)}, 409, "server restarted"),
        ("POST", "/weights/begin", {"json": {"version": 999, "num_tensors": 1}}, 409, "update to version 999 refused"),
        ("POST", "/weights/nosuch/commit", {}, 404, "nosuch"),
        ("GET", "/info", {"key": "wrong"}, 401, "Authorization"),
        ("POST", "/generate", {"key": None, "json": gen_body()}, 401, "Authorization"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_keeps_serving(served, method, path, kw, status, words):
    r = call(served, method, path, **kw)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
    assert call(served, "POST", "/generate", json=gen_body()).status_code == 200


def test_a_restarted_server_gets_the_last_weights_and_version_again(engine_server, served, model64):
    client = client_of(served)
    try:
        client.wait_until_ready()
        model = perturbed(model64, seed=5)
        client.push_weights(list(model.named_parameters()), 1, force=True)
        params = SamplingParams(max_tokens=8)
        before = client.generate(PROMPTS, params, [1, 2, 3], min_version=1)
        served.kill()
        result = {}
        # a request while the server is down: retried until the new process answers, which the
        # client recognises (a new instance id) and gives the weights it last pushed
        asking = threading.Thread(target=lambda: result.update(out=client.generate(PROMPTS, params, [1, 2, 3], min_version=1)))
        asking.start()
        served.stop()
        engine_server.server = Server(model64, *engine_server.options, port=served.port)  # the shared server from now on
        asking.join(timeout=240)
        assert [o.token_ids for o in result["out"]] == [o.token_ids for o in before]
        assert {o.version for o in result["out"]} == {1}
        assert client.fingerprints()[0] == {"version": 1, "fingerprint": fingerprint(model.named_parameters())}
    finally:
        client.close()
