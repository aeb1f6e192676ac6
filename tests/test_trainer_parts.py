"""Pieces of the trainer that the end-to-end runs cannot isolate."""

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from tandem import attention, linears
from tandem.rollout.types import Rollout
from tandem.trainer import checkpoint, loop
from tandem.trainer.checkpoint import latest_checkpoint
from tandem.algo import entropy_from_logits, token_logprobs
from tandem.trainer import embedding
from tandem.trainer import head as head_module
from tandem.trainer import mlp
from tandem.trainer.batch import PrefixSharingLM, checkpoint_layers, collate, completion_logprobs, length_buckets
from tandem.trainer.head import head_logprobs

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole


def test_collate_keeps_each_prompt_once_and_masks_truncated_completions():
    a = Rollout(0, 0, [7, 8, 9], [4, 2], [-1.0, -1.0], "stop", 0)
    b = Rollout(1, 1, [5], [3, 3, 3], [-1.0] * 3, "length", 0)
    a2 = Rollout(0, 0, [7, 8, 9], [6], [-1.0], "stop", 0)  # same prompt as a
    mb = collate([a, b, a2], pad_id=0, device="cpu", mask_truncated=True)
    assert mb.prompt_ids.tolist() == [[7, 8, 9], [0, 0, 5]]  # left-padded, each distinct prompt once
    assert mb.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert mb.prompt_index.tolist() == [0, 1, 0]
    assert mb.completion_ids.tolist() == [[4, 2, 0], [3, 3, 3], [6, 0, 0]]
    assert mb.completion_attention.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert mb.completion_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]  # b hit the length limit
    assert collate([a, b, a2], 0, "cpu", mask_truncated=False).completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]


def test_an_agents_earlier_rows_train_with_their_rollout_and_count_in_the_steps_loss_tokens():
    # Two rollouts, one a session of two rows (Rollout.earlier): the steps count every row's
    # model tokens (dapo's normaliser), each micro-batch takes a rollout with all its rows, and a
    # row ends as its trajectory did (a truncated one is masked whole).
    earlier = {"prompt_ids": [1, 2], "completion_ids": [5, 6, 7], "behav_logprobs": [-1.0, 0.0, -1.0], "loss_mask": [1, 0, 1], "version": 0}
    two = Rollout(0, 0, [1, 2, 5, 6, 7, 8], [9, 4], [-0.5, -0.5], "stop", 1, earlier=[earlier])
    one = Rollout(1, 1, [3], [4, 4, 4, 4], [-0.1] * 4, "length", 1)
    rows = two.rows() + one.rows()
    assert [(r.prompt_ids, r.completion_ids, r.version, r.earlier) for r in rows[:2]] == [([1, 2], [5, 6, 7], 0, None), ([1, 2, 5, 6, 7, 8], [9, 4], 1, None)]
    assert [r.finish_reason for r in Rollout(0, 0, [1], [2], [0.0], "length", 1, earlier=[earlier]).rows()] == ["length", "length"]
    s = SimpleNamespace(steps_per_pass=2, grad_accum=1, micro_batch=1, mask_truncated=True)
    counts = loop.loss_tokens(s, [[1, 0], [0, 1]], rows, [range(0, 2), range(2, 3)])
    assert counts.tolist() == [[0.0, 4.0], [4.0, 0.0]]  # the truncated rollout is masked; the session's rows: 2 + 2 tokens
    rows_of, sequences = loop.Prepared.micro_batch(SimpleNamespace(spans=[range(0, 2), range(2, 3)]), [1, 0])
    assert rows_of == [2, 0, 1] and sequences.tolist() == [0, 1, 1]


def test_a_completion_the_engine_ended_on_an_error_is_never_trained(tiny_model):
    # An aborted completion is an unfinished text: no loss tokens whatever mask_truncated says,
    # and no reward (NaN), so its group's statistics leave it out and its advantage is 0.
    from transformers import AutoTokenizer

    from tandem.rewards import load_rewards
    from tandem.trainer.producer import PromptTable, score_rollouts

    done = Rollout(0, 0, [7, 8], [54, 46], [-1.0, -1.0], "stop", 0)
    aborted = Rollout(0, 0, [7, 8], [54, 46, 55], [-1.0] * 3, "error", 0)
    assert collate([done, aborted], 0, "cpu", mask_truncated=False).completion_mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    table = PromptTable(prompts=["p"], prompt_ids=[[7, 8]], columns={}, conversational=[False])
    scores = score_rollouts(table, AutoTokenizer.from_pretrained(tiny_model), load_rewards(["length_penalty"], None), 8, [done, aborted])[0]
    assert not torch.isnan(scores[0]).any() and torch.isnan(scores[1]).all()


