"""Several rollout servers as one fleet: shares by speed, a replica that dies or stops taken out
and its work done by the others, put back when it answers again. Real servers on loopback ports,
real signals (SIGKILL, SIGSTOP and SIGCONT), and a second machine simulated in namespaces of
this host's kernel (machine_b)."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time

import pytest
import requests
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import ENV, FakeServer, Server, command, train, wait_for_step
from tandem.demo import addition_rows, write_jsonl
from tandem.rollout.client import RolloutClient, RolloutServerError
from tandem.rollout.fleet import EvenSplit, Fleet, Timed
from tandem.rollout.types import SamplingParams
from tandem.rollout.weights import fingerprint, host_id
from test_async import DIGITS, base_args, read

# What depends on timing, or on the behaviour log-probs (which the loss does not read here): the
# batch a completion shared rounds their last bits.
NOT_RESULTS = ("time/", "timestamp", "completion_tokens_per_second", "memory/", "servers/", "engine/", "weights/", "is_log_ratio/", "kl_behav")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # three servers and a trainer on this machine's cores


@pytest.mark.quick
def test_speed_shares_follow_each_replicas_step_time_and_a_replica_left_out_is_tried_again():
    urls = ["a", "b", "c"]
    assert Timed().shares(10, urls) == [3, 3, 4] and EvenSplit().shares(10, urls) == [3, 4, 3]  # none measured: even
    # Compute-bound: a step costs 1 ms a row on a and b, 2 ms on c (half speed). Measured at two
    # row counts each, the fit finds a = 0 and b; rows go 2:2:1 (40 rows: 16, 16, 8; each step 16 ms).
    compute = Timed()
    for url, b in zip(urls, (1e-3, 1e-3, 2e-3)):
        for rows in (10, 14):
            compute.observe(url, rows, 100, 100 * b * rows)  # 100 steps of `rows` rows
    assert compute.shares(40, urls) == [16, 16, 8]
    # Memory-bound: a step costs 10 ms + 0.1 ms a row on a and b, twice that on c. c's step alone
    # (20.2 ms) is slower than a's or b's with every row (10 + 0.1 * 20 = 12 ms): c gets none.
    memory = Timed()
    for url, scale in zip(urls, (1, 1, 2)):
        for rows in (10, 14):
            memory.observe(url, rows, 50, 50 * scale * (10e-3 + 0.1e-3 * rows))
    assert memory.shares(40, urls) == [20, 20, 0]
    a, b = memory.fit("c")
    assert abs(a - 20e-3) < 1e-9 and abs(b - 0.2e-3) < 1e-9
    # Left out 4 calls (this one and 3 more), c's fit is forgotten and it is tried as the mean of
    # the others (all three alike: 40 rows in 13, 13, 14); then it waits 8 calls, and so on.
    assert [memory.shares(40, urls)[2] for _ in range(3)] == [0, 0, 0] and memory.fit("c") is None
    assert memory.shares(40, urls) == [13, 13, 14] and memory.wait["c"] == 8


@pytest.mark.quick
def test_every_row_of_a_call_has_a_replica_even_where_steps_are_flat_in_their_rows():
    # a's steps take the same time at 4 rows as at 8 (its slope clamped to 1e-12), b is not
    # measured yet and counts as a: the bisection's rounding gave a one-row call to neither (in
    # 103 of 200 draws of the step time), and the client planned it again and again.
    for seed in range(200):
        step = 0.001 + seed * 0.0005
        timed = Timed()
        for rows in (4, 8, 4, 8):
            timed.observe("a", rows, 10, 10 * step)
        fleet = Fleet(["a", "b"], timed)
        for n in (1, 2, 3):
            plan = fleet.plan([[1, 2]] * n, list(range(n)))
            assert sorted(i for _, part in plan for i in part) == list(range(n)), (seed, n, plan)


@pytest.mark.quick
def test_a_sequence_goes_back_to_the_replica_that_served_its_prefix_within_its_share():
    fleet = Fleet(["a", "b"], EvenSplit())
    prompts = [[1, i, 2] for i in range(4)]
    first = dict(fleet.plan(prompts, [0, 1, 2, 3]))  # a: 0, 1; b: 2, 3
    assert first == {"a": [0, 1], "b": [2, 3]}
    for url, part in first.items():
        fleet.served(url, [prompts[i] for i in part], 10, 1.0)
    # The next turn: 0 and 2 finished; 1 and 3 continue from their prefixes, in the other order.
    later = [prompts[3] + [7, 8], prompts[1] + [5]]
    assert dict(fleet.plan(later, [0, 1])) == {"a": [1], "b": [0]}
    fleet.mark_down("a", "test")
    assert fleet.plan(later, [0, 1]) == [("b", [0, 1])] and fleet.events["down"] == 1
    fleet.mark_up("a")
    assert fleet.events["readded"] == 1 and fleet.wait_for_one(0) is None


@pytest.mark.parametrize("procs", [1, 2])
def test_a_fleet_that_loses_one_replica_and_has_one_stopped_trains_as_an_undisturbed_one(tiny_model, tmp_path, procs):
    """Three replicas; past step 2 one is killed and one stopped (SIGSTOP); once every training
    process took both out, the stopped one resumes (SIGCONT). The run finishes with the same
    completions, metrics and weights as a run whose fleet stayed whole, and its metrics count
    each event. With 2 processes each takes servers out on its own, and only the first pushes."""
    (tmp_path / "digits.py").write_text(DIGITS)
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    servers = [Server(tiny_model, env=ONE_THREAD) for _ in range(3)]
    try:
        # off_policy_correction none: the behaviour log-probs, which round their last bits by
        # the batch a completion shares, do not enter the loss (docs/async.md)
        extra = ["--max_steps", "12", "--save_steps", "12", "--max_completion_length", "48", "--async_generate", "true", "--rollout_mode", "server",
                 "--off_policy_correction", "none", "--rollout_replica_timeout", "3", "--rollout_server_urls", *[s.url for s in servers]]  # fmt: skip
        train(procs, base_args(tiny_model, data, tmp_path / "whole", 32 // procs, *extra))
        out = tmp_path / "disturbed"
        log = tmp_path / "stderr.txt"
        with log.open("w") as stderr:
            trainer = subprocess.Popen(command(procs, base_args(tiny_model, data, out, 32 // procs, *extra)), stderr=stderr, env=ENV)
        try:
            wait_for_step(out, 2, trainer)
            servers[1].kill()
            os.kill(servers[2].proc.pid, signal.SIGSTOP)
            # each process takes both out within a probe interval and rollout_replica_timeout
            wait_for(lambda: log.read_text().count("taken out of the fleet") == 2 * procs, trainer)
            os.kill(servers[2].proc.pid, signal.SIGCONT)
            trainer.wait(timeout=240)
        finally:
            trainer.kill()
        assert trainer.returncode == 0, log.read_text()[-3000:]
    finally:
        os.kill(servers[2].proc.pid, signal.SIGCONT)
        for s in servers:
            s.stop()
    (whole, whole_completions), (disturbed, disturbed_completions) = read(tmp_path / "whole"), read(out)
    assert [c["completion"] for c in disturbed_completions] == [c["completion"] for c in whole_completions]
    results = [{k: v for k, v in m.items() if not k.startswith(NOT_RESULTS)} for m in disturbed]
    diffs = [(m["step"], k, v, r.get(k)) for m, r in zip(whole, results) for k, v in m.items() if k in r and v != r[k]]
    assert not diffs and len(results) == len(whole) == 12
    a, b = load_file(tmp_path / "whole/checkpoint-12/model.safetensors"), load_file(out / "checkpoint-12/model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)
    assert whole[-1]["servers/down"] == 0 and whole[-1]["servers/up"] == 3
    # The run may end before a probe finds the stopped one answering again, and the stop may fall
    # between two calls (nothing in flight to generate again): both are tested below, by the client.
    last = disturbed[-1]
    assert last["servers/down"] == 2 and last["servers/up"] == 1 + last["servers/readded"], last


MACHINE_B = "10.213.0.2"  # machine_b's address, at the end of a veth pair whose other end here is 10.213.0.1


@pytest.fixture
def machine_b():
    """Another machine, simulated on this host: a network namespace with its own address, reached
    over a veth pair, and for each command started there (the prefix this yields) its own
    hostname, process tree and /proc, so that no memory of this host's processes can be opened
    from it (the shared-memory transport opens the trainer's files through /proc). Needs root,
    iproute2 and util-linux's unshare; skipped without them."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("simulating a second machine needs root, iproute2 and util-linux's unshare")
    name, veth = f"tandem-b{os.getpid()}", f"tdb{os.getpid() % 100000}"
    inside = ["ip", "netns", "exec", name]
    steps = [["ip", "netns", "add", name], ["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p"],
             ["ip", "link", "set", veth + "p", "netns", name], ["ip", "addr", "add", "10.213.0.1/24", "dev", veth], ["ip", "link", "set", veth, "up"],
             [*inside, "ip", "addr", "add", f"{MACHINE_B}/24", "dev", veth + "p"], [*inside, "ip", "link", "set", veth + "p", "up"],
             [*inside, "ip", "link", "set", "lo", "up"]]  # fmt: skip
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"no network namespace here ({' '.join(exc.cmd)}: {exc.stderr.strip()})")
    try:
        yield (*inside, "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", 'hostname machine-b && exec "$0" "$@"')
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # the veth pair goes with it


