import contextlib
import faulthandler
import importlib.util
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import requests
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:
    # `pytest -n N`: N test processes share the cores already, so each test, and every process it
    # starts (`tandem` commands, the docs' scripts), computes on one thread. Two processes of two
    # threads on two cores ran the demo six times slower than one alone.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The files whose tests take longest, longest first (their seconds in the base suite with -n 2,
# 2026-12-04): `--dist loadfile` hands each worker a file at a time in collection order
# (pyproject turns off xdist's own order, by number of tests, which handed out the tool demo's
# one long test last: the other worker sat idle for minutes). Other files follow these.
LONGEST_FIRST = [
    "test_docs.py",  # 275 s
    "test_tool_demo.py",  # 270 (151 before the agent demo)
    "test_async.py",  # 192
    "test_fsdp.py",  # 172
    "test_resume.py",  # 132
    "test_lora.py",  # 87
    "test_fleet.py",  # 100: three servers, two training runs of 1 and of 2 processes
    "test_api.py",  # 70 (2026-12-07): a TRL script under python and accelerate launch, the same run by the CLI, a callback's stop and resume
    "test_multiturn.py",  # 53
    "test_server.py",  # 33
    "test_rewards.py",  # 24
    "test_golden.py",  # 23
    "test_dynamic_sample.py",  # 21
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays


def run_cli(*args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """The real `tandem` command in a separate process: for what only a process shows (its exit
    code, its output streams, signals, what it leaves running)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def cli_here(*args, timeout=300, one_thread=True) -> subprocess.CompletedProcess:
    """The real `tandem` command, `tandem.cli.main(argv)`, in this process: for tests of what a run
    does (trains, logs, saves, refuses), where a separate process adds only its 4-5 s of imports.
    It runs as `train()` runs a process, with one torch thread (OMP_NUM_THREADS=1), or with
    torch's default of one per core (one_thread=False: a run long enough to gain from them). It
    returns what run_cli returns: main's exit code, or 1 and the traceback for an exception it
    lets out. A run past `timeout` ends the whole test session with every thread's traceback: a
    hang here must not hang CI."""
    from tandem.cli import main

    before, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    if one_thread:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    out, err = io.StringIO(), io.StringIO()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse: --help, a usage error
                code = exc.code if isinstance(exc.code, int) else 2
            except Exception:  # what the process would print before exiting with 1
                traceback.print_exc()
                code = 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(before)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    return subprocess.CompletedProcess(["tandem", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model written by `tandem init-model`."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    proc = run_cli("init-model", out, "--size", "tiny")
    assert proc.returncode == 0, proc.stderr
    return out


HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# Marks a test that needs vLLM: skipped where it is not installed (./setup.sh --vllm installs it).
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (./setup.sh --vllm)")]
# The tests' vLLM server: eager, without torch.compile and its warm-up, to start in seconds.
VLLM_SERVER = ("--engine", "vllm", "--enforce-eager")


@pytest.fixture(scope="session")
def model64(tmp_path_factory) -> Path:
    """The tiny model with one attention head of 64 (vLLM's CPU attention needs head_dim >= 64)."""
    out = tmp_path_factory.mktemp("model") / "tiny64"
    proc = run_cli("init-model", out, "--size", "tiny", "--head-dim", "64")
    assert proc.returncode == 0, proc.stderr
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tandem rollout` in its own process."""

    def __init__(self, model, *extra, port: int | None = None, env: dict | None = None, host: str = "127.0.0.1", prefix: tuple = ()):
        """`host`: the address it binds and is reached at; `prefix`: a command it runs under
        (machine_b's, another machine's namespaces)."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody reads (a full pipe blocks)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tandem.cli", "rollout", "--model", str(model), "--host", host, "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + (300 if "vllm" in extra else 60)  # vLLM starts in 20-60 s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            try:
                if requests.get(self.url + "/health", timeout=1).json()["status"] == "ready":
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or too busy starting to answer within 1 s
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("server did not become ready")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a server under a prefix whose command does not pass SIGTERM on (machine_b's unshare)
                self.kill()
        self.log.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class FakeServer:
    """A fake at the network boundary: an HTTP server on a loopback port that answers as `answer`
    says, `answer(method, path, body) -> (status, bytes)`: as the real server at `forward` does
    where the status is None, and closes the connection unanswered (as a killed process) where it
    is "drop"."""

    def __init__(self, answer, forward: str | None = None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, method):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, data = fake.answer(method, self.path, body)
                if status == "drop":
                    self.close_connection = True
                    return
                if status is None:  # as the real server answers
                    headers = {k: v for k, v in self.headers.items() if k in ("Authorization", "Content-Type")}
                    r = requests.request(method, fake.forward + self.path, data=body, headers=headers, timeout=60)
                    status, data = r.status_code, r.content
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply("GET")

            def do_POST(self):
                self._reply("POST")

            def do_PUT(self):
                self._reply("PUT")

            def do_DELETE(self):
                self._reply("DELETE")

        self.answer, self.forward = answer, forward
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def hand_over(server: "Server", model_dir, api_key: str | None = None) -> "Server":
    """A rollout server that tests share, handed to the next one as a new process would be: held by
    no run, the model's own weights live at version 0 (pushed back, forced, if an earlier test
    moved them), and its fingerprint and version checked."""
    from tandem.rollout.client import RolloutClient
    from tandem.rollout.weights import fingerprint
    from transformers import AutoModelForCausalLM

    weights = list(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    fresh = {"version": 0, "fingerprint": fingerprint(weights)}
    client = RolloutClient([server.url], api_key=api_key, server_timeout=60)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    assert requests.delete(server.url + "/run", headers=headers, timeout=30).status_code == 200  # held by no run (one killed mid-test holds it)
    try:
        if client.fingerprints()[0] != fresh:  # adapters pushed leave keys of their own too
            client.push_weights(weights, version=0, force=True)
        assert client.fingerprints()[0] == fresh, "the shared server does not hold the model's weights at version 0"
    finally:
        client.close()
    return server


class Shared:
    """One `tandem rollout` that tests take in turn, where each start costs 3 s (20-45 s with
    vLLM). `handed_over()` gives it as a new process would be (see hand_over). A test may kill
    it, or put a new process of the same options in its place (`shared.server = ...`): a server
    found dead at hand-over is started again on its port."""

    def __init__(self, model, *options):
        self.model, self.options = model, options
        self.api_key = options[options.index("--api-key") + 1] if "--api-key" in options else None
        self.server = Server(model, *options)

    def handed_over(self, fresh: bool = False) -> "Server":
        """The server as a new process would be; a new process indeed with `fresh` (vLLM merges
        adapters only into the weights it started with, not into any pushed since)."""
        if fresh:
            self.server.kill()
        if self.server.proc.poll() is not None:
            self.server.stop()
            self.server = Server(self.model, *self.options, port=self.server.port)
        return hand_over(self.server, self.model, self.api_key)

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="session")
def shared_server(tiny_model):
    """The tiny model's server, default options, for every test that does not kill its own."""
    shared = Shared(tiny_model)
    yield shared
    shared.stop()


@pytest.fixture
def server(shared_server) -> "Server":
    return shared_server.handed_over()


# The options of the engine suite's servers (test_server, test_engines): limits small enough to test.
KEY = "test-key"
LIMITS = ("--api-key", KEY, "--max-request-bytes", "200000", "--max-batch-tokens", "4096")


@pytest.fixture(scope="session")
def shared_vllm(model64):
    """The vLLM suite's server (model64, LIMITS): started once for the engine conformance suite,
    the training tests and their kills."""
    shared = Shared(model64, *LIMITS, *VLLM_SERVER)
    yield shared
    shared.stop()


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, limit: float = 180) -> None:
    """Until metrics.jsonl in `out` has `step` lines; fails if the run ends first."""
    deadline = time.monotonic() + limit
    path = out / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= step):
        assert proc.poll() is None, "the run ended before the step"
        assert time.monotonic() < deadline, f"no step {step} within {limit}s"
        time.sleep(0.05)


def killed_past_step(args: list, out: Path, step: int, procs: int = 1) -> Path:
    """`tandem train args` (writing to `out`) SIGKILLed, with its whole process group (torchrun and
    its workers), once it logged `step`; returns its latest checkpoint."""
    trainer = subprocess.Popen(command(procs, args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    try:
        wait_for_step(out, step, trainer)
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
    return out / (out / "latest").read_text().strip()


def kill_server_mid_run(server: "Server", trainer: subprocess.Popen, out: Path, step: int, timeout: float) -> tuple[str, float]:
    """SIGKILL the server once the run logged `step`; returns the trainer's stderr and the
    seconds from the kill to the trainer's exit."""
    try:
        wait_for_step(out, step, trainer)
        server.kill()
        killed = time.monotonic()
        _, stderr = trainer.communicate(timeout=timeout)
        return stderr, time.monotonic() - killed
    finally:
        if trainer.poll() is None:
            trainer.kill()
        server.stop()


def restart_server_mid_run(server: "Server", model, trainer: subprocess.Popen, out: Path, step: int) -> tuple[str, "Server"]:
    """SIGKILL the server once the run logged `step` and start a new process on its port (version
    0, the original weights); returns the trainer's stderr once it ends, and the new server."""
    wait_for_step(out, step, trainer)
    server.kill()
    time.sleep(2)
    server = Server(model, port=server.port)
    try:
        return trainer.communicate(timeout=240)[1], server
    except BaseException:
        trainer.kill()
        server.stop()
        raise


# A training run under a launcher: torchrun (or accelerate launch) for several processes.
def command(procs: int, args: list, launcher: str = "torchrun") -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "tandem.cli", "train", *map(str, args)]
    if launcher == "accelerate":
        # accelerate's --multi_gpu launcher is torchrun; on a machine without GPUs tandem runs gloo on CPU
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(free_port())]
    return [*launch, "-m", "tandem.cli", "train", *map(str, args)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def train(procs, args, timeout=300, launcher="torchrun", separate=False, trace: Path | None = None):
    """A run that must succeed: one process in this one (cli_here) unless `separate`, several
    under the launcher. A one-process fsdp run is separate: it makes a process group of one,
    which would outlive it in this process. `trace`: a folder where each rank records the
    collectives it enters (TANDEM_TRACE_COLLECTIVES)."""
    if procs == 1 and not separate:
        proc = cli_here("train", *args, timeout=timeout)
    else:
        env = {**ENV, "PYTHONFAULTHANDLER": "1"} if trace is None else {**ENV, "PYTHONFAULTHANDLER": "1", "TANDEM_TRACE_COLLECTIVES": str(trace)}
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
        proc = _run_or_dump(command(procs, args, launcher), env, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _run_or_dump(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """The command's run; past `timeout`, every process of it is sent SIGABRT, on which
    faulthandler (PYTHONFAULTHANDLER) prints each thread's stack: a hang fails with where each
    rank was waiting, not with a bare timeout."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in psutil.Process(proc.pid).children(recursive=True) or [psutil.Process(proc.pid)]:  # the ranks, or the one process
            p.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))} ... ran past {timeout}s; the stacks of its processes:\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def versions_within(completion: dict, k: int) -> bool:
    """Whether every model token of a completions.jsonl row of round r is of a version in
    [r - k, r - 1] (round 0: 0): the staleness bound of partial rollouts with max_staleness k."""
    r = completion["round"]
    return all(max(0, r - k) <= v <= max(0, r - 1) for v, _ in completion["token_versions"])


def same_collectives(trace: Path, procs: int = 2) -> list[str]:
    """The collectives rank 0 entered, checked to be exactly those of every other rank, in order:
    a rank that calls one the others do not waits in it until ddp_timeout."""
    sequences = [(trace / f"rank{r}.txt").read_text().splitlines() for r in range(procs)]
    for r, seq in enumerate(sequences[1:], start=1):
        first = next((i for i, (a, b) in enumerate(zip(sequences[0], seq)) if a != b), min(len(seq), len(sequences[0])))
        assert seq == sequences[0], f"rank {r} differs from rank 0 at collective {first}: {seq[first:first + 3]} against {sequences[0][first:first + 3]}"
    return sequences[0]