def _tokens_run(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_length_buckets_worked_examples():
    # lengths 64 60 | 33 30 | 5 | 3 2 1: 2*64 + 2*33 + 5 + 3*3 = 208 tokens run, against 8*64 = 512
    # for one bucket; no split into 4 runs fewer (64 60 | 33 30 | 5 3 | 2 1 ties at 208).
    lengths = [5, 1, 64, 60, 3, 30, 2, 33]
    groups = length_buckets(lengths, max_buckets=4, bucket_cost=0)
    assert sorted(i for g in groups for i in g) == list(range(8)) and len(groups) == 4
    assert _tokens_run(lengths, groups) == 208
    # A bucket must save more than its cost: [10 10 | 1 1] runs 22 tokens against 40, a saving of
    # 18, which a cost of 64 does not pay for; a cost of 17 does.
    assert length_buckets([10, 1, 10, 1], bucket_cost=64) == [[0, 2, 1, 3]]
    assert sorted(map(sorted, length_buckets([10, 1, 10, 1], bucket_cost=17))) == [[0, 2], [1, 3]]
    assert length_buckets([7, 7, 7], bucket_cost=0) == [[0, 1, 2]]  # equal lengths: one bucket, the fewest
    assert length_buckets([], 4) == []


@pytest.mark.parametrize("seed", range(5))
def test_length_buckets_equal_a_brute_force_search(seed):
    # Every way to cut the sorted lengths into at most 4 contiguous groups, tokens plus cost per group.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 65, (9,), generator=g).tolist()
    cost = [0, 20, 64][seed % 3]
    ordered = sorted(lengths, reverse=True)
    best = min(
        sum(ordered[a] * (b - a) for a, b in zip((0, *cuts), (*cuts, 9))) + cost * (len(cuts) + 1)
        for k in range(4)
        for cuts in itertools.combinations(range(1, 9), k)
    )
    groups = length_buckets(lengths, max_buckets=4, bucket_cost=cost)
    assert sorted(i for grp in groups for i in grp) == list(range(9)) and len(groups) <= 4
    assert _tokens_run(lengths, groups) + cost * len(groups) == best


def _full_forward_logprobs(lm, rollouts, pad_id=0):
    """The plain reference: every prompt+completion sequence through the model in full."""
    n, P = len(rollouts), max(len(r.prompt_ids) for r in rollouts)
    C = max(len(r.completion_ids) for r in rollouts)
    ids = torch.full((n, P + C), pad_id)
    mask = torch.zeros((n, P + C), dtype=torch.long)
    for i, r in enumerate(rollouts):
        ids[i, P - len(r.prompt_ids) : P] = torch.tensor(r.prompt_ids)
        mask[i, P - len(r.prompt_ids) : P] = 1
        ids[i, P : P + len(r.completion_ids)] = torch.tensor(r.completion_ids)
        mask[i, P : P + len(r.completion_ids)] = 1
    logits = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1 : -1]
    # float32 log-softmax of the float64 logits, as completion_logprobs takes it
    return token_logprobs(logits.float(), ids[:, P:]).double(), mask[:, P:]


def _groups_of_rollouts(g: torch.Generator) -> list[Rollout]:
    """Four prompts of different lengths in groups of 1 to 4 completions of 1 to 4 tokens."""
    rollouts = []
    for k in range(4):
        prompt = torch.randint(3, 120, (5 + 3 * k,), generator=g).tolist()  # prompt and completion tokens
        for j in range(1 + k):  # never overlap, so a gradient on a prompt token came through the cache
            completion = torch.randint(130, 250, (1 + (j + k) % 4,), generator=g).tolist()
            rollouts.append(Rollout(k, k, prompt, completion, [0.0] * len(completion), "stop", 0))
    return rollouts