def test_a_fleet_on_two_machines_pushes_to_the_other_over_http_and_trains_as_one_server(tiny_model, tmp_path, machine_b, monkeypatch):
    """One replica on the trainer's machine and one on another (machine_b), which binds a
    reachable address and so needs the key that both replicas and the trainer read from
    TANDEM_API_KEY. The run trains as a run against the first replica alone does, bit for bit;
    the other machine's replica served sequences and holds the last version, which can have
    reached it only over HTTP (a push by shared memory fails there: it cannot open the trainer's
    files)."""
    key = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_API_KEY", key)  # the trainer's (cli_here runs it in this process)
    env = {**ONE_THREAD, "TANDEM_API_KEY": key}
    (tmp_path / "digits.py").write_text(DIGITS)
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    here = Server(tiny_model, env=env)
    there = Server(tiny_model, env=env, host=MACHINE_B, prefix=machine_b)
    try:
        extra = ["--max_steps", "4", "--save_steps", "4", "--max_completion_length", "48", "--rollout_mode", "server",
                 "--off_policy_correction", "none", "--rollout_server_urls"]  # fmt: skip
        train(1, base_args(tiny_model, data, tmp_path / "alone", 32, *extra, here.url))
        train(1, base_args(tiny_model, data, tmp_path / "fleet", 32, *extra, here.url, there.url))
        info = requests.get(there.url + "/info", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    finally:
        here.stop()
        there.kill()  # its unshare, whose child, the server, dies with it (--kill-child)
        there.stop()
    assert info["host_id"] != host_id() and info["version"] == 4 and info["stats"]["sequences"] > 0, info
    (alone, alone_completions), (fleet, fleet_completions) = read(tmp_path / "alone"), read(tmp_path / "fleet")
    assert [c["completion"] for c in fleet_completions] == [c["completion"] for c in alone_completions]
    strip = [{k: v for k, v in m.items() if not k.startswith(NOT_RESULTS)} for m in (*alone, *fleet)]
    assert strip[:4] == strip[4:] and len(strip) == 8
    a, b = load_file(tmp_path / "alone/checkpoint-4/model.safetensors"), load_file(tmp_path / "fleet/checkpoint-4/model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)
    assert fleet[-1]["servers/up"] == 2 and fleet[-1]["servers/down"] == 0


def wait_for(condition, proc: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended, or the condition took too long"
        time.sleep(0.1)


def test_a_replica_that_stops_mid_call_is_worked_around_skipped_by_pushes_and_put_back_with_the_last_weights(tiny_model):
    """The client alone, against three real servers: a call during which one replica dies and one
    stops returns the completions of an undisturbed call; a push while they are out goes to the
    one left; the stopped one, resumed, is put back holding that push's weights and serves."""
    weights = list(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    servers = [Server(tiny_model, env=ONE_THREAD) for _ in range(3)]
    client = RolloutClient([s.url for s in servers], server_timeout=60, replica_timeout=2)
    try:
        client.wait_until_ready()
        client.claim("fleet-test", "test")  # the client that pushes: it puts a replica back with the last weights
        client.watch(interval=0.2)
        client.push_weights(weights, 1)
        prompts, seeds, params = [[1, 5 + i % 20, 7, 9] for i in range(48)], list(range(100, 148)), SamplingParams(max_tokens=400)
        whole = client.generate(prompts, params, seeds, min_version=1)
        plan = dict(client.fleet.plan(prompts, list(range(48))))
        assert all(plan.get(s.url) for s in servers), plan  # each replica has a part of the next call
        threading.Timer(0.2, lambda: (servers[1].kill(), os.kill(servers[2].proc.pid, signal.SIGSTOP))).start()
        disturbed = client.generate(prompts, params, seeds, min_version=1)
        assert [c.token_ids for c in disturbed] == [c.token_ids for c in whole]
        assert client.fleet.up() == [servers[0].url] and client.fleet.events["reissued"] > 0
        client.push_weights([(n, t + 1) for n, t in weights], 2)  # skips the two taken out
        os.kill(servers[2].proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while servers[2].url not in client.fleet.up():
            assert time.monotonic() < deadline, "the resumed replica was not put back"
            time.sleep(0.1)
        assert client.fingerprints([servers[0].url]) == client.fingerprints([servers[2].url])
        assert {c.version for c in client.generate(prompts, params, seeds, min_version=2)} == {2}
        assert client.fleet.events["down"] == 2 and client.fleet.events["readded"] == 1
    finally:
        client.close()
        os.kill(servers[2].proc.pid, signal.SIGCONT)
        for s in servers:
            s.stop()


def test_a_replica_killed_mid_push_and_restarted_with_another_dtype_gets_the_newest_weights_and_no_stale_update(tiny_model, caplog):
    """A replica killed in the middle of the push of version 2 (a proxy in front of it drops every
    connection from its first request of that push) and restarted on its port at once, holding
    bf16 weights where the first process held fp32, with delta updates on. It is put back once it
    holds version 2, read from it; later pushes reach it whole in bf16 (its dtype read again),
    with no delta refused; an update of an older push, left running, is dropped."""
    weights = list(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    b, first = Server(tiny_model, env=ONE_THREAD), Server(tiny_model, env=ONE_THREAD)
    killed, begun = threading.Event(), []

    def answer(method, path, body):
        if path == "/weights/begin":
            begun.append(json.loads(body)["version"])
            if begun.count(2) == 1 and begun[-1] == 2:  # the first process dies here
                killed.set()
        return ("drop", b"") if killed.is_set() else (None, b"")

    proxy = FakeServer(answer, forward=first.url)
    client = RolloutClient([b.url, proxy.url], server_timeout=60, replica_timeout=2, delta=True)
    restarted = None
    try:
        client.wait_until_ready()
        client.claim("fleet-test", "test")
        client.watch(interval=0.2)
        client.push_weights(weights, 1)
        client.push_weights([(n, t + 1) for n, t in weights], 2)  # the replica dies mid-push: taken out, the push goes on without it
        assert killed.is_set() and client.fleet.up() == [b.url]
        restarted = Server(tiny_model, "--dtype", "bfloat16", env=ONE_THREAD)
        proxy.forward = restarted.url
        killed.clear()
        deadline = time.monotonic() + 30
        while proxy.url not in client.fleet.up():
            assert time.monotonic() < deadline, "the restarted replica was not put back"
            time.sleep(0.1)
        assert client.fingerprint(proxy.url)["version"] == 2 and begun[-1] == 2
        caplog.clear()
        for version in (3, 4):
            client.push_weights([(n, t + version) for n, t in weights], version)
        pushed = [(n, t + 4) for n, t in weights]
        assert client.fingerprints() == [{"version": 4, "fingerprint": fingerprint(pushed)},
                                         {"version": 4, "fingerprint": fingerprint([(n, t.bfloat16()) for n, t in pushed])}]  # fmt: skip
        assert "refused a delta update" not in caplog.text and caplog.text.count("pushes send whole weights") == 1, caplog.text
        # an update of push 3 that was left running (its replica taken out) and comes back now: dropped
        stale = client._last_pushed.seq - 1
        assert client._push_one(proxy.url, [(n, t + 3) for n, t in weights], 3, True, False, seq=stale) is None
        assert client.fingerprint(proxy.url)["version"] == 4
    finally:
        client.close()
        proxy.close()
        for server in (b, first, restarted):
            if server is not None:
                server.stop()


def test_a_fleet_with_no_replica_left_stops_the_call_naming_each_and_why(tiny_model):
    servers = [Server(tiny_model, env=ONE_THREAD) for _ in range(2)]
    client = RolloutClient([s.url for s in servers], server_timeout=3)
    try:
        client.wait_until_ready()
        client.watch(interval=0.2)
        for s in servers:
            s.kill()
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match="no rollout server is left") as failed:
            client.generate([[1, 5, 7]], SamplingParams(max_tokens=4), [0])
        assert time.monotonic() - start < 3 + 10  # rollout_server_timeout, and the request that met the first refusal
        assert all(f"{s.url} down for" in str(failed.value) for s in servers) and "refused connections" in str(failed.value)
    finally:
        client.close()
        for s in servers:
            s.stop()
