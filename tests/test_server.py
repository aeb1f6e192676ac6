"""The rollout server as a real process on a loopback port, and the trainer against it."""

import asyncio
import contextlib
import json
import logging
import os
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import HAVE_VLLM, KEY, LIMITS, FakeServer, Server, cli_here, free_port, run_cli
from tandem.aio import in_own_thread
from tandem.rollout.client import RolloutClient, RolloutServerError
from tandem.engines.engine import TransformersEngine
from tandem.rollout.types import SamplingParams
from tandem.rollout.weights import fingerprint

PROMPT = [1, 120, 118, 104, 117, 13, 54, 46, 55]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model, *LIMITS)
    yield s
    s.stop()


def call(server, method, path, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return requests.request(method, server.url + path, headers=headers, timeout=60, **kw)


def gen_body(**over):
    body = {"prompts": [PROMPT], "n": 2, "sampling": {"max_tokens": 5}, "seeds": [1, 2]}
    body.update(over)
    return body


@pytest.mark.quick
def test_health_info_and_openapi(server):
    health = call(server, "GET", "/health", key=None).json()
    assert health["status"] == "ready" and health["version"] == 0 and len(health["instance_id"]) == 32
    info = call(server, "GET", "/info").json()
    assert info["engine"] == "TransformersEngine" and info["vocab_size"] == 259
    assert info["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # on CPU, half the cores by default
    assert "/generate" in call(server, "GET", "/openapi.json").json()["paths"]
    assert call(server, "GET", "/openapi.json", key=None).status_code == 401  # only /health answers without the key


@pytest.mark.quick
def test_generate_matches_a_local_engine_with_the_same_seeds(server, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    local = TransformersEngine(AutoModelForCausalLM.from_pretrained(tiny_model), [tok.eos_token_id], tok.pad_token_id)
    expected = local.generate([PROMPT, PROMPT], SamplingParams(max_tokens=5), [1, 2])
    got = call(server, "POST", "/generate", json=gen_body()).json()["completions"]
    assert [c["token_ids"] for c in got] == [e.token_ids for e in expected]
    assert got[0]["logprobs"] == pytest.approx(expected[0].logprobs, abs=1e-5)
    assert {c["version"] for c in got} == {0}


def test_concurrent_clients_are_batched_and_none_starves(server):
    before = call(server, "GET", "/info").json()["stats"]
    bodies = [gen_body(seeds=[10 + i, 20 + i]) for i in range(8)]
    # one different-parameter request among them must still be served
    bodies.append(gen_body(sampling={"max_tokens": 4, "temperature": 0.5}))
    solo = [call(server, "POST", "/generate", json=b).json()["completions"] for b in bodies]
    mid = call(server, "GET", "/info").json()["stats"]
    results = [None] * len(bodies)

    def ask(i):
        results[i] = call(server, "POST", "/generate", json=bodies[i]).json()["completions"]

    # keep the engine busy so the small requests queue up behind it
    busy = threading.Thread(target=call, args=(server, "POST", "/generate"), kwargs={"json": gen_body(n=64, seeds=list(range(64)), sampling={"max_tokens": 60})})
    busy.start()
    time.sleep(0.05)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads + [busy]:
        t.join(timeout=60)
    after = call(server, "GET", "/info").json()["stats"]
    tokens = lambda rs: [[c["token_ids"] for c in r] for r in rs]  # noqa: E731
    assert tokens(results) == tokens(solo), "a request must get the same completions batched or alone"
    for r, s in zip(results, solo):
        for a, b in zip(r, s):
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)  # batch shape moves the last bits only
    assert mid["engine_calls"] - before["engine_calls"] == len(bodies)
    # every sequence's prompt counted, none from a prefix cache (this engine has none)
    assert mid["prompt_tokens"] - before["prompt_tokens"] == sum(len(PROMPT) * b["n"] for b in bodies)
    assert mid["cached_prompt_tokens"] == before["cached_prompt_tokens"] == 0
    calls = after["engine_calls"] - mid["engine_calls"]
    assert calls <= 4, f"{len(bodies) + 1} concurrent requests took {calls} engine calls"


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_says_how_to_install_it(tiny_model):
    proc = cli_here("rollout", "--model", tiny_model, "--engine", "vllm", "--port", str(free_port()), timeout=60)
    assert proc.returncode == 2
    assert "pip install 'tandem-rl[vllm]'" in proc.stderr


@pytest.mark.quick
def test_non_loopback_bind_without_a_key_refuses_to_start(tiny_model):
    proc = run_cli("rollout", "--model", tiny_model, "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    assert proc.returncode == 2
    assert "--api-key" in proc.stderr


def _train(args, out):
    proc = cli_here("train", *args, "--output_dir", out, "--disable_tqdm", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return metrics, completions


@pytest.mark.quick
def test_server_mode_trains_like_colocated_mode(tiny_model, tmp_path):
    from tandem.demo import addition_rows, write_jsonl

    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    reward = tmp_path / "digits.py"
    reward.write_text("def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / 4 for c in completions]\n")
    common = [
        "--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_funcs", f"{reward}:digits",
        "--num_generations", "4", "--per_device_train_batch_size", "16", "--max_completion_length", "4",
        "--learning_rate", "1e-2", "--max_steps", "4", "--num_completions_to_log", "16",
    ]  # fmt: skip
    server = Server(tiny_model)
    remote_args = common + ["--rollout_mode", "server", "--rollout_server_urls", server.url]
    try:
        # Without the off-policy correction (on by default in server mode, where the weights
        # stay within rounding of 1 here) the two modes compute the same bits.
        remote, remote_completions = _train(remote_args + ["--verify_weight_sync", "true", "--off_policy_correction", "none"], tmp_path / "server")
        served = requests.get(server.url + "/weights/fingerprint", timeout=30).json()
        # What docs/async.md says is reproducible when other clients load the server (their
        # requests batched with ours): the tokens and rewards always; the losses bitwise without
        # the correction, and to float rounding with it (the behaviour log-probs move with the batch).
        corrected = _train(remote_args, tmp_path / "corrected")[0]
        with _loaded(server):
            loaded, loaded_completions = _train(remote_args + ["--off_policy_correction", "none"], tmp_path / "loaded")
            loaded_corrected, loaded_corrected_completions = _train(remote_args, tmp_path / "loaded_corrected")
    finally:
        server.stop()
    assert [m["loss"] for m in loaded] == [m["loss"] for m in remote]
    assert loaded_completions == remote_completions and loaded_corrected_completions == remote_completions
    assert [m["reward"] for m in loaded_corrected] == [m["reward"] for m in corrected]
    assert [m["loss"] for m in loaded_corrected] == pytest.approx([m["loss"] for m in corrected], abs=1e-5, rel=0)
    local, local_completions = _train(common, tmp_path / "colocate")
    assert [m["loss"] for m in remote] == [m["loss"] for m in local]
    assert [c["completion"] for c in remote_completions] == [c["completion"] for c in local_completions]
    assert [m["policy_version"] for m in remote] == [1, 2, 3, 4]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "server" / "checkpoint-4")
    assert served == {"version": 4, "fingerprint": fingerprint(trained.named_parameters())}
    assert remote[0]["time/weight_sync"] > 0


@contextlib.contextmanager
def _loaded(server):
    """Another client sending generate requests without pause (other prompts and seeds, the
    trainer's sampling settings, so the server batches them with the trainer's)."""
    stop, answers = threading.Event(), []

    def load():
        seed = 1000
        while not stop.is_set():
            body = {"prompts": [PROMPT[:5], PROMPT], "n": 1, "sampling": {"max_tokens": 4}, "seeds": [seed, seed + 1]}
            answers.append(requests.post(server.url + "/generate", json=body, timeout=60).status_code)
            seed += 2

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(answers) > 10 and set(answers) == {200}, answers


def test_trainer_stops_with_an_error_naming_a_missing_server(tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    t = time.monotonic()
    proc = cli_here(
        "train", "--model_name_or_path", tiny_model, "--dataset_name", tmp_path / "d.jsonl", "--reward_funcs", "exact_match",
        "--rollout_mode", "server", "--rollout_server_urls", url, "--rollout_server_timeout", "3", "--output_dir", tmp_path / "run",
    )  # fmt: skip
    assert proc.returncode == 1
    assert time.monotonic() - t < 60
    assert f"rollout server {url} did not answer" in proc.stderr and "rollout_server_timeout=3.0s" in proc.stderr


@pytest.mark.quick
def test_safetensors_stream_and_parse_agree_with_the_library():
    from safetensors.torch import load

    from tandem.rollout.weights import parse_safetensors, safetensors_stream

    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5).to(torch.bfloat16), "c": torch.tensor([True, False]), "d": torch.zeros(0, 2)}
    length, pieces = safetensors_stream(tensors)
    ours = b"".join(bytes(p) for p in pieces)
    assert len(ours) == length
    theirs = save(tensors)
    for decoded in (load(ours), parse_safetensors(bytearray(theirs)), parse_safetensors(bytearray(ours))):
        assert all(torch.equal(decoded[k], tensors[k]) for k in tensors)
    for bad in (b"", b"\x00" * 4, (10**9).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]"):
        with pytest.raises(ValueError):
            parse_safetensors(bytearray(bad))


@pytest.mark.quick
def test_a_stream_cast_a_piece_at_a_time_is_the_cast_tensors_stream(monkeypatch):
    # What a push to servers on this host writes into its files (client._SharedFiles.write):
    # the weights cast to the servers' dtype piece by piece, the pieces smaller than a tensor here.
    from tandem.rollout import weights

    monkeypatch.setattr(weights, "STREAM_PIECE", 64)
    tensors = {"w": torch.randn(10, 7), "b": torch.randn(3), "e": torch.zeros(0, 2)}
    cast = b"".join(bytes(p) for p in weights.safetensors_stream(tensors, torch.bfloat16)[1])
    whole = b"".join(bytes(p) for p in weights.safetensors_stream({k: t.to(torch.bfloat16) for k, t in tensors.items()})[1])
    assert cast == whole and weights.safetensors_stream(tensors, torch.bfloat16)[0] == len(whole)


def test_a_trainer_leaves_a_same_host_servers_cores_free(monkeypatch):
    from tandem.rollout.weights import host_id
    from tandem.trainer.setup import trainer_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    here = {"host_id": host_id(), "device": "cpu", "threads": 1}
    threads, line = trainer_threads([here], local_processes=1)
    assert threads == max(1, cores - 1) and f"use 1 of its {cores} cores" in line
    assert trainer_threads([{**here, "threads": 64}], 1)[0] == 1  # never below one thread
    assert trainer_threads([{**here, "host_id": "elsewhere"}], 1) is None  # another host: nothing shared
    assert trainer_threads([{**here, "device": "cuda"}], 1) is None  # a GPU server computes elsewhere
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert trainer_threads([here], 1) is None  # the user's own choice stands


def test_a_sync_trainer_lends_its_cores_to_the_servers_on_its_host(monkeypatch):
    from tandem.rollout.weights import host_id
    from tandem.trainer.setup import lent_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    here = {"host_id": host_id(), "device": "cpu", "threads": 1}
    lent, line = lent_threads(["a", "b", "c"], [here, {**here, "host_id": "elsewhere"}, here])
    assert lent == {"a": max(1, cores // 2), "c": max(1, cores // 2)} and "while training waits" in line  # split between the two here
    assert lent_threads(["a"], [{**here, "device": "cuda"}]) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lent_threads(["a"], [here]) is None


@pytest.mark.quick
def test_the_servers_weight_work_runs_in_a_thread_that_has_ended_when_it_returns():
    # The weight routes stage and commit through in_own_thread: a live thread that once ran a
    # parallel torch op keeps an OpenMP team, and a second team slowed every op of the engine's
    # decode by a third. A pooled thread would still be alive after the call.
    ran = []

    def work(n: int) -> float:
        ran.append(threading.current_thread())
        return torch.ones(n).log1p_().sum().item()  # past torch's grain size: a parallel op

    async def calls():
        value = await in_own_thread(work, 1 << 16)
        with pytest.raises(ZeroDivisionError):
            await in_own_thread(lambda: 1 / 0)
        return value

    assert asyncio.run(calls()) == pytest.approx((1 << 16) * 0.6931471805599453, rel=1e-6)
    ran[0].join(timeout=5)
    assert ran[0] is not threading.main_thread() and not ran[0].is_alive()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread count is 1")
def test_the_servers_engine_calls_run_on_its_threads_or_those_a_sync_run_lends(tiny_model):
    # torch.set_num_threads reaches MKL only in the thread that calls it: a new thread's MKL
    # matmuls took every core, beside a trainer sized to the cores the server said it left.
    # The real engine, with each call's MKL thread count recorded.
    import ctypes

    from tandem.server.serving import RolloutService

    try:
        mkl_threads = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_get_max_threads
    except (OSError, AttributeError):
        pytest.skip("this torch has no MKL")
    seen = []

    class Recording(TransformersEngine):
        def generate(self, *args, **kwargs):
            seen.append(mkl_threads())
            return super().generate(*args, **kwargs)

    def generate(service):
        asyncio.run(service.generate([PROMPT], 1, SamplingParams(max_tokens=2), [1], 0, 0.0))

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as `tandem rollout` does on two cores before its engine loads
    default, fixed = RolloutService(), RolloutService(fixed_threads=True)  # fixed: started with --threads
    try:
        for service in (default, fixed):
            service.set_engine(Recording(AutoModelForCausalLM.from_pretrained(tiny_model), [2], 0), 259, 512)
            generate(service)
            service.claim("run", "here", threads=2)  # a sync run lends its cores
            generate(service)
            assert service.engine.threads == 1  # what /health reports: the server's own, whatever a run lends
            service.claim("run", "here", threads=None)
            generate(service)
    finally:
        default.stop()
        fixed.stop()
        torch.set_num_threads(before)
    assert seen == [1, 2, 1, 1, 1, 1]


@pytest.mark.quick
def test_an_answer_cut_off_midway_is_retried_then_reported_naming_the_server():
    # A fake at the network boundary: a "server" that sends headers and half a chunked body,
    # then closes, as a rollout server killed while answering does.
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    answered = []

    def serve():
        listener.settimeout(10)
        try:
            while True:
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n9\r\n{\"comple")
                conn.close()
                answered.append(1)
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()
    client = RolloutClient([url], server_timeout=1.0)
    try:
        with pytest.raises(RolloutServerError, match=f"rollout server {url} did not answer.*ChunkedEncodingError"):
            client.generate([PROMPT], SamplingParams(max_tokens=3), [7])
    finally:
        client.close()
        listener.close()
    assert len(answered) >= 2  # retried, not raised at the first cut


HEALTH = {"status": "ready", "instance_id": "f" * 32, "version": 3}
INFO = {"dtype": "float32", "vocab_size": 259, "host_id": "elsewhere", "model": "tiny", "engine": "fake"}
GOOD = {"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "finish_reason": "length", "version": 3}


@pytest.mark.quick
@pytest.mark.parametrize("completion, message", [
    ({"version": 2}, "made by version 2, outside \\[3, 4\\]"),
    ({"version": 10**6}, "made by version 1000000, outside \\[3, 4\\]"),
    ({"logprobs": [-0.5, float("nan")]}, "log-probs for 2 tokens are not each finite and <= 0"),
    ({"logprobs": [-0.5, 0.25]}, "log-probs for 2 tokens are not each finite and <= 0"),
    ({"logprobs": [-0.5]}, "whose 1 log-probs for 2 tokens"),
    ({"token_ids": [], "logprobs": []}, "of 0 tokens finished by 'length'"),
    ({"token_ids": [5, 10**6]}, "a token id outside \\[0, 259\\)"),
    ({"token_ids": [5, -1]}, "a token id outside \\[0, 259\\)"),
    ({"finish_reason": "eos"}, "finished by 'eos'"),
    ({"token_ids": None}, "malformed \\(TypeError"),
])  # fmt: skip
def test_a_servers_completions_are_checked_before_anything_trains_on_them(completion, message):
    answers = [GOOD, {**GOOD, **completion}]

    def answer(method, path, body):
        if path == "/generate":
            return 200, json.dumps({"completions": [answers.pop(0)]}).encode()
        return 200, json.dumps(HEALTH if path == "/health" else INFO).encode()

    fake = FakeServer(answer)
    client = RolloutClient([fake.url], server_timeout=5)
    try:
        client.wait_until_ready()
        assert client.generate([PROMPT], SamplingParams(max_tokens=2), [7], min_version=3, max_version=4)[0].token_ids == [5, 6]
        with pytest.raises(RolloutServerError, match=f"rollout server {fake.url} answered a generate request with completion 0 of 1 .*{message}"):
            client.generate([PROMPT], SamplingParams(max_tokens=2), [7], min_version=3, max_version=4)
    finally:
        client.close()
        fake.close()


@pytest.mark.quick
def test_a_replica_that_answers_junk_is_taken_out_of_the_fleet_and_alone_fails_the_call_naming_it(server):
    # A proxy to the real server until its port is "taken by another program", which answers
    # 200 with a page that is not JSON: a replica that is no longer a rollout server.
    junk = threading.Event()
    fake = FakeServer(lambda method, path, body: (200, b"<html>it works</html>") if junk.is_set() else (None, b""), forward=server.url)
    prompts, seeds = [PROMPT] * 6, list(range(6))
    fleet = RolloutClient([server.url, fake.url], api_key=KEY, server_timeout=10, replica_timeout=30)
    alone = RolloutClient([fake.url], api_key=KEY, server_timeout=2)
    try:
        fleet.wait_until_ready()
        fleet.watch(interval=0.2)
        before = fleet.generate(prompts, SamplingParams(max_tokens=4), seeds)
        assert len(fleet.fleet.homes) == 1  # both served one prompt: it lives on the one that served it last
        junk.set()
        after = fleet.generate(prompts, SamplingParams(max_tokens=4), seeds)
        assert [c.token_ids for c in after] == [c.token_ids for c in before]  # the same tokens, from the real server
        assert fleet.fleet.up() == [server.url] and "not a rollout server" in fleet.fleet.down[fake.url].why
        with pytest.raises(RolloutServerError, match=f"rollout server {fake.url} did not answer a health check.*not a JSON object"):
            alone.wait_until_ready()
    finally:
        fleet.close()
        alone.close()
        fake.close()


def shifted_weights(tiny_model, shift: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach() + shift) for n, p in AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()]


def test_a_weight_chunk_whose_connection_broke_is_sent_again_whole(server, tiny_model, monkeypatch):
    # A fault at the network boundary: the first chunk's request streams its whole body, then its
    # connection breaks (a reset, a proxy timeout), as requests reports it. The retry must send
    # the chunk's bytes again; it used to send the declared length and no bytes (a 408 at last).
    session_request, broken = requests.Session.request, []

    def request(self, method, url, **kw):
        if method == "PUT" and url.endswith("/chunk") and not broken:
            broken.append(sum(len(piece) for piece in kw["data"]))  # the bytes go out, no answer comes
            raise requests.ConnectionError("Connection reset by peer")
        return session_request(self, method, url, **kw)

    monkeypatch.setattr(requests.Session, "request", request)
    client = RolloutClient([server.url], api_key=KEY, server_timeout=30, transport="http", weight_bucket_bytes=20_000)
    try:
        version = client.fingerprints()[0]["version"] + 1
        weights = shifted_weights(tiny_model, 1e-3)
        assert client.push_weights(weights, version=version) == [version]
        assert client.fingerprints() == [{"version": version, "fingerprint": fingerprint(weights)}]
    finally:
        client.close()
    assert broken and broken[0] > 0


def test_a_generate_request_that_reaches_a_replaced_process_resyncs_it(server, tiny_model, caplog):
    # The race CI met twice with FSDP: the server restarted, and the rank that pushes sent its
    # next generate request to the new process before anything told it the old one was gone.
    # The state that leaves, without a restart: the client synced a process (here a made-up
    # one) that is not the one answering. The request must be refused and the client resync,
    # where it would otherwise be served (or wait on the version, for a version only it pushes).
    client = RolloutClient([server.url], api_key=KEY, server_timeout=30)
    try:
        client.wait_until_ready()
        version = client.fingerprints()[0]["version"] + 1
        client.push_weights(shifted_weights(tiny_model, 3e-3), version=version)
        client._instances[server.url] = "0" * 32
        with caplog.at_level(logging.WARNING, logger="tandem"):
            out = client.generate([PROMPT], SamplingParams(max_tokens=3), [7], min_version=version, version_timeout=30)
        assert [c.version for c in out] == [version]
        assert client._instances[server.url] == call(server, "GET", "/health").json()["instance_id"]
        assert f"rollout server {server.url} restarted" in caplog.text
    finally:
        client.close()


def test_a_watching_client_resyncs_a_replaced_process_with_no_request_of_its_own(server, tiny_model, caplog):
    # The same race with several training processes (CI again, FSDP): another process's request
    # met the new server and waited there for a version only the pushing process has, which
    # waited on it in a collective and sent the server nothing. The pushing process's client
    # watches the servers itself. The state, as above: it synced a process that is not the one
    # answering. Without the watch nothing ever tells it.
    client = RolloutClient([server.url], api_key=KEY, server_timeout=30)
    try:
        client.wait_until_ready()
        client.push_weights(shifted_weights(tiny_model, 4e-3), version=client.fingerprints()[0]["version"] + 1)
        client._instances[server.url] = "0" * 32
        with caplog.at_level(logging.WARNING, logger="tandem"):
            client.watch(interval=0.05)
            deadline = time.monotonic() + 30
            while "restarted" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert f"rollout server {server.url} restarted" in caplog.text and "pushed weights version" in caplog.text
        assert client._instances[server.url] == call(server, "GET", "/health").json()["instance_id"]
    finally:
        client.close()


def test_a_push_whose_first_request_reaches_a_restarted_server_gives_it_the_weights(tiny_model):
    server = Server(tiny_model)
    client = RolloutClient([server.url], server_timeout=30)
    try:
        client.wait_until_ready()
        client.push_weights(shifted_weights(tiny_model, 1e-3), version=1)
        server.kill()
        server = Server(tiny_model, port=server.port)  # a new process at version 0: it refuses version 2 as not next
        new = shifted_weights(tiny_model, 2e-3)
        assert client.push_weights(new, version=2) == [2]
        assert client.fingerprints() == [{"version": 2, "fingerprint": fingerprint(new)}]
    finally:
        client.close()
        server.stop()


def test_a_push_cut_by_a_restart_that_the_generating_thread_resyncs_completes(tiny_model, monkeypatch):
    # The race CI met in async mode: the trainer's push began on the old process; the generating
    # thread noticed the restart first and resynced; the push's next chunk (an update id only
    # the old process knew) then reached the new one. The restart is injected between the
    # push's begin and its first chunk by wrapping the push's bucketing, once.
    from tandem.rollout import transports

    server = Server(tiny_model)
    client = RolloutClient([server.url], server_timeout=30, transport="http")
    real_buckets, results, injected = transports.buckets, [], []

    def restart_first(named, size, **kw):
        nonlocal server
        if not injected:
            injected.append(1)
            synced = client._instances[server.url]
            server.kill()
            server = Server(tiny_model, port=server.port)
            gen = threading.Thread(target=lambda: results.append(client.generate([PROMPT], SamplingParams(max_tokens=3), [7], min_version=1)))
            gen.start()
            injected.append(gen)
            deadline = time.monotonic() + 30
            while client._instances[server.url] == synced:  # until the generating thread starts its resync
                assert time.monotonic() < deadline, "the generating thread never noticed the restart"
                time.sleep(0.05)
        yield from real_buckets(named, size, **kw)

    try:
        client.wait_until_ready()
        client.push_weights(shifted_weights(tiny_model, 1e-3), version=1)
        monkeypatch.setattr(transports, "buckets", restart_first)
        new = shifted_weights(tiny_model, 2e-3)
        assert client.push_weights(new, version=2) == [2]
        injected[1].join(timeout=60)
        assert client.fingerprints() == [{"version": 2, "fingerprint": fingerprint(new)}]
    finally:
        client.close()
        server.stop()
    assert [c.version for c in results[0]] == [2]  # the generation repeated on the resynced server


def test_the_servers_key_is_read_from_the_environment_or_a_file_and_never_saved_or_printed(tiny_model, tmp_path):
    # The key was written in plain text into config.yaml, into every checkpoint, and printed at start.
    from tandem.demo import addition_rows, write_jsonl

    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    secret = "s3cret-key-7f2a"
    server = Server(tiny_model, env={**os.environ, "TANDEM_API_KEY": secret})  # the server's key from its environment
    (tmp_path / "key.txt").write_text(secret + "\n")
    common = ["--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_funcs", "exact_match", "--num_generations", "4",
              "--per_device_train_batch_size", "8", "--max_completion_length", "4", "--max_steps", "1", "--rollout_mode", "server",
              "--rollout_server_urls", server.url]  # fmt: skip
    try:
        assert call(server, "GET", "/info", key=None).status_code == 401 and call(server, "GET", "/info", key=secret).status_code == 200
        for how, extra in (("option", ["--rollout_api_key", secret]), ("file", ["--rollout_api_key_file", tmp_path / "key.txt"])):
            proc = cli_here("train", *common, *extra, "--output_dir", tmp_path / how, "--disable_tqdm", "true")
            assert proc.returncode == 0, proc.stderr[-3000:]
            saved = [(tmp_path / how / "config.yaml").read_text(), (tmp_path / how / "checkpoint-1" / "config.yaml").read_text()]
            assert all(secret not in text for text in [*saved, proc.stdout, proc.stderr])
            assert ("rollout_api_key: <redacted>" in saved[0]) == (how == "option")
        proc = cli_here("train", *common, "--output_dir", tmp_path / "none", "--disable_tqdm", "true")  # no key: refused by the server, by name
        assert proc.returncode == 1 and "401" in proc.stderr, proc.stderr[-2000:]
    finally:
        server.stop()


def test_a_dead_runs_hold_on_the_server_lapses_and_a_live_ones_is_renewed(tiny_model):
    # A run that crashed without letting go held its server until someone sent DELETE /run: the
    # next run was refused. The hold is now a lease (1 s here) that a live trainer renews.
    server = Server(tiny_model, "--run-lease", "1")
    claim = lambda run: requests.post(server.url + "/run", json={"run_id": run, "name": run}, timeout=10)  # noqa: E731
    try:
        assert claim("crashed").json()["lease_seconds"] == 1.0  # claimed, then never renewed: its trainer died
        refused = claim("next")
        assert refused.status_code == 409 and "lets it go by itself 1s after its last renewal" in refused.text
        time.sleep(1.5)
        assert claim("next").status_code == 200  # the dead run's lease lapsed
        client = RolloutClient([server.url], server_timeout=30)
        requests.delete(server.url + "/run", timeout=10)
        client.claim("live", "a live run")  # its client renews every quarter of the lease
        time.sleep(2.5)
        assert claim("other").status_code == 409
        client.release()
        assert claim("other").status_code == 200
        client.close()
    finally:
        server.stop()


PUSH_UNDER_A_FILE_SIZE_LIMIT = """
import sys
from transformers import AutoModelForCausalLM
from tandem.rollout.client import RolloutClient
from tandem.rollout.weights import fingerprint
url, model, key = sys.argv[1:]
named = list(AutoModelForCausalLM.from_pretrained(model).named_parameters())
shifted = [(n, p.detach() + 0.5) for n, p in named]
client = RolloutClient([url], api_key=key, server_timeout=30)
client.wait_until_ready()
client.push_weights(shifted, version=1, force=True)
assert client.fingerprints()[0] == {"version": 1, "fingerprint": fingerprint(shifted)}, client.fingerprints()
client.push_weights(named, version=0, force=True)  # the module's server as it was
assert client.fingerprints()[0] == {"version": 0, "fingerprint": fingerprint(named)}
print("pushed")
"""


def test_a_push_that_cannot_write_shared_memory_goes_over_http_and_says_so(server, tiny_model):
    # Files capped at 100 kB (RLIMIT_FSIZE, as a checkpoint test caps the trainer's): the push's
    # sealed memfds (563 kB of weights) cannot be written. It was a raw OSError traceback.
    import resource
    import signal
    import subprocess
    import sys

    def capped():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = subprocess.run([sys.executable, "-c", PUSH_UNDER_A_FILE_SIZE_LIMIT, server.url, str(tiny_model), KEY], capture_output=True, text=True,
                          timeout=120, preexec_fn=capped)  # fmt: skip
    assert proc.returncode == 0 and "pushed" in proc.stdout, proc.stderr[-3000:]
    assert "a weight push could not be written to shared memory (OSError: " in proc.stderr and "it goes over HTTP instead" in proc.stderr