@pytest.mark.parametrize("seed, max_buckets", [(0, 1), (1, 1), (0, 4), (1, 3)])
def test_prefix_sharing_forward_equals_the_full_forward(tiny_model, seed, max_buckets):
    # With the model in float64 and its logits taken to float32 as the trainer does, the two
    # computations agree exactly (measured: difference 0.0). Prompts of different lengths, groups of different sizes, a
    # completion of one token; every completion padded to the longest (one bucket), or split
    # into length buckets whose members come from several prompts.
    lm = AutoModelForCausalLM.from_pretrained(tiny_model).double()
    g = torch.Generator().manual_seed(seed)
    rollouts = _groups_of_rollouts(g)
    mb = collate(rollouts, 0, "cpu", False, max_buckets=max_buckets, bucket_cost=0)
    assert len(mb.buckets) == max_buckets
    expected, mask = _full_forward_logprobs(lm, rollouts)
    got, _ = completion_logprobs(PrefixSharingLM(lm), mb, 1.0)
    assert torch.equal(got.double() * mask, expected * mask)
    assert torch.equal(got * (1 - mask), torch.zeros_like(got))  # log-probs are 0 past a completion's end, whatever its bucket's width
    # The gradients equal the full forward's, parameter by parameter: a KV cache detached from
    # the graph would still give prompt embeddings some gradient (through the first completion
    # token's input), but not these values.
    weights = torch.randn(mask.shape, generator=g, dtype=torch.float64)  # (N, C), so no two positions weigh the same
    lm.zero_grad()
    (_full_forward_logprobs(lm, rollouts)[0] * mask * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    got, _ = completion_logprobs(PrefixSharingLM(lm), mb, 1.0)
    (got.double() * mask * weights).sum().backward()
    # Measured: relative error at most 7e-8 (float32 log-softmax gradients of a shared prompt's
    # first token summed in another order); with the cache detached it is 1.5.
    for n, p in lm.named_parameters():
        assert (p.grad - expected_grads[n]).norm() <= 1e-6 * expected_grads[n].norm(), n


def test_completions_attend_to_their_prompts_cache_causally_from_the_top_left_with_the_same_result(tiny_model, monkeypatch):
    # tandem.attention's route for many queries after cached ones (taken from 512 queries; here
    # from 1): the prefix-sharing forward in float64 against the full forward, as the test above,
    # with left-padded prompts (rotated) and length buckets padded on the right.
    calls = []
    route = attention._causal_from_top_left
    monkeypatch.setattr(attention, "_causal_from_top_left", lambda *a: calls.append(a[0].shape) or route(*a))
    monkeypatch.setattr(attention, "CAUSAL_MIN_QUERIES", 1)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model).double()
    g = torch.Generator().manual_seed(0)
    rollouts = _groups_of_rollouts(g)
    mb = collate(rollouts, 0, "cpu", False, max_buckets=3, bucket_cost=0)
    expected, mask = _full_forward_logprobs(lm, rollouts)
    weights = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    (expected * mask * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    got, _ = completion_logprobs(PrefixSharingLM(lm), mb, 1.0)
    (got.double() * mask * weights).sum().backward()
    assert len(calls) == 2 * lm.config.num_hidden_layers  # the buckets longer than one token, every layer
    torch.testing.assert_close(got.double() * mask, expected * mask, rtol=0, atol=1e-6)
    for n, p in lm.named_parameters():
        assert (p.grad - expected_grads[n]).norm() <= 1e-6 * expected_grads[n].norm(), n


def test_attention_with_a_mask_that_is_not_causal_after_a_prefix_is_transformers_own(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups, layer_idx, is_causal = 2, 0, True

    monkeypatch.setattr(attention, "CAUSAL_MIN_QUERIES", 1)
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)  # (B, H, L, D), (B, KVH, S, D)
    causal = torch.arange(5) <= torch.arange(2, 5)[:, None]  # (L, S): query i sees keys up to 2 + i
    mask = causal.expand(2, 1, 3, 5).clone()
    mask[1, :, :, 0] = False  # row 1's prompt is left-padded by one
    theirs, _ = sdpa_attention_forward(Attention(), query, key, value, mask)
    ours, _ = attention.tandem_sdpa(Attention(), query, key, value, mask)
    assert attention._causal_after_prefix(mask, 3, 5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    mask[0, :, :, 1] = False  # a hole: not a padded prompt
    assert not attention._causal_after_prefix(mask, 3, 5)
    assert torch.equal(attention.tandem_sdpa(Attention(), query, key, value, mask)[0], sdpa_attention_forward(Attention(), query, key, value, mask)[0])


@pytest.mark.parametrize("masked", [True, False])
def test_short_bf16_attention_written_out_is_sdpas_to_bf16_rounding(monkeypatch, masked):
    """tandem.attention's written-out route against float64 sdpa: outputs and the gradients of the
    query, keys and values about as close as sdpa's own bf16 kernel's (a padded row's query
    included: finite, its output unread); taken in bf16 and under bf16 autocast, not in fp32."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups, layer_idx, is_causal = 2, 0, True

    calls = []
    route = attention._written_out
    monkeypatch.setattr(attention, "_written_out", lambda *a: calls.append(1) or route(*a))
    torch.manual_seed(0)
    b, length, keys = 3, 6, 9  # 3 cached keys before the 6 queries
    exact = [torch.randn(b, 4, length, 8, dtype=torch.float64), torch.randn(b, 2, keys, 8, dtype=torch.float64), torch.randn(b, 2, keys, 8, dtype=torch.float64)]
    mask = None
    if masked:
        mask = (torch.arange(keys) <= torch.arange(keys - length, keys)[:, None]).expand(b, 1, length, keys).clone()
        mask[1, :, :, :4] = False  # row 1 left-padded by 4: its first query sees nothing
    upstream = torch.randn(b, length, 4, 8, dtype=torch.float64)
    if masked:
        upstream[1, 0] = 0  # nothing reads a padded query's output

    def run(attend, dtype):
        q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in exact)
        out, _ = attend(Attention(), q, k, v, mask)
        (out.double() * upstream).sum().backward()
        return [out.double() * (upstream != 0)] + [t.grad.double() for t in (q, k, v)]

    truth = run(sdpa_attention_forward, torch.float64)
    ours = run(attention.tandem_sdpa, torch.bfloat16)
    assert len(calls) == 1 and all(t.isfinite().all() for t in ours)
    kernel = run(sdpa_attention_forward, torch.bfloat16)
    for t, o, k in zip(truth, ours, kernel):  # the probabilities rounded to bf16 before v: up to an ulp of the largest
        assert (o - t).abs().max() <= max(2 * (k - t).abs().max(), 2**-7 * t.abs().max())
    run(attention.tandem_sdpa, torch.float32)  # fp32: the kernel
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 under bf16 autocast, without gradients: written out
        assert attention.tandem_sdpa(Attention(), *(t.float() for t in exact), mask)[0].dtype == torch.bfloat16 and len(calls) == 2


def _saved_bytes_and_gradients(params: dict[str, torch.Tensor], run):
    """What `run` (a forward returning a loss) keeps for the backward, in bytes, its loss, and the
    gradient of each of `params`."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    for p in params.values():
        p.grad = None
    loss.backward()
    return sum(saved), loss.detach(), {n: p.grad.clone() for n, p in params.items()}


class _Ops(TorchDispatchMode):
    """Records the operations run while active: each one's name and the shapes and dtypes of the
    dense tensors it makes (none for one that writes into a tensor it was given or returns a view
    of one), and the shapes of each matrix product's factors."""

    def __init__(self):
        super().__init__()
        self.run = []
        self.dtypes = []  # of the tensors in each of run's entries
        self.products = []  # (m, k, n) of each matrix product

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        views = any(r.alias_info is not None for r in func._schema.returns)
        tensors = [] if func._schema.is_mutable or views else [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        dense = [t for t in tensors if t.layout == torch.strided]
        self.run.append((str(func), [t.shape for t in dense]))
        self.dtypes.append([t.dtype for t in dense])
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2:]  # mm(a, b), addmm(c, a, b)
            self.products.append((a.shape[0], a.shape[1], b.shape[1]))
        return out

    def made(self, shape, dtype: torch.dtype | None = None) -> int:
        """How many tensors of `shape` (and `dtype`, where given) were made."""
        return sum(s == shape and dtype in (None, d) for (_, shapes), dtypes in zip(self.run, self.dtypes) for s, d in zip(shapes, dtypes))

    def flops(self, k: int | None = None, n: int | None = None) -> int:
        """2mkn summed over the matrix products, or over those of inner size k and n columns."""
        return sum(2 * a * b * c for a, b, c in self.products if k in (None, b) and n in (None, c))


def _head_and_tokens(seed: int):
    """A head of 1,000 outputs with a bias, 50 hidden states of 32 (with gradients) and their
    tokens, and the generator that drew them."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(32, 1000)
    hidden = torch.randn(50, 32, generator=g).requires_grad_()
    tokens = torch.randint(0, 1000, (50,), generator=g)
    return head, hidden, tokens, g


def _through_autograd(head: torch.nn.Linear) -> None:
    """The same matmul as a replaced forward, as an fp32 head's or an adapter's: the head's
    backward then goes through autograd."""
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight, head.bias)


@pytest.mark.parametrize("plain, onednn", [(True, False), (False, False), (True, True)])
def test_the_chunked_output_layer_keeps_no_logits_and_equals_the_whole_logits(monkeypatch, plain, onednn):
    # A vocabulary of 1000 in chunks of 16 tokens, 50 tokens, a head with a bias, temperature 0.7;
    # a plain Linear (its backward written out) or one whose forward is replaced, as an fp32 head
    # or an adapter is (its backward through autograd). `onednn`: the head's weight counts as
    # large, so its chunks' matmuls without gradients go through oneDNN (tandem.linears).
    monkeypatch.setattr(head_module, "HEAD_CHUNK_BYTES", 16 * 4 * 1000)
    if onednn:
        monkeypatch.setattr(linears, "ONEDNN_MIN_WEIGHT", 0)
    assert head_module.chunk_tokens(1000) == 16
    head, hidden, tokens, g = _head_and_tokens(0)
    if not plain:
        _through_autograd(head)
    assert head_module.plain_linear(head) == plain
    params = {"hidden": hidden, **dict(head.named_parameters())}
    weights = torch.randn(2, 50, generator=g)  # the loss weighs each token's log-prob and entropy differently

    def whole():
        logits = head(hidden).unsqueeze(0)  # (1, 50, V)
        return (token_logprobs(logits, tokens[None], 0.7)[0] * weights[0] + entropy_from_logits(logits, 0.7)[0] * weights[1]).sum()

    def chunked():
        logp, entropy = head_logprobs(head, hidden, tokens, 0.7, with_entropy=True, entropy_grad=True)
        return (logp * weights[0] + entropy * weights[1]).sum()

    whole_bytes, _, expected = _saved_bytes_and_gradients(params, whole)
    chunk_bytes, _, got = _saved_bytes_and_gradients(params, chunked)
    # Kept for the backward: the hidden states, tokens and the head's weights, no logits (a
    # (50, 1000) fp32 copy is 200 kB; the whole computation keeps several).
    assert chunk_bytes < 50 * 1000 * 4 < whole_bytes, (chunk_bytes, whole_bytes)
    with torch.no_grad():  # each token's log-prob and entropy (the losses' sums cancel too much to compare)
        logits = head(hidden).unsqueeze(0)
        want = torch.stack([token_logprobs(logits, tokens[None], 0.7)[0], entropy_from_logits(logits, 0.7)[0]])  # (2, 50)
        with torch.profiler.profile() as prof:
            values = torch.stack(head_logprobs(head, hidden, tokens, 0.7, with_entropy=True))  # (2, 50)
    assert ("mkldnn::_linear_pointwise" in {event.key for event in prof.key_averages()}) == onednn
    assert (values - want).abs().max() <= 1e-6 * want.abs().max()
    # Through autograd each chunk's weight gradient is a tensor of its own, summed one by one in
    # fp32: measured up to 1.2e-6 relative (where the memory lies changes the kernels' rounding).
    bound = 1e-6 if plain else 2e-6
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= bound * grad.norm(), name
    # The entropy as a metric carries no gradient.
    assert not head_logprobs(head, hidden, tokens, 0.7, with_entropy=True)[1].requires_grad


def test_an_adapters_dropout_on_the_output_layer_draws_the_same_masks_in_its_backward(monkeypatch):
    # LoRA on lm_head with lora_dropout 0.5 (a real PEFT adapter, B drawn non-zero so that A has a
    # gradient). The chunked head runs the adapter again in its backward; with the RNG as the
    # forward left it, its dropout draws the forward's masks. The reference: the same four chunks
    # of 16 tokens through autograd, from the same seed (so the same masks, drawn in the same order).
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(head_module, "HEAD_CHUNK_BYTES", 16 * 4 * 1000)
    head, hidden, tokens, g = _head_and_tokens(2)
    holder = get_peft_model(torch.nn.ModuleDict({"head": head}), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["head"], init_lora_weights=False))
    adapted = holder.base_model.model["head"]
    adapted.train()
    params = {"hidden": hidden, **{n: p for n, p in adapted.named_parameters() if p.requires_grad}}
    assert any("lora_A" in n for n in params) and not head_module.plain_linear(adapted)
    weights = torch.randn(50, generator=g)

    def whole():
        logits = torch.cat([adapted(hidden[s : s + 16]) for s in range(0, 50, 16)]).unsqueeze(0)  # (1, 50, V)
        return (token_logprobs(logits, tokens[None], 0.7)[0] * weights).sum()

    def chunked():
        return (head_logprobs(adapted, hidden, tokens, 0.7)[0] * weights).sum()

    torch.manual_seed(7)
    _, _, expected = _saved_bytes_and_gradients(params, whole)
    torch.manual_seed(7)
    _, _, got = _saved_bytes_and_gradients(params, chunked)
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 2e-6 * grad.norm(), name
    # the backward leaves the RNG where the forward left it: what draws next draws the same
    torch.manual_seed(7)
    chunked()
    after_forward = torch.get_rng_state()
    torch.manual_seed(7)
    chunked().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)


@pytest.mark.parametrize("plain", [True, False])
def test_an_entropy_kept_as_a_metric_costs_the_output_layers_backward_nothing(plain):
    # Autograd hands the backward zeros for the entropy, an output it was told has no gradient.
    # The backward must not compute the entropy's gradient from them: it makes as many
    # logit-sized tensors (50 tokens x 1,000, one chunk) as without the entropy, fewer than with
    # an entropy bonus, and the same gradients.
    head, hidden, tokens, _ = _head_and_tokens(1)
    if not plain:
        _through_autograd(head)

    def backward(with_entropy, entropy_grad=False):
        hidden.grad = head.weight.grad = head.bias.grad = None
        logp, entropy = head_logprobs(head, hidden, tokens, 0.7, with_entropy, entropy_grad)
        assert (entropy > 0).all() == with_entropy  # computed only when asked
        with _Ops() as ops:
            (logp.sum() + (entropy.sum() if entropy_grad else 0.0)).backward()
        return ops.made((50, 1000)), [t.grad.clone() for t in (hidden, head.weight, head.bias)]

    (made, grads), (metric_made, metric_grads), (bonus_made, _) = backward(False), backward(True), backward(True, True)
    assert metric_made == made < bonus_made, (made, metric_made, bonus_made)
    assert all(torch.equal(a, b) for a, b in zip(metric_grads, grads))


def test_the_output_layers_chunks_reuse_the_logit_sized_tensors_of_their_call(monkeypatch):
    # Chunks of 16 tokens; 32 tokens (2 chunks) and 64 (4), under bf16 autocast: a plain head's
    # forward and backward make as many (16, 1000) tensors either way, as every chunk writes into
    # its call's (at a vocabulary of 151,936 a chunk's tensors of their own came back as fresh
    # pages from the OS, as the CLI sets glibc: tandem/cli.py). In fp32 each chunk's logits are
    # still its own (fast_linears' oneDNN matmul writes into no given tensor).
    monkeypatch.setattr(head_module, "HEAD_CHUNK_BYTES", 16 * 4 * 1000)
    head, hidden, tokens, _ = _head_and_tokens(4)
    made = []
    for n in (32, 64):
        h = hidden.detach()[:32].repeat(n // 32, 1).requires_grad_()
        with _Ops() as ops:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = head_logprobs(head, h, tokens[:32].repeat(n // 32), 0.7, with_entropy=True)
            (logp * torch.linspace(-1, 1, n)).sum().backward()
        made.append(ops.made((16, 1000)))
    assert made[0] == made[1] > 0, made


def test_under_bf16_autocast_the_output_layers_written_out_backward_equals_autograds(monkeypatch):
    # Training in bf16 the head's matmuls run in bf16. Its written-out backward (a plain Linear)
    # and autograd's (a replaced forward) compute the same bf16 products; the logits' gradient is
    # formed in fp32 in another order, so a few of its bf16 roundings differ: over 40 seeds the
    # gradients differed by up to 1.5e-4 of their norms (hidden states) and 9e-6 (weight, bias),
    # bounded here by a quarter of bf16's precision (2^-8). The written-out backward makes one
    # bf16 copy of the weight for the whole backward, autograd one a chunk.
    monkeypatch.setattr(head_module, "HEAD_CHUNK_BYTES", 16 * 4 * 1000)  # chunks of 16 tokens
    head, hidden, tokens, g = _head_and_tokens(3)
    weights = torch.randn(2, 50, generator=g)
    grads, copies = {}, {}
    for plain in (True, False):
        if not plain:
            _through_autograd(head)
        hidden.grad = head.weight.grad = head.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, entropy = head_logprobs(head, hidden, tokens, 0.7, with_entropy=True, entropy_grad=True)
        with _Ops() as ops:
            (logp * weights[0] + entropy * weights[1]).sum().backward()
        copies[plain] = sum(name.startswith("aten._to_copy") and shapes == [head.weight.shape] for name, shapes in ops.run)
        grads[plain] = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    assert all(t.dtype == torch.float32 for t in grads[True])
    for got, want in zip(grads[True], grads[False]):
        assert (got - want).norm() <= 1e-3 * want.norm()
    assert copies[True] == 1 and copies[False] == 8, copies  # 4 chunks: the weight's cast and its gradient's back


def _model_and_loss(tiny_model, seed: int):
    """The tiny model, a micro-batch of three length buckets, and a loss over it that weighs each
    token's log-prob and entropy differently."""
    lm = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(seed)
    mb = collate(_groups_of_rollouts(g), 0, "cpu", False, max_buckets=3, bucket_cost=0)
    weights = torch.randn(2, *mb.completion_ids.shape, generator=g)

    def run():
        logp, entropy = completion_logprobs(PrefixSharingLM(lm), mb, 0.9, with_entropy=True, entropy_grad=True)
        return (logp * weights[0] + entropy * weights[1]).sum()

    return lm, mb, run


def test_gradient_checkpointing_keeps_less_for_the_backward_and_changes_no_gradient(tiny_model):
    lm, mb, run = _model_and_loss(tiny_model, 2)
    params = dict(lm.named_parameters())
    plain_bytes, plain_loss, expected = _saved_bytes_and_gradients(params, run)
    assert checkpoint_layers(lm) == lm.config.num_hidden_layers
    ckpt_bytes, ckpt_loss, got = _saved_bytes_and_gradients(params, run)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)  # measured: 0.15 of it
    assert torch.equal(ckpt_loss, plain_loss)
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 1e-6 * grad.norm(), name


def test_the_chunked_mlp_keeps_less_for_the_backward_and_changes_no_result(tiny_model, monkeypatch):
    # Chunks of 7 tokens (the tiny model's intermediate size is 256): every micro-batch here is
    # larger than a chunk, so each layer's MLP runs gated_mlp, with a last chunk shorter than 7.
    monkeypatch.setattr(mlp, "MLP_CHUNK_BYTES", 7 * 256 * 4)
    lm, mb, run = _model_and_loss(tiny_model, 3)
    params = dict(lm.named_parameters())
    with torch.no_grad():
        own = completion_logprobs(PrefixSharingLM(lm), mb, 0.9)[0]
    plain_bytes, plain_loss, expected = _saved_bytes_and_gradients(params, run)
    assert mlp.chunk_mlps(lm) == lm.config.num_hidden_layers
    chunked_bytes, chunked_loss, got = _saved_bytes_and_gradients(params, run)
    # Each MLP keeps gate(x) and up(x), not their silu and product: 2 of its 4 intermediates.
    saved_less = plain_bytes - chunked_bytes
    intermediates = lm.config.num_hidden_layers * lm.config.intermediate_size * 4 * (mb.prompt_ids.numel() + sum(len(r) * w for r, w in mb.buckets))
    assert saved_less >= intermediates / 2, (saved_less, intermediates)
    assert (chunked_loss - plain_loss).abs() <= 1e-6 * plain_loss.abs()
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 1e-6 * grad.norm(), name
    with torch.no_grad():  # without gradients every call is the module's own
        assert torch.equal(completion_logprobs(PrefixSharingLM(lm), mb, 0.9)[0], own)


def test_a_checkpointed_layers_mlp_keeps_its_input_and_its_recompute_stops_before_it(tiny_model, monkeypatch):
    # With recompute the MLP keeps x past the checkpoint's hooks and makes gate(x) and up(x) again
    # in its own backward, so the layer's recompute can stop at the MLP's input: the backward then
    # runs no down projection forward. Chunks of 1 token: every call of more runs gated_mlp.
    monkeypatch.setattr(mlp, "MLP_CHUNK_BYTES", 1)
    flops, grads = {}, {}
    for recompute in (None, False, True):  # None: the model's own MLP, not checkpointed
        lm, mb, run = _model_and_loss(tiny_model, 3)
        if recompute is not None:
            assert checkpoint_layers(lm) == mlp.chunk_mlps(lm, recompute) == lm.config.num_hidden_layers
        with _Ops() as forward:
            loss = run()
        lm.zero_grad(set_to_none=True)
        with _Ops() as backward:
            loss.backward()
        # In the forward the products of inner size I into H columns are the down projections.
        flops[recompute] = forward.flops(k=lm.config.intermediate_size, n=lm.config.hidden_size), backward.flops()
        grads[recompute] = {name: p.grad.clone() for name, p in lm.named_parameters()}
    (down, kept), (_, recomputed) = flops[False], flops[True]
    assert down > 0 and kept - recomputed == down, (kept, recomputed, down)
    for name, grad in grads[None].items():
        for recompute in (False, True):
            assert (grads[recompute][name] - grad).norm() <= 1e-6 * grad.norm(), (recompute, name)


def _tables_and_gradients(lm, run):
    """How many embedding-table-sized dense tensors the backward of `run` makes, and the gradients."""
    lm.zero_grad(set_to_none=True)
    loss = run()
    with _Ops() as ops:
        loss.backward()
    return ops.made(lm.get_input_embeddings().weight.shape, torch.float32), {name: p.grad.clone() for name, p in lm.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True])
