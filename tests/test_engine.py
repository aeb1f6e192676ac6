"""The transformers engine: reproducible per-sequence sampling, behaviour log-probs, stopping."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tandem import linears
from tandem.algo import scaled, token_logprobs
from tandem.attention import tandem_sdpa
from tandem.engines import engine as engine_module
from tandem.engines.engine import TransformersEngine
from tandem.rollout import sampling
from tandem.rollout.sampling import exponential_noise, filter_logits, sample
from tandem.rollout.types import Rollout, SamplingParams
from tandem.trainer.batch import PrefixSharingLM, collate, completion_logprobs

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole


@pytest.fixture(scope="module")
def engine(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    return TransformersEngine(model, [tok.eos_token_id], tok.pad_token_id), tok


PROMPTS = [[1, 120, 118, 104, 117, 13, 54, 46, 55], [5, 6, 7], [1, 100, 101]]


def test_a_sequence_depends_on_its_seed_not_on_its_batch(engine):
    eng, _ = engine
    p = SamplingParams(max_tokens=12)
    alone = eng.generate([PROMPTS[0]], p, [11])[0]
    # the same prompt and seed in the middle of a batch of longer and shorter prompts
    batched = eng.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], p, [5, 11, 7])[1]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    other_seed = eng.generate([PROMPTS[0]], p, [12])[0]
    assert other_seed.token_ids != alone.token_ids


def test_behaviour_logprobs_equal_the_trainers_recompute(engine):
    eng, tok = engine
    params = SamplingParams(max_tokens=10, temperature=0.7, top_k=20)
    outs = eng.generate(PROMPTS, params, [1, 2, 3])
    rollouts = [Rollout(0, 0, p, o.token_ids, o.logprobs, o.finish_reason, 0) for p, o in zip(PROMPTS, outs)]
    mb = collate(rollouts, tok.pad_token_id, "cpu", False)
    with torch.no_grad():
        logps, _ = completion_logprobs(PrefixSharingLM(eng.model), mb, 0.7)
    for i, o in enumerate(outs):
        assert logps[i, : len(o.token_ids)].tolist() == pytest.approx(o.logprobs, abs=1e-5)


def test_stops_at_eos_or_length(engine):
    eng, tok = engine
    outs = eng.generate([PROMPTS[0]] * 16, SamplingParams(max_tokens=6), list(range(16)))
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs)
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in o.token_ids[:-1]
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 6
    assert {o.finish_reason for o in outs} == {"stop", "length"}, "the seeds should give both endings"


def test_finished_sequences_leave_the_batch_and_the_rest_are_unchanged(engine):
    # A third of the vocabulary ends a completion, so sequences stop at many different steps.
    base, tok = engine
    eng = TransformersEngine(base.model, list(range(3, 90)), tok.pad_token_id)
    rows = []  # batch size of every decode step (a forward on one token per row)
    hook = eng.model.register_forward_hook(lambda module, args, kw, out: rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    try:
        params = SamplingParams(max_tokens=12, repetition_penalty=1.3)
        outs = eng.generate([PROMPTS[0]] * 16, params, list(range(16)))
    finally:
        hook.remove()
    stopped = sorted(len(o.token_ids) for o in outs if o.finish_reason == "stop")
    assert len(stopped) >= 8 and stopped[0] < stopped[-1], stopped
    assert min(rows) < 16 and rows == sorted(rows, reverse=True), rows  # the batch shrank as they stopped
    for i, o in enumerate(outs):  # each sequence as if it had run alone
        alone = eng.generate([PROMPTS[0]], params, [i])[0]
        assert o.token_ids == alone.token_ids and o.finish_reason == alone.finish_reason
        assert o.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_greedy_matches_argmax_of_a_plain_forward(engine):
    eng, _ = engine
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4, top_k=1), [0])[0]
    ids = list(PROMPTS[0])
    for t in out.token_ids:
        with torch.no_grad():
            logits = eng.model(torch.tensor([ids])).logits[0, -1]
        assert t == int(logits.argmax())
        ids.append(t)


def test_sample_follows_the_distribution():
    # p = [1/4, 3/4]; 4000 draws: std of the frequency sqrt(3/16/4000) = 0.0068, tolerance ~4.4 std
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    freq = sample(logits, gens).float().mean().item()
    assert abs(freq - 0.75) < 0.03


def test_the_sampling_noise_is_each_generators_own_exponential_draws():
    # exponential_noise draws through uniform_ where that gives exponential_'s values (checked
    # once per process); either way each row is exactly what its generator's exponential_ gives
    # (the stream every earlier run sampled with), and the generator ends in the same state.
    assert sampling._exponential_by_uniform(), "this torch's exponential_ is not -log1p(-u) of uniform_'s doubles: sampling draws 3x slower"
    gens = [torch.Generator().manual_seed(s) for s in (3, 2**40 + 1, 77, 5)]
    twins = [torch.Generator().manual_seed(s) for s in (3, 2**40 + 1, 77, 5)]
    for width in (151_936, 5):
        # A decode loop's workspace, reused at each step, with more rows than it draws (as once
        # finished rows left the batch); and none.
        work = sampling.Workspace(6, width, torch.device("cpu"))
        for w in (work, work, None):
            noise = exponential_noise(width, gens, w)
            expected = torch.stack([torch.empty(width).exponential_(generator=g) for g in twins])
            assert torch.equal(noise, expected)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, twins))
    logits = torch.randn(4, 151_936)
    assert torch.equal(sample(logits, gens, sampling.Workspace(6, 151_936, torch.device("cpu"))), sample(logits, twins))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_decode_steps_token_logprobs_in_its_workspace_are_token_logprobs_exactly(temperature):
    # The decode loop's scaled scores and chosen tokens' log-probs, written into its workspace
    # (torch.logsumexp's ops written out), against algo's: bitwise, with masked-out (-inf) tokens
    # and fewer rows than the workspace holds (finished rows left the batch). The loop samples
    # from the scaled scores first, in the same workspace.
    work = sampling.Workspace(6, 151_936, torch.device("cpu"))
    logits = torch.randn(4, 151_936, generator=torch.Generator().manual_seed(1)) * 8
    logits[0, :1000] = float("-inf")
    tokens = torch.tensor([1000, 5, 151_935, 70_000])
    expected = token_logprobs(logits.unsqueeze(1), tokens.unsqueeze(1), temperature).squeeze(1)
    for _ in range(2):  # the workspace again, as at every step
        scores = sampling.scaled_into(logits, temperature, work)
        assert torch.equal(scores, scaled(logits, temperature))
        sample(scores, [torch.Generator().manual_seed(k) for k in range(4)], work)
        assert torch.equal(sampling.chosen_logprobs(scores, tokens, work), expected)


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    # top_p 0.7: token 2 has 0.8 above it -> dropped; token 1 has 0.5 above it -> kept
    assert keep(filter_logits(logits, 0, 0.7, 0.0)) == [True, True, False]
    assert keep(filter_logits(logits, 0, 0.4, 0.0)) == [True, False, False]
    assert keep(filter_logits(logits, 2, 1.0, 0.0)) == [True, True, False]
    # min_p 0.5: floor 0.25 -> 0.2 dropped
    assert keep(filter_logits(logits, 0, 1.0, 0.5)) == [True, True, False]


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0), ("min_p", 1.0)])
def test_bad_sampling_params(engine, field, value):
    eng, _ = engine
    with pytest.raises(ValueError, match=field):
        eng.generate([PROMPTS[0]], SamplingParams(**{field: value}), [0])


def test_the_preallocated_decode_cache_decodes_what_transformers_cache_does(engine, monkeypatch):
    # Sequences stop at many steps, so the batch shrinks (the cache's rows are selected) mid-way.
    base, tok = engine
    eng = TransformersEngine(base.model, list(range(3, 60)), tok.pad_token_id)
    params = SamplingParams(max_tokens=16, temperature=0.8)
    prompts, seeds = [PROMPTS[0]] * 6 + [PROMPTS[1]] * 6, list(range(12))
    layers = []
    hook = eng.model.register_forward_hook(lambda module, args, kw, out: layers.append(type(out.past_key_values.layers[0]).__name__), with_kwargs=True)
    try:
        ours = eng.generate(prompts, params, seeds)
        monkeypatch.setattr(engine_module, "decode_cache", lambda config, capacity: DynamicCache(config=config))
        theirs = eng.generate(prompts, params, seeds)
    finally:
        hook.remove()
    assert set(layers) == {"_GrowingLayer", "DynamicLayer"}  # each run decoded with the cache it names
    assert len({len(o.token_ids) for o in ours}) > 2
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_folded_onto_the_key_value_heads_equals_transformers_sdpa(dtype):
    # A decode step of a grouped-query model with no padded row (14 query heads on 2 key/value
    # heads, as Qwen2.5-0.5B): transformers' route (enable_gqa) and the engine's (the query heads
    # folded into rows of their key/value head) compute the same attention, up to rounding.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups, layer_idx, is_causal = 7, 0, True

    torch.manual_seed(0)
    query = torch.randn(3, 14, 1, 64, dtype=dtype)  # (B, H, 1, D)
    key, value = torch.randn(2, 3, 2, 40, 64, dtype=dtype)  # (B, KVH, L, D) each
    theirs, _ = sdpa_attention_forward(Attention(), query, key, value, None, scaling=0.125)
    ours, _ = tandem_sdpa(Attention(), query, key, value, None, scaling=0.125)
    assert ours.shape == theirs.shape == (3, 1, 14, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-6 if dtype == torch.float32 else 1e-2)
    assert not torch.equal(ours[:, :, :7], ours[:, :, 7:])  # each head attended to its own key/value head


def test_decode_steps_with_no_padded_row_fold_their_query_heads(engine, monkeypatch):
    # Every row of one prompt (a group's completions): no attention mask, the case where
    # transformers calls sdpa with enable_gqa (on a CPU 2x slower in fp32, 5-13x in bf16: docs/benchmarks.md).
    eng, _ = engine
    calls = []  # (rows, enable_gqa) of every sdpa call
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append((len(q), kw.get("enable_gqa", False))) or sdpa(q, k, v, **kw))
    came = eng.model.config._attn_implementation  # sdpa, or tandem_sdpa where a trainer's forward ran it (an earlier test)
    out = eng.generate([PROMPTS[0]] * 4, SamplingParams(max_tokens=6), [1, 2, 3, 4])
    decode = [gqa for rows, gqa in calls if rows == 4]  # the prefill's are of 1 row: the prompt, once
    assert len(decode) == 5 * 2 and not any(decode)  # 5 steps after the first token, 2 layers
    assert eng.model.config._attn_implementation == came  # set back: the model is left as it came
    # each sequence as it decodes in a padded batch, where transformers folds the heads itself
    padded = eng.generate([PROMPTS[1], PROMPTS[0]], SamplingParams(max_tokens=6), [0, 3])[1]
    assert out[2].token_ids == padded.token_ids
    assert out[2].logprobs == pytest.approx(padded.logprobs, abs=1e-5)


@pytest.mark.parametrize("pack", [False, True])
def test_large_linears_decode_through_onednn_to_the_same_tokens(engine, monkeypatch, pack):
    # The tiny model's weights are under the size that decodes through oneDNN; with the bar at
    # 0 every linear layer does (with `pack`, from weights packed for it once). The tokens stay,
    # the log-probs move by float rounding only.
    base, _ = engine
    params = SamplingParams(max_tokens=16, temperature=0.8)
    prompts, seeds = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, list(range(6))
    blas = base.generate(prompts, params, seeds)
    monkeypatch.setattr(linears, "ONEDNN_MIN_WEIGHT", 0)
    monkeypatch.setattr(engine_module, "PACK_MIN_TOKENS", 0 if pack else 10**9)
    with torch.profiler.profile() as prof:
        onednn = base.generate(prompts, params, seeds)
    ops = {event.key for event in prof.key_averages()}
    assert "mkldnn::_linear_pointwise" in ops and "aten::mm" not in ops and "aten::addmm" not in ops
    assert ("mkldnn::_reorder_linear_weight" in ops) == pack
    # The layers' forward was swapped for the call only (linears.LayerLinears): the trainer's gets nn.Linear's.
    assert not any("forward" in vars(m) for m in base.model.modules() if isinstance(m, torch.nn.Linear))
    for a, b in zip(blas, onednn):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)

@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="the CPU has no native bf16: bf16 matmuls stay with F.linear")
@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_packed_bf16_linears_decode_as_unpacked_ones(tiny_model, monkeypatch, mode):
    # bf16 weights (a rollout server's --dtype bfloat16) and fp32 ones under bf16 autocast (a
    # colocated --bf16 run): packed for oneDNN in bf16, they decode the tokens F.linear does.
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    eng = TransformersEngine(model, [tok.eos_token_id], tok.pad_token_id)
    params = SamplingParams(max_tokens=16, temperature=0.8)
    prompts, seeds = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, list(range(6))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        plain = eng.generate(prompts, params, seeds)
        monkeypatch.setattr(linears, "ONEDNN_MIN_WEIGHT", 0)
        monkeypatch.setattr(engine_module, "PACK_MIN_TOKENS", 0)
        with torch.profiler.profile() as prof:
            packed = eng.generate(prompts, params, seeds)
    ops = {event.key for event in prof.key_averages()}
    assert "mkldnn::_reorder_linear_weight" in ops and "aten::mm" not in ops and "aten::addmm" not in ops
    assert len({tuple(o.token_ids) for o in plain}) == len(plain)  # every seed its own completion
    for a, b in zip(plain, packed):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-2)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_sibling_projections_decode_as_one_matmul_to_the_same_tokens(tiny_model, monkeypatch, mode):
    # q, k, v and gate, up take one input each: with packed weights a forward runs each set as one
    # matmul over their weights stacked (linears.SIBLINGS), to bitwise the tokens and log-probs
    # of the matmuls apart.
    if mode != "fp32" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("the CPU has no native bf16: bf16 matmuls stay with F.linear")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    eng = TransformersEngine(model, [tok.eos_token_id], tok.pad_token_id)
    monkeypatch.setattr(linears, "ONEDNN_MIN_WEIGHT", 0)
    monkeypatch.setattr(engine_module, "PACK_MIN_TOKENS", 0)
    prompts, seeds = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, list(range(6))

    def generate():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"), torch.profiler.profile() as prof:
            out = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8), seeds)
        return out, sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")

    stacked, matmuls = generate()
    monkeypatch.setattr(linears, "SIBLINGS", ())
    apart, matmuls_apart = generate()
    layers = model.config.num_hidden_layers
    assert matmuls * (7 * layers + 1) == matmuls_apart * (4 * layers + 1)  # a forward's 7 matmuls a layer, and the output layer's, are 4 and 1
    assert len({tuple(o.token_ids) for o in apart}) == len(apart)
    for a, b in zip(stacked, apart):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_an_engine_that_keeps_its_packed_weights_packs_once_per_version_and_generates_the_same(engine, tiny_model, monkeypatch):
    # The rollout server's engine (keep_packed): its weights are packed by the first call and
    # kept for the next ones, until new weights load; what it generates is a per-call engine's.
    monkeypatch.setattr(linears, "ONEDNN_MIN_WEIGHT", 0)
    monkeypatch.setattr(engine_module, "PACK_MIN_TOKENS", 0)  # the per-call engine packs too: the same kernels
    base, tok = engine
    kept = TransformersEngine(AutoModelForCausalLM.from_pretrained(tiny_model), [tok.eos_token_id], tok.pad_token_id, keep_packed=True)
    params = SamplingParams(max_tokens=8)
    prompts, seeds = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, list(range(4))

    def packs(eng) -> tuple[int, list]:
        with torch.profiler.profile() as prof:
            out = eng.generate(prompts, params, seeds)
        return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_reorder_linear_weight"), out

    first, out = packs(kept)
    second, again = packs(kept)
    assert first > 0 and second == 0  # packed once, reused by the next call
    for a, b in zip(out, base.generate(prompts, params, seeds)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # new weights: packed anew, and what they generate is a fresh engine's on them
    new = {name: p.detach() * 1.5 for name, p in kept.model.named_parameters()}
    kept.load_weights(new)
    third, after = packs(kept)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model)
    fresh.load_state_dict(new, strict=False)
    expected = TransformersEngine(fresh, [tok.eos_token_id], tok.pad_token_id).generate(prompts, params, seeds)
    assert third == first and [a.token_ids for a in after] == [b.token_ids for b in expected]
    assert [a.token_ids for a in after] != [a.token_ids for a in out]


def test_constrained_rows_are_their_grammar_whatever_leaves_the_batch_and_both_masks_agree(tiny_model):
    # Rows end at different lengths (one of four words, then EOS), so finished ones leave the
    # batch mid-call and the rest keep their own grammar state; a row is the same alone.
    import llguidance.torch

    from tandem.rollout.grammar import apply_eagerly

    tok = AutoTokenizer.from_pretrained(tiny_model)
    eng = TransformersEngine(AutoModelForCausalLM.from_pretrained(tiny_model), [tok.eos_token_id], tok.pad_token_id, tokenizer=tok)
    words = ["a", "bb", "cccccc", "dddddddddddd"]
    params = SamplingParams(max_tokens=20, grammar="start: " + " | ".join(f'"{w}"' for w in words))
    prompt = tok("pick:", add_special_tokens=False)["input_ids"]
    outs = eng.generate([prompt] * 8, params, list(range(8)))
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert all(t in words and o.finish_reason == "stop" and o.token_ids[-1] == tok.eos_token_id for t, o in zip(texts, outs)), texts
    assert len({len(o.token_ids) for o in outs}) > 1  # rows left the batch at different steps
    (alone,) = eng.generate([prompt], params, [5])
    assert alone.token_ids == outs[5].token_ids and alone.logprobs == pytest.approx(outs[5].logprobs, abs=1e-6)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 9), dtype=torch.int32)
    compiled = torch.randn(3, 280)
    eager = compiled.clone()
    llguidance.torch.apply_token_bitmask_inplace(compiled, bits)
    apply_eagerly(eager, bits)
    assert torch.equal(compiled, eager)
