"""tandem's CUDA paths, on a GPU: marked `gpu` and skipped without one, so CI (CPU only) skips
them all. bench/gpu/check.sh runs them on a GPU machine; with TANDEM_TEST_DEVICE=cpu they run on
the CPU instead (the CUDA IPC push excepted), which rehearses them before GPU time is spent."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from conftest import Server, train
from tandem.algo import entropy_from_logits, token_logprobs
from tandem.demo import addition_rows, write_jsonl
from tandem.engines import engine as engine_module
from tandem.engines.engine import TransformersEngine
from tandem.rollout.client import RolloutClient
from tandem.rollout.types import Rollout, SamplingParams
from tandem.rollout.weights import fingerprint
from tandem.trainer import mlp
from tandem.trainer.batch import PrefixSharingLM, checkpoint_layers, collate, completion_logprobs
from tandem.trainer.head import head_logprobs
from test_async import DIGITS, base_args, read
from test_trainer_parts import _groups_of_rollouts, _saved_bytes_and_gradients

DEVICE = torch.device(os.environ.get("TANDEM_TEST_DEVICE", "cuda"))
CUDA = DEVICE.type == "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu/check.sh)")]
PROMPTS = [[1, 120, 118, 104, 117, 13, 54, 46, 55], [5, 6, 7], [1, 100, 101]]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("bf16", [False, True])
def test_the_chunked_output_layer_and_its_written_out_backward_equal_autograd_on_the_whole_logits(bf16):
    # A vocabulary of 151,936 (Qwen's), 300 tokens: several chunks. In fp32 the two agree to
    # rounding; under bf16 autocast both run the head's matmul in bf16, and the logits'
    # gradient is formed in another order: a quarter of bf16's precision bounds the difference.
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 151_936, bias=False).to(DEVICE)
    hidden = torch.randn(300, 64, generator=g).to(DEVICE).requires_grad_()
    tokens = torch.randint(0, 151_936, (300,), generator=g).to(DEVICE)
    weights = torch.randn(2, 300, generator=g).to(DEVICE)
    params = {"hidden": hidden, "weight": head.weight}
    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=bf16)

    def whole():
        with autocast:
            logits = head(hidden).float().unsqueeze(0)
        return (token_logprobs(logits, tokens[None], 0.7)[0] * weights[0] + entropy_from_logits(logits, 0.7)[0] * weights[1]).sum()

    def chunked():
        with autocast:
            logp, entropy = head_logprobs(head, hidden, tokens, 0.7, with_entropy=True, entropy_grad=True)
        return (logp * weights[0] + entropy * weights[1]).sum()

    whole_bytes, whole_loss, expected = _saved_bytes_and_gradients(params, whole)
    chunk_bytes, chunk_loss, got = _saved_bytes_and_gradients(params, chunked)
    assert chunk_bytes < 300 * 151_936 * 4 < whole_bytes, (chunk_bytes, whole_bytes)  # no logits kept
    bound = 2**-10 if bf16 else 1e-5
    assert abs(chunk_loss.item() - whole_loss.item()) <= bound * abs(whole_loss.item()) + 1e-4
    for name, grad in expected.items():
        assert relative(got[name], grad) <= bound, name


def test_the_checkpointed_chunked_mlp_changes_no_gradient(tiny_model, monkeypatch):
    monkeypatch.setattr(mlp, "MLP_CHUNK_BYTES", 7 * 256 * 4)  # chunks of 7 tokens: every MLP call runs in chunks
    lm = AutoModelForCausalLM.from_pretrained(tiny_model).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    mb = collate(_groups_of_rollouts(g), 0, DEVICE, False, max_buckets=3, bucket_cost=0)
    weights = torch.randn(2, *mb.completion_ids.shape, generator=g).to(DEVICE)

    def run():
        logp, entropy = completion_logprobs(PrefixSharingLM(lm), mb, 0.9, with_entropy=True, entropy_grad=True)
        return (logp * weights[0] + entropy * weights[1]).sum()

    params = dict(lm.named_parameters())
    plain_bytes, plain_loss, expected = _saved_bytes_and_gradients(params, run)
    assert checkpoint_layers(lm) == mlp.chunk_mlps(lm, recompute=True) == lm.config.num_hidden_layers
    ckpt_bytes, ckpt_loss, got = _saved_bytes_and_gradients(params, run)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)
    assert abs(ckpt_loss.item() - plain_loss.item()) <= 1e-5 * abs(plain_loss.item())
    for name, grad in expected.items():
        assert relative(got[name], grad) <= 1e-5, name


@pytest.fixture(scope="module")
def engine(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).to(DEVICE)
    return TransformersEngine(model, [tok.eos_token_id], tok.pad_token_id), tok


def test_the_decode_cache_decodes_what_transformers_cache_does(engine, monkeypatch):
    base, tok = engine
    eng = TransformersEngine(base.model, list(range(3, 60)), tok.pad_token_id)  # many stop tokens: rows leave mid-way
    params = SamplingParams(max_tokens=16, temperature=0.8)
    prompts, seeds = [PROMPTS[0]] * 6 + [PROMPTS[1]] * 6, list(range(12))
    ours = eng.generate(prompts, params, seeds)
    monkeypatch.setattr(engine_module, "decode_cache", lambda config, capacity: DynamicCache(config=config))
    theirs = eng.generate(prompts, params, seeds)
    assert len({len(o.token_ids) for o in ours}) > 2
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)  # the two caches' attention may take other kernels


def test_behaviour_logprobs_equal_the_trainers_recompute_and_depend_on_the_seed_alone(engine):
    eng, tok = engine
    params = SamplingParams(max_tokens=10, temperature=0.7, top_k=20)
    outs = eng.generate(PROMPTS, params, [1, 2, 3])
    for a, b in zip(eng.generate([PROMPTS[2], PROMPTS[0]], params, [3, 1]), [outs[2], outs[0]]):  # not on the batch
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    rollouts = [Rollout(0, 0, p, o.token_ids, o.logprobs, o.finish_reason, 0) for p, o in zip(PROMPTS, outs)]
    mb = collate(rollouts, tok.pad_token_id, DEVICE, False)
    with torch.no_grad():
        logps, _ = completion_logprobs(PrefixSharingLM(eng.model), mb, 0.7)
    for i, o in enumerate(outs):
        assert logps[i, : len(o.token_ids)].tolist() == pytest.approx(o.logprobs, abs=1e-4)


def test_a_colocated_run_on_the_device_resumes_bitwise(tiny_model, tmp_path):
    (tmp_path / "digits.py").write_text(DIGITS)
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    out = tmp_path / "run"
    args = base_args(tiny_model, data, out, 16, "--max_steps", "4", "--save_steps", "2", "--lr_scheduler_type", "constant", "--bf16", "true")
    train(1, args)
    whole, (metrics, _) = load_file(out / "checkpoint-4" / "model.safetensors"), read(out)
    assert metrics[-1]["memory/peak_gb/max"] > 0
    train(1, [*args, "--resume_from_checkpoint", out / "checkpoint-2"])
    resumed, (again, _) = load_file(out / "checkpoint-4" / "model.safetensors"), read(out)
    # Not equal bitwise would say the GPU run is not deterministic (atomics in a CUDA kernel: the
    # sparse add of a tied embedding's gradient, attention's backward) where a small difference
    # shows, or that the resume is wrong where a large one does.
    worst = max((whole[k].float() - resumed[k].float()).abs().max().item() for k in whole)
    assert worst == 0, f"the resumed run's weights differ by up to {worst}"
    assert [m["loss"] for m in again[-2:]] == [m["loss"] for m in metrics[-2:]]


@pytest.mark.skipif(not CUDA, reason="CUDA IPC needs a GPU")
def test_a_push_through_cuda_ipc_serves_the_weights_the_trainer_holds(tiny_model):
    # A server on the trainer's GPU: `auto` picks CUDA IPC; the server's fingerprint equals the
    # trainer's weights in its dtype, and the same push over HTTP gives the same weights.
    server = Server(tiny_model, "--device", str(DEVICE), "--dtype", "bfloat16")
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model).to(DEVICE)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        named = list(model.named_parameters())
        want = fingerprint((n, t.to(torch.bfloat16)) for n, t in named)
        client = RolloutClient([server.url], server_timeout=60, weight_bucket_bytes=200_000)  # several buckets
        assert client._transport(server.url, DEVICE) == "cuda_ipc"
        client.push_weights(named, 1)
        assert client.fingerprint(server.url) == {"version": 1, "fingerprint": want}
        assert all(t.device == DEVICE for _, t in client._last_pushed[1])  # the push's copy stayed on the GPU
        client.transport = "http"
        client.push_weights(named, 2)
        assert client.fingerprint(server.url)["fingerprint"] == want
        client.close()
    finally:
        server.stop()