def test_a_tied_embeddings_sparse_gradient_is_added_in_place_into_the_output_layers(tiny_model, monkeypatch, bf16):
    # bf16: under autocast too (the head's matmuls in bf16, the gradients in fp32, added a slice
    # of 64 vocabulary rows at a time: a slice of the whole table would count as one)
    lm, mb, fp32_run = _model_and_loss(tiny_model, 4)
    monkeypatch.setattr(head_module, "GRAD_SLICE_ROWS", 64)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return fp32_run()

    assert not embedding.sparse_tied_embedding(lm)  # the tiny model's table is far below EMBEDDING_SPARSE_BYTES
    plain_tables, expected = _tables_and_gradients(lm, run)
    monkeypatch.setattr(embedding, "EMBEDDING_SPARSE_BYTES", 0)
    assert embedding.sparse_tied_embedding(lm)
    tables, got = _tables_and_gradients(lm, run)
    weight = lm.get_input_embeddings().weight
    assert weight.grad.layout == torch.strided
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 1e-6 * grad.norm(), name
    # The one table-sized fp32 tensor made is the weight's gradient; autograd makes one per output
    # layer call and per lookup (the prompts' pass and each bucket's), and their sums. (In bf16
    # each output layer call also makes a bf16 copy of the weight.)
    assert tables == 1 and plain_tables > 2, (tables, plain_tables)
    run().backward()  # a second micro-batch: both shares add into the gradient already there
    for name, param in lm.named_parameters():
        assert (param.grad - 2 * expected[name]).norm() <= 2e-6 * expected[name].norm(), name
    with torch.no_grad():  # without gradients the module's own call
        ids = mb.prompt_ids
        assert torch.equal(lm.get_input_embeddings()(ids), weight[ids])


class _FailingTokenizer:
    def save_pretrained(self, path):
        raise OSError("disk full")


def _save(out, step, model, tokenizer):
    """The trainer's sequence: staging folder, files, then finish (fsync, rename, move latest)."""
    tmp = checkpoint.start(out, step)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return checkpoint.finish(out, step)


def test_a_failed_save_leaves_latest_on_the_previous_checkpoint(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    _save(tmp_path, 1, model, tok)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, model, _FailingTokenizer())
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()


def test_a_save_cut_while_it_replaces_the_checkpoint_latest_names_leaves_that_checkpoint_whole(tiny_model, tmp_path, monkeypatch):
    # A resumed run saves checkpoint-2 again while `latest` names the first run's checkpoint-2.
    # The save dies between moving the old folder out and the new one in (a fault injected at
    # that rename): the old copy must still be what `latest` gives. It used to be deleted first.
    from transformers import AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    _save(tmp_path, 2, model, tok)
    first = (tmp_path / "checkpoint-2" / "model.safetensors").read_bytes()
    real_replace = os.replace

    def dies_at_the_new_folder(src, dst):
        if Path(src).name.startswith(".tmp-checkpoint"):
            raise KeyboardInterrupt("killed")  # what a SIGKILL leaves: nothing after this runs
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_at_the_new_folder)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, tok)
    monkeypatch.setattr(os, "replace", real_replace)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert (tmp_path / "checkpoint-2" / "model.safetensors").read_bytes() == first
    again = _save(tmp_path, 2, model, tok)  # the next save goes through, and leaves no trash behind
    assert checkpoint.incomplete(again) is None and not list(tmp_path.glob(".trash-*"))


def test_a_checkpoint_with_a_file_missing_or_cut_short_is_refused_naming_it(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    ckpt = _save(tmp_path, 1, model, tok)
    (ckpt / "trainer_state.json").write_text("{}")  # resolve() checks for it; the marker lists what else was written
    assert checkpoint.resolve(str(ckpt), tmp_path) == ckpt  # whole: the marker names what was written
    (ckpt / "tokenizer_config.json").unlink()  # half deleted (the RNG file, a shard: the same)
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json is missing"):
        checkpoint.resolve(str(ckpt), tmp_path)
    assert latest_checkpoint(tmp_path) is None
    with open(ckpt / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    assert "model.safetensors has 100 bytes" in checkpoint.incomplete(ckpt)


def test_killing_a_process_mid_save_never_breaks_latest(tiny_model, tmp_path):
    """SIGKILL a process that saves checkpoints in a loop; `latest` must always load."""
    script = textwrap.dedent(
        f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from tandem.trainer import checkpoint
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model)!r})
        tok = AutoTokenizer.from_pretrained({str(tiny_model)!r})
        for step in range(1, 1000):
            tmp = checkpoint.start({str(tmp_path)!r}, step)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            checkpoint.finish({str(tmp_path)!r}, step)
            print(step, flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(3):  # let a few saves complete, then kill during the next one
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    AutoModelForCausalLM.from_pretrained(latest)
    assert int(latest.name.split("-")[1]) >= 3


def test_an_async_round_may_take_what_its_timeouts_allow_and_no_more(tiny_model, tmp_path):
    import time

    from transformers import AutoTokenizer

    from tandem.data import GroupSampler
    from tandem.rewards import NamedReward
    from tandem.engines.engine import TransformersEngine
    from tandem.rollout.types import SamplingParams
    from tandem.trainer.config import TrainConfig
    from tandem.trainer.producer import AsyncProducer, PromptTable, RoundTimeout

    # The bound covers each generate call (retried for rollout_server_timeout after an answer of up
    # to rollout_request_timeout) and every reward function's timeout, for each dynamic-sampling
    # draw: here 4 calls x (240 + 600 + 2 x 600) s, and a minute. (It was 240 + 600 + 60 s, and an
    # async run with slow rewards died where the same sync run went on.)
    config = TrainConfig(reward_funcs=["exact_match", "accuracy"], dynamic_sample=True, max_resample_times=3)
    assert config.round_timeout() == 4 * (240 + 600 + 2 * 600) + 60
    assert TrainConfig(reward_funcs=["exact_match"]).round_timeout() == 240 + 600 + 600 + 60
    assert TrainConfig(reward_funcs=["exact_match"], reward_timeout=None).round_timeout() is None  # no bound on rewards: none on the round

    # A round past its bound stops the run naming what it waited for (a RoundTimeout, which the
    # trainer handles as a server failure: the emergency checkpoint), not a bare TimeoutError.
    def slow(prompts, completions, **kw):
        time.sleep(1.5)
        return [0.0] * len(completions)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(tiny_model), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    table = PromptTable(prompts=["p"], prompt_ids=[[7, 8]], columns={}, conversational=[False])
    producer = AsyncProducer(table, GroupSampler(1, 1, 0), engine, tokenizer, [NamedReward("slow", slow, 1.0)], SamplingParams(max_tokens=2),
                             2, 0, round_timeout=0.5, last_round=0)  # fmt: skip
    producer.start()
    with pytest.raises(RoundTimeout, match=r"waited 0.5s for round 0 to be generated and scored .* a rollout server or a reward function is stuck"):
        producer.next_round()
    producer.close(ok=False)


def test_the_policy_options_for_dropout_and_an_fp32_head(tiny_model):
    from tandem.trainer.lora import LoraOptions
    from tandem.trainer.setup import PolicyOptions, build_policy

    def policy(**over):
        options = dict(model=str(tiny_model), load_kwargs={}, disable_dropout=False, head_in_fp32=False, checkpointing=False, reference=False, lora=None,
                       fused=False, learning_rate=1e-3, betas=(0.9, 0.999), weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0, max_steps=2)  # fmt: skip
        return build_policy(PolicyOptions(**(options | over)), None, "cpu")[0]

    # disable_dropout: every dropout off, LoRA's adapters' included
    lora = LoraOptions(r=4, alpha=8, dropout=0.1, target_modules=["q_proj"], modules_to_save=None, model=str(tiny_model))
    dropouts = lambda m: [d.p for d in m.modules() if isinstance(d, torch.nn.Dropout)]  # noqa: E731
    assert 0.1 in dropouts(policy(lora=lora)) and set(dropouts(policy(lora=lora, disable_dropout=True))) == {0.0}
    # cast_lm_head_to_fp32: under bf16 autocast the logits come out in fp32 (bf16 without it)
    ids = torch.tensor([[1, 120, 118]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy()(input_ids=ids).logits.dtype == torch.bfloat16
        assert policy(head_in_fp32=True)(input_ids=ids).logits.dtype == torch.float32


@pytest.mark.quick
def test_gradient_checkpointings_default_is_on_at_real_shapes_and_off_for_small_models():
    from transformers import Qwen2Config

    from tandem.trainer.setup import resolve_checkpointing

    qwen05 = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    toy = Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=4)  # bench/vs_trl.py's `small` model
    gb = 10**9
    # bench/scale.py's 8 completions of 256 tokens after prompts of up to 20: 2,208 tokens x (48 x 896
    # + 8 x 4,864) bytes x 24 layers = 4.34 GB, over an eighth of 20 GB; the toy shape's 64 completions
    # of up to 64 tokens after prompts of up to 12: 4,864 tokens x (48 x 256 + 8 x 1,024) x 4 = 0.40 GB, under it
    on, why = resolve_checkpointing(qwen05, 8 * (20 + 256), 20 * gb)
    assert on and "about 4.34 GB" in why and "over 1/8 of the 20.0 GB" in why
    off, why = resolve_checkpointing(toy, 64 * (12 + 64), 20 * gb)
    assert not off and "about 0.40 GB" in why
    assert resolve_checkpointing(toy, 64 * (12 + 64), 3 * gb)[0]  # with 3 GB to have, 0.4 GB is over an eighth
