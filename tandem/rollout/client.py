"""The trainer's side of the rollout server: timeouts, retries with backoff, health, several
servers as one fleet (requests shared by their speed, weights pushed to all, a replica that fails
taken out and its work done elsewhere), and an Engine that runs remotely."""

import logging
import math
import threading
import time
from concurrent.futures import Future, wait
from typing import Callable, Iterable, NamedTuple

import requests
import torch

from tandem.aio import in_thread
from tandem.rollout.fleet import BALANCES, Fleet
from tandem.rollout.types import FINISH_REASONS, Completion, SamplingParams
from tandem.rollout.transports import TRANSPORTS, Push
from tandem.rollout.weights import StagedWeights, buckets, compress_delta, cuda_device_id, fingerprint, fingerprint_as, host_id, shm_available, xor_bits

log = logging.getLogger("tandem")
RETRY_STATUS = {502, 503, 504}  # the server is (re)starting or overloaded: try again
WATCH_SECONDS = 2.0  # how often watch() checks each server's process


class RolloutServerError(RuntimeError):
    """A rollout server could not serve a request; the message names it and what was tried.
    `unreachable`: it did not answer at all (down, or not there), rather than refusing; `status`:
    the HTTP status of a refusal."""

    def __init__(self, message: str, unreachable: bool = False, status: int | None = None):
        super().__init__(message)
        self.unreachable, self.status = unreachable, status


class _NotAServer(Exception):
    """An answer that is no rollout server's: a body that is not a JSON object."""


class _Restarted(Exception):
    """The server answers again, but it is a new process: it lost the weights it was given."""

    def __init__(self, url: str, down_seconds: float):
        super().__init__(url)
        self.url, self.down_seconds = url, down_seconds


class RolloutClient:
    """Talks to one or more rollout servers.

    Connection errors and 502/503/504 answers are retried with exponential backoff (0.1 s doubling
    to 5 s) until `server_timeout` seconds have passed for that call; every other 4xx/5xx fails at
    once with the server's message, unless the server turns out to be a new process (below).
    Every HTTP request has a connect and a read timeout.

    With `delta`, a push sends a server that holds the previous version only what changed
    (weights.xor_bits in the server's dtype, compressed), checked against the fingerprint of the
    whole before it goes live; a server at another version, or one that refuses the delta, gets
    the whole weights. Adapters and StagedWeights always go whole.

    A server that comes back as a new process (a restart: its instance id changed) has lost its
    weights. The client pushes it the last weights it pushed (it keeps a CPU copy of them), with
    their version, then repeats the call; a generation in flight at the time is regenerated
    from the same seeds with the same version, so the run goes on as if nothing happened.

    Several servers are one fleet (tandem.rollout.fleet): each call's prompts are shared among
    the replicas up by `balance` ("speed": by their measured speed; "even"), a sequence whose
    prefix a replica served goes back to it where its share allows. watch() probes each one; a
    replica that refuses connections, or leaves a health check unanswered for `replica_timeout`
    seconds, is taken out: its part of a call is generated again by the others (same seeds, same
    tokens) and pushes skip it. Once it answers again it gets the last weights whole (by the
    client that pushes; the others wait until it holds the version they need) and is put back.
    With no replica left, a call waits `server_timeout` for one, then fails naming each.
    """

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 600.0,
        server_timeout: float = 240.0,
        weight_bucket_bytes: int = 512 * 2**20,
        transport: str = "auto",
        delta: bool = False,
        balance: str = "speed",
        replica_timeout: float = 30.0,
    ):
        if not urls:
            raise ValueError("rollout_server_urls is empty; give the URL of at least one `tandem rollout` server")
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"weight transport must be auto or one of {sorted(TRANSPORTS)}, got {transport!r}")
        if balance not in BALANCES:
            raise ValueError(f"rollout_balance must be one of {sorted(BALANCES)}, got {balance!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = (connect_timeout, request_timeout)
        self.server_timeout = server_timeout
        self.bucket_bytes = weight_bucket_bytes
        self.transport = transport
        self.delta = delta
        self.fleet = Fleet(self.urls, BALANCES[balance]())
        self.replica_timeout = replica_timeout
        self._need_version = 0  # the newest min_version asked for: a replica put back must hold it
        self._fleet_lock = threading.Lock()  # a push's replicas and a put-back replica's resync: one sees the other
        self._watching = False
        self._dtypes: dict[str, str] = {}  # url -> the dtype its engine holds weights in (/info)
        self._vocab: dict[str, int] = {}  # url -> its model's vocabulary size (/info): the token ids it may answer
        self._mixed_said: list[str] | None = None  # the servers' several dtypes, once said
        self._sent: list[int] = []  # bytes each request of the last push_weights sent (push_bytes)
        self._local = threading.local()  # one requests.Session per thread: Session is not thread-safe
        self._places: dict[str, tuple[bool, str | None]] = {}  # url -> (on this host, its GPU's id) from /info
        self._instances: dict[str, str] = {}  # url -> instance id of the server process we synced
        self._last_pushed: _Pushed | None = None  # the newest push: what a restarted or returning replica gets
        self._pushes = 0  # push_weights calls so far: an update of an older one is stale
        self._fingerprints: dict[tuple[int, str | None], str] = {}  # (push, dtype) -> its weights' fingerprint in that dtype
        self._resync_lock = threading.Lock()
        self._push_locks = {url: threading.Lock() for url in self.urls}
        self._committed: dict[str, tuple[str, int]] = {}  # url -> (instance id, version) of its last commit
        # Called with a restarted server's url before it gets the last weights again: a new process
        # is checked like a new server (a LoRA run's base weights, for one).
        self.check_new_process: Callable[[str], None] | None = None
        self.run: dict | None = None  # the run this client pushes for (claim): its id goes with every update
        self._lent: dict[str, int] = {}  # url -> CPU threads the run lends that server (claim)
        self._run_lock = threading.Lock()  # a renewal of the claim never lands after its release
        self._closed = threading.Event()  # ends watch()'s and the claim's renewal threads
        self._threads: list[threading.Thread] = []  # those threads, joined by close()

    # ------------------------------------------------------------------ plumbing

    @property
    def session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _call(self, method: str, url: str, path: str, what: str, instance: str | None = None, **kw) -> dict:
        """One request, retried. `instance` is the server process the request is meant for (by
        default the one synced when the call starts): a refusal or a retry finds out whether
        that process was replaced, and a replaced one raises _Restarted."""
        headers = {**self.headers, **kw.pop("headers", {})}
        start = time.monotonic()
        deadline = start + self.server_timeout
        instance = instance or self._instances.get(url)
        delay, attempts, last = 0.1, 0, ""
        while True:
            attempts += 1
            if attempts > 1:
                self._check_restart(url, instance, time.monotonic() - start)
            try:
                r = self.session.request(method, url + path, headers=headers, timeout=self.timeout, **kw)
                if r.status_code < 400:
                    if (body := _json_object(r)) is not None:
                        return body
                    # Another program on its port (a dead replica's port taken), or a proxy's page:
                    # retried as a server that does not answer, which takes it out of a fleet.
                    raise _NotAServer(f"HTTP {r.status_code} with a body that is not a JSON object ({r.text[:80]!r}): not a rollout server")
                message = _error_text(r)
                if r.status_code not in RETRY_STATUS:
                    # A new process refuses what the old one had (an update id, the next version).
                    self._check_restart(url, instance, time.monotonic() - start)
                    raise RolloutServerError(f"rollout server {url} refused {what} ({method} {path}): HTTP {r.status_code}: {message}", status=r.status_code)
                last = f"HTTP {r.status_code}: {message}"
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError, _NotAServer) as exc:
                # ChunkedEncodingError: the answer was cut off (the server died while sending it)
                last = str(exc) if isinstance(exc, _NotAServer) else f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise RolloutServerError(
                    f"rollout server {url} did not answer {what} ({method} {path}) within rollout_server_timeout="
                    f"{self.server_timeout}s after {attempts} attempts; last error: {last}. Is `tandem rollout` running there?",
                    unreachable=True,
                )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _check_restart(self, url: str, instance: str | None, down_seconds: float) -> bool:
        """After a failed attempt: raise _Restarted if the server now answers as another process than
        `instance`. Whether it answered as `instance`."""
        if instance is None:
            return False  # not synced yet: nothing to lose
        try:
            health = _json_object(self.session.get(url + "/health", timeout=self.timeout))
        except requests.RequestException:
            return False  # still down
        if health is None:
            return False  # not a rollout server (yet): still down
        if health.get("instance_id") != instance:  # still loading or ready: either way it lost our weights and updates
            raise _Restarted(url, down_seconds)
        return True

    def _resync(self, restarted: _Restarted) -> None:
        """Give a restarted server the last pushed weights and version (once, whoever notices first)."""
        url = restarted.url
        with self._resync_lock:
            health = self._call("GET", url, "/health", "a health check")
            if health["instance_id"] == self._instances.get(url):
                return  # another thread already did it
            self._instances[url] = health["instance_id"]  # calls below compare against the new process
            self._read_info(url)  # it may hold another dtype now (restarted with another --dtype)
            if self.run is not None:
                self._claim_one(url)
            if self.check_new_process is not None:
                self.check_new_process(url)
            last = self._last_pushed
            if last is not None:
                self._push_one(url, last.named, last.version, True, last.adapter, seq=last.seq)
            pushed = f"pushed weights version {last.version} again" if last else "nothing pushed yet"
            log.warning(f"rollout server {url} restarted: it was unreachable for {restarted.down_seconds:.1f}s; {pushed}; repeating the request")

    def _retrying(self, fn):
        """fn(), again after a resync each time the server turns out to have restarted."""
        while True:
            try:
                return fn()
            except _Restarted as restarted:
                pending = restarted
            while pending is not None:  # the server may restart again while it is being resynced
                try:
                    self._resync(pending)
                    pending = None
                except _Restarted as again:
                    pending = again

    def _each(self, fn, items: Iterable) -> list:
        """fn over items, concurrently, each in a daemon thread of its own; the first failure is
        raised with its cause. Daemon threads, not a ThreadPoolExecutor: Python joins an executor's
        threads at exit, so a request in flight (a server that holds it) kept a failing trainer
        alive for up to rollout_request_timeout, and under torchrun held the other ranks with it."""
        started = _started(fn, items)
        results = [future.result() for future, _ in started]
        for _, thread in started:
            thread.join()  # it ends once its result is set; none is left freeing tensors at the interpreter's exit (close)
        return results

    def _each_replica(self, fn, items: list) -> list:
        """_each, over a call's replicas (each item a url, or a tuple that begins with one); with
        several servers, None for the item of a replica taken out meanwhile (watch() takes out one
        that stops answering; a request that found it unreachable does so too), and the rest go
        on without it. Its thread is left to end by itself."""
        if len(self.urls) == 1:
            return self._each(fn, items)
        urls = [item if isinstance(item, str) else item[0] for item in items]
        results = []
        for url, (future, _) in zip(urls, _started(fn, items)):
            while not future.done() and self.fleet.is_up(url):
                wait([future], timeout=0.2)
            if not future.done() or (future.exception() is not None and _unreachable(future.exception())):
                if future.done():
                    self.fleet.mark_down(url, str(future.exception()))
                results.append(None)
            else:
                results.append(future.result())
        return results

    # ------------------------------------------------------------------ API

    def wait_until_ready(self) -> list[dict]:
        """Wait for every server's /health to say ready, then return their /info."""

        def one(url):
            deadline = time.monotonic() + self.server_timeout
            while True:
                status = self._call("GET", url, "/health", "a health check")
                if status["status"] == "ready":
                    self._instances[url] = status["instance_id"]
                    return self._read_info(url)
                if time.monotonic() > deadline:
                    raise RolloutServerError(f"rollout server {url} was still loading its model after rollout_server_timeout={self.server_timeout}s")
                time.sleep(0.5)

        return self._each(one, self.urls)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int = 0, version_timeout: float = 0.0,
        max_version: int | None = None,
    ) -> list[Completion]:
        """One completion per prompt (with its seed), the prompts shared among the servers up; a
        part whose server goes down is generated again by the others. Every answer is checked
        (check_completions); `max_version`: the newest version a server may hold (the trainer's)."""
        self._need_version = max(self._need_version, min_version)
        out: list[Completion | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            if len(self.urls) > 1 and (gone := self.fleet.wait_for_one(self.server_timeout)) is not None:
                raise RolloutServerError(f"no rollout server is left: {gone}; none came back within rollout_server_timeout={self.server_timeout}s",
                                         unreachable=True)  # fmt: skip
            plan = self.fleet.plan(prompts, todo)
            if not plan:  # the last replica went down since: wait for one again
                continue
            todo = []
            versions = (min_version, max_version)
            for (url, part), got in zip(plan, self._each_replica(lambda p: self._generate_part(p[0], p[1], prompts, params, seeds, versions, version_timeout), plan)):
                if got is None:
                    self.fleet.events["reissued"] += len(part)
                    todo += part
                for i, c in zip(part, got or []):
                    out[i] = c
        return out

    def _generate_part(self, url: str, part: list[int], prompts, params: SamplingParams, seeds, versions: tuple[int, int | None],
                       version_timeout: float) -> list[Completion]:  # fmt: skip
        body = {
            "prompts": [prompts[i] for i in part],
            "n": 1,
            "sampling": params.to_dict(),
            "seeds": [seeds[i] for i in part],
            "min_version": versions[0],
            "version_timeout": version_timeout,
        }

        def request():
            # A server replaced since the last call would hold a request that needs a version
            # only a push gives back. Under several processes, the rank that pushes may reach
            # the new process first, and would never notice, while a rank that noticed (and
            # pushes nothing) waits on the version (FSDP, in CI twice: a health check before
            # the request left a window). So the request names the process it is for, and
            # another one refuses it at once: a refusal that _call turns into a resync.
            return self._call("POST", url, "/generate", "a generate request", json={**body, "instance_id": self._instances.get(url)})

        start = time.monotonic()
        out = check_completions(url, self._retrying(request).get("completions"), len(part), versions, self._vocab.get(url), params.max_tokens)
        self.fleet.served(url, body["prompts"], max(len(c.token_ids) for c in out), time.monotonic() - start)
        return out

    def push_weights(self, named: list[tuple[str, torch.Tensor]], version: int, force: bool = False, adapter: bool = False) -> list[int]:
        """Send every weight to every server as one atomic update that makes `version` live;
        with `adapter`, LoRA factors and whole weights that the servers merge into their base
        weights (tandem.rollout.adapters).

        The tensors are copied first: the copy is what a restarted server gets back, and the
        trainer may change its own weights while a generation with these is still in flight.
        StagedWeights (sharded training) are that copy already, on disk, and are read a bucket
        at a time. Whole weights are copied in the dtype the servers hold them in (where they
        share one): they would cast them on arrival to the same bits, and a bf16 server gets half
        the bytes (0.99 against 1.98 GB at the Qwen2.5-0.5B shape: 3.4 against 11.6 s a push here).
        Where servers map the push's shared memory (files on this host, buffers on the trainer's
        GPU), that memory is the copy (transports.Push.copy). A delta is made of those bits."""
        delta = self.delta and not adapter and not isinstance(named, StagedWeights)
        push = self._push(self.fleet.up(), named)
        try:
            if not isinstance(named, StagedWeights):
                named = push.copy(list(named), None if adapter else self._servers_dtype(required=delta and self._last_pushed is None), self.bucket_bytes)
            with self._fleet_lock:  # a replica put back from here on is put back with these weights
                self._pushes += 1
                last, self._last_pushed = self._last_pushed, _Pushed(version, named, adapter, self._pushes)
                urls = self.fleet.up()
            return self._push_all(urls, self._last_pushed, force, push, last if delta else None)
        finally:
            push.close()

    def _push_all(self, urls: list[str], this: "_Pushed", force: bool, push: Push, last: "_Pushed | None") -> list[int]:
        """push_weights' update to each server up; `last`: the push before, where a delta may go
        against it (the version before, in the same dtype: a replica restarted with another
        --dtype changes the copy's)."""
        named, version, adapter = this.named, this.version, this.adapter
        dtypes, against = _dtypes_of(named), None
        if last is not None and not last.adapter and last.version == version - 1 and _dtypes_of(last.named) == dtypes:
            against = _Delta(last.version, last.named, named, self.bucket_bytes)
        self._sent = []

        def one(url):
            # A server that restarts mid-update gets the whole update again, forced (it is at
            # version 0), and so does one that refuses it as not its next version (409): a
            # replica at another version is resynced, never a reason to stop the run.
            first = [True]
            delta = against if url in self._dtypes and {getattr(torch, self._dtypes[url])} == dtypes else None  # its bits are of the replica's dtype

            def attempt():
                forced = force or not first[0]
                first[0] = False
                try:
                    return self._push_one(url, named, version, forced, adapter, None if forced else delta, push, this.seq)
                except RolloutServerError as exc:
                    if forced or exc.status != 409:
                        raise
                    log.warning(f"rollout server {url} refused the update to version {version} ({exc}); sending it whole")
                    return self._push_one(url, named, version, True, adapter, None, push, this.seq)

            return self._retrying(attempt)

        return self._each_replica(one, urls)

    @property
    def push_bytes(self) -> int:
        """What the last push_weights sent, all servers together."""
        return sum(self._sent)

    def _read_info(self, url: str) -> dict:
        """A server's /info: what its process holds and where it runs (its dtype, vocabulary,
        host and GPU), read at the start and again after every restart (it may come back with
        another --dtype)."""
        info = self._call("GET", url, "/info", "an info request")
        try:
            self._dtypes[url], self._vocab[url] = str(info["dtype"]), int(info["vocab_size"])
            self._places[url] = (info["host_id"] == host_id(), info.get("cuda_device"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutServerError(f"rollout server {url} answered /info without its dtype, vocab_size and host_id ({type(exc).__name__}: {exc}); "
                                     "is `tandem rollout` of this tandem version serving there?") from None  # fmt: skip
        return info

    def _servers_dtype(self, required: bool) -> torch.dtype | None:
        """The one dtype every server holds weights in, or None where they hold several (an
        error where `required`: a delta's bits are of one dtype)."""
        for url in self.urls:
            if url not in self._dtypes:
                self._read_info(url)
        dtypes = sorted(set(self._dtypes.values()))
        if len(dtypes) > 1 and required:
            raise ValueError(f"delta_weight_updates needs rollout servers of one dtype, these hold {dtypes}: start them with one --dtype, or turn it off")
        if len(dtypes) > 1 and self.delta and self._mixed_said != dtypes:  # one restarted with another --dtype: whole weights until they agree
            self._mixed_said = dtypes
            log.warning(f"the rollout servers hold weights in {dtypes}: pushes send whole weights until they hold one (a delta's bits are of one dtype)")
        return getattr(torch, dtypes[0]) if len(dtypes) == 1 else None

    def _push_one(self, url: str, named: list[tuple[str, torch.Tensor]], version: int, force: bool, adapter: bool, against: "_Delta | None" = None,
                  push: Push | None = None, seq: int | None = None) -> int | None:  # fmt: skip
        """One update to one server. Updates to a server run one at a time (a server keeps only
        its newest unfinished update), each bound to the process it began on; an update that
        process already committed (a resync by the generating thread) is not sent twice.
        `against`: a delta from the version that server holds, if it holds it. `push`: the
        push's transports, whose shared memory is made once for all the servers that map it.
        `seq`: the push_weights call it is of; one that a newer call superseded is dropped (None
        returned). A replica taken out mid-push leaves its update's thread running: resynced
        and put back, it got the newest weights, and that thread, forced after the restart, sent
        its stale update over them (a replica at version 4 serving as 12)."""
        with self._push_locks[url]:
            if seq is not None and self._last_pushed is not None and seq != self._last_pushed.seq:
                return None
            instance = self._instances.get(url)
            if instance is not None and self._committed.get(url) == (instance, version):
                return version
            if against is not None and self._committed.get(url) == (instance, against.version):
                try:
                    return self._send_delta(url, instance, version, against)
                except RolloutServerError as exc:
                    if exc.status != 409:
                        raise
                    log.warning(f"rollout server {url} refused a delta update ({exc}); sending the whole weights")
            body = {"version": version, "force": force, "num_tensors": len(named), "adapter": adapter, "run_id": self.run and self.run["run_id"],
                    "keep_base": self.delta and not adapter and not isinstance(named, StagedWeights)}  # fmt: skip
            uid = self._call("POST", url, "/weights/begin", "a weight update", instance, json=body)["update_id"]
            own = push is None or url not in push.by_url  # a resync's, or a replica put back since the push began
            push = self._push([url], named) if own else push
            try:
                self._sent += push.by_url[url].send(lambda method, route, what, **request: self._call(method, url, f"/weights/{uid}/{route}", what, instance, **request),
                                                    url, named, self.bucket_bytes)  # fmt: skip
            finally:
                if own:
                    push.close()
            return self._commit(url, instance, uid, version)

    def _send_delta(self, url: str, instance: str, version: int, against: "_Delta") -> int:
        body = {"version": version, "num_tensors": against.count, "run_id": self.run and self.run["run_id"], "delta_from": against.version, "keep_base": True}
        uid = self._call("POST", url, "/weights/begin", "a delta weight update", instance, json=body)["update_id"]
        for chunk in against.chunks():
            self._sent.append(len(chunk))
            self._call("PUT", url, f"/weights/{uid}/delta", "a delta weight chunk", instance, data=chunk, headers={"Content-Type": "application/octet-stream"})
        return self._commit(url, instance, uid, version, against.fingerprint())

    def _commit(self, url: str, instance: str | None, uid: str, version: int, expected: str | None = None) -> int:
        got = self._call("POST", url, f"/weights/{uid}/commit", "a weight commit", instance, json={"fingerprint": expected})["version"]
        if got != version:
            raise RolloutServerError(f"rollout server {url} reports version {got} after the update, expected {version}")
        self._committed[url] = (instance, version)
        return got

    def claim(self, run_id: str, name: str, threads: dict[str, int] | None = None) -> None:
        """Hold every server for this run: a server refuses the pushes of any other run, and a
        server another run holds refuses this one (HTTP 409, naming that run). The hold is a
        lease: a daemon thread claims again every quarter of it until release(), so a trainer
        that dies without letting go frees its servers once its lease lapses. `threads`: by URL,
        the CPU threads this run lends a server's generation (its trainer waits meanwhile)."""
        self.run = {"run_id": run_id, "name": name}
        self._lent = dict(threads or {})
        lease = min(hold.get("lease_seconds", math.inf) for hold in self._each(self._claim_one, self.urls))
        if math.isfinite(lease):
            self._start(self._renew, lease / 4, name="tandem-claim-renewal")

    def _claim_body(self, url: str) -> dict:
        # Sent only where lent: a server older than the field refuses a body that names it.
        return {**self.run, "threads": self._lent[url]} if url in self._lent else self.run

    def _claim_one(self, url: str) -> dict:
        return self._call("POST", url, "/run", "this run's claim on it", json=self._claim_body(url))

    def _renew(self, interval: float) -> None:
        """Claim again every `interval` seconds, once, without retries: a renewal that fails is
        tried again at the next one (a quarter of the lease later)."""
        while not self._closed.wait(interval):
            with self._run_lock:
                if self.run is None:
                    return
                for url in self.urls:
                    try:
                        self.session.post(url + "/run", json=self._claim_body(url), headers=self.headers, timeout=(self.timeout[0], 10))
                    except requests.RequestException:
                        pass

    def release(self) -> None:
        """Let every server go (at the run's end), quickly and without retries: a server that is
        gone holds nothing."""
        with self._run_lock:
            run, self.run = self.run, None
        if run is None:
            return
        for url in self.urls:
            try:
                self.session.delete(url + "/run", params={"run_id": run["run_id"]}, headers=self.headers, timeout=(self.timeout[0], 5))
            except requests.RequestException:
                pass

    def fingerprints(self, urls: list[str] | None = None) -> list[dict]:
        return self._each(self.fingerprint, urls or self.urls)

    def fingerprint(self, url: str) -> dict:
        """One server's version and fingerprints, asked from the calling thread."""
        return self._call("GET", url, "/weights/fingerprint", "a fingerprint request")

    def _push(self, urls: list[str], named) -> Push:
        """The transports of a push of `named` to `urls`."""
        device = torch.device("cpu") if isinstance(named, StagedWeights) or not named else named[0][1].device
        return Push({url: self._transport(url, device) for url in urls}, device)

    def _transport(self, url: str, device: torch.device) -> str:
        """The way weights on `device` reach `url`: the one asked for, else CUDA IPC where the
        server runs on that very GPU, shared memory where it runs on this host, HTTP elsewhere."""
        if self.transport == "cuda_ipc" and device.type != "cuda":
            raise ValueError(f"weight_transport cuda_ipc needs the trainer's weights on a GPU, they are on {device}: use auto, shm or http")
        if self.transport != "auto":
            return self.transport
        if url not in self._places:
            self._read_info(url)
        here, gpu = self._places[url]
        if here and gpu is not None and gpu == cuda_device_id(device):
            return "cuda_ipc"
        return "shm" if here and shm_available() else "http"

    def watch(self, interval: float = WATCH_SECONDS) -> None:
        """Probe every server's /health every `interval` seconds, each in a thread of its own (once
        per client). A server that answers as a new process is resynced, by the client that
        pushes: a restart another process's request ran into leaves that process waiting on the
        server for a version only this one can push, and this one waiting on it in a collective,
        calling no server. With several servers, one that refuses connections or leaves a probe
        unanswered for replica_timeout seconds is taken out of the fleet, and put back once it
        answers and holds the version needed (the client that pushes gives it the last weights)."""
        if self._watching:
            return
        self._watching = True
        for url in self.urls:
            self._start(self._watch_one, url, interval, name="tandem-server-watch")

    def _start(self, method, *args, name: str) -> None:
        thread = threading.Thread(target=method, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch_one(self, url: str, interval: float) -> None:
        seen = time.monotonic()  # when its process last answered
        while not self._closed.wait(interval):
            try:
                health = _json_object(self.session.get(url + "/health", timeout=(self.timeout[0], self.replica_timeout)))
            except requests.RequestException as exc:
                refused = isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.ConnectTimeout)
                if len(self.urls) > 1 and (refused or time.monotonic() - seen > self.replica_timeout):
                    self.fleet.mark_down(url, f"{'refused connections' if refused else 'health checks unanswered'}: {type(exc).__name__}")
                continue
            if health is None or "instance_id" not in health:  # another program answers on its port
                if len(self.urls) > 1:
                    self.fleet.mark_down(url, "its health check is answered by something that is not a rollout server")
                continue
            down, seen = time.monotonic() - seen, time.monotonic()
            try:
                if health.get("status") != "ready":
                    continue
                if self.fleet.is_up(url):
                    if health["instance_id"] != self._instances.get(url):
                        self._retrying(lambda: self._check_restart(url, self._instances.get(url), down))
                else:
                    self._put_back(url, health)
            except RolloutServerError as exc:  # down again mid-resync: the next probe, or a request, meets it
                log.warning(f"rollout server {url}: resync failed: {exc}")

    def _put_back(self, url: str, health: dict) -> None:
        """A replica that was taken out answers again: the client that pushes gives it the last
        weights whole, where it does not hold them; another client waits until it holds the
        version its calls need. Then it is in the fleet again."""
        if self.run is None and self._last_pushed is None:  # a client that does not push
            if health["version"] >= self._need_version:
                self.fleet.mark_up(url)
            return
        while True:
            pushed = self._last_pushed
            if pushed is not None:
                if health["instance_id"] != self._instances.get(url):
                    self._retrying(lambda: self._check_restart(url, self._instances.get(url), 0.0))  # resyncs a new process
                elif not self._holds(url, pushed):
                    self._committed.pop(url, None)  # whatever it committed, it does not hold this push: sent again
                    self._retrying(lambda: self._push_one(url, pushed.named, pushed.version, True, pushed.adapter, seq=pushed.seq))
            with self._fleet_lock:  # no push starts until it is back, or not
                if self._last_pushed is pushed and (pushed is None or self._holds(url, pushed)):
                    self.fleet.mark_up(url)
                    log.warning(f"rollout server {url} answers again; it holds version {pushed.version if pushed else health['version']} "
                                "(read from it, with its fingerprint) and is back in the fleet")  # fmt: skip
                    return
            health = self._call("GET", url, "/health", "a health check")

    def _holds(self, url: str, pushed: "_Pushed") -> bool:
        """Whether the replica holds `pushed`: its version and fingerprint as read from it, against
        the push's weights in the replica's dtype (adapters as sent)."""
        served = self.fingerprint(url)
        if served.get("version") != pushed.version:
            return False
        dtype = None if pushed.adapter else self._dtypes.get(url)
        key = (pushed.seq, dtype)
        if key not in self._fingerprints:
            self._fingerprints = {k: v for k, v in self._fingerprints.items() if k[0] == pushed.seq}  # older pushes' are of no use
            self._fingerprints[key] = fingerprint_as(pushed.named, getattr(torch, dtype) if dtype else None)
        return served.get("adapter_fingerprint" if pushed.adapter else "fingerprint") == self._fingerprints[key]

    def close(self, timeout: float = 5.0) -> None:
        """End the watch and the claim's renewal, and wait for their threads, `timeout` seconds in
        all: one in a probe waits for its answer. A thread left running holds this client, and
        through it the last pushed weights; freed in that thread while the interpreter shuts down,
        a tensor aborts the process ("terminate called without an active exception") after a run
        that succeeded. A request still in flight ends with its daemon thread."""
        self._closed.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _started(fn, items: Iterable) -> list[tuple[Future, threading.Thread]]:
    """fn(item) for each item, each in a daemon thread of its own; their futures and threads."""
    return [in_thread(fn, item, name="tandem-client") for item in items]


class _Pushed(NamedTuple):
    """One push_weights call: its version, its copy of the weights, whether they are adapters,
    and its place among the client's pushes."""

    version: int
    named: object  # list[tuple[str, torch.Tensor]] | StagedWeights
    adapter: bool
    seq: int


def _dtypes_of(named) -> set:
    return {t.dtype for _, t in named} if not isinstance(named, StagedWeights) else set()


class _Delta:
    """A delta update from `version` (weights `old`) to `new`: its compressed chunks and the
    fingerprint of the result, made once, by the first server's thread that needs them, for all.
    `old` stays as it is: a restarted server's resync may be sending it at the same time."""

    def __init__(self, version: int, old: list[tuple[str, torch.Tensor]], new: list[tuple[str, torch.Tensor]], bucket_bytes: int):
        self.version, self.count = version, len(new)
        self._old, self._new, self._bucket_bytes = dict(old), new, bucket_bytes
        self._lock = threading.Lock()
        self._chunks: list[bytes] | None = None
        self._fingerprint: str | None = None

    def chunks(self) -> list[bytes]:
        with self._lock:
            if self._chunks is None:
                self._chunks = [compress_delta({n: xor_bits(t, self._old[n]) for n, t in bucket.items()}) for bucket in buckets(self._new, self._bucket_bytes)]
            return self._chunks

    def fingerprint(self) -> str:
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = fingerprint(self._new)
            return self._fingerprint


def check_completions(url: str, answer, n: int, versions: tuple[int, int | None], vocab: int | None, max_tokens: int) -> list[Completion]:
    """A server's completions for `n` prompts, each checked before anything trains on it: made by
    a version in [min_version, max_version], of 1 to max_tokens token ids in the vocabulary (none
    only where generation failed), each with a finite log-prob <= 0. A RolloutServerError names
    the server and the first thing wrong."""
    low, high = versions

    def bad(what: str):
        raise RolloutServerError(f"rollout server {url} answered a generate request with {what}; nothing of it is trained. Is `tandem rollout` "
                                 "of this tandem version serving there?")  # fmt: skip

    if not isinstance(answer, list) or len(answer) != n:
        bad(f"{len(answer) if isinstance(answer, list) else 'no list of'} completions for {n} prompts")
    out = []
    for i, c in enumerate(answer):
        try:
            ids, logprobs, finish, version = list(c["token_ids"]), [float(x) for x in c["logprobs"]], c["finish_reason"], c["version"]
        except (TypeError, KeyError, ValueError) as exc:
            bad(f"completion {i} of {n} malformed ({type(exc).__name__}: {exc})")
        if not isinstance(version, int) or version < low or (high is not None and version > high):
            bad(f"completion {i} of {n} made by version {version!r}, outside [{low}, {'any' if high is None else high}] (the trainer's weights)")
        if finish not in FINISH_REASONS or (not ids and finish != "error") or len(ids) > max_tokens:
            bad(f"completion {i} of {n} of {len(ids)} tokens finished by {finish!r} (max_tokens {max_tokens}, finish one of {FINISH_REASONS})")
        if not all(isinstance(t, int) and 0 <= t < (vocab or math.inf) for t in ids):
            bad(f"completion {i} of {n} holding a token id outside [0, {vocab}) (the model's vocabulary)")
        if len(logprobs) != len(ids) or not all(math.isfinite(x) and x <= 0.0 for x in logprobs):
            bad(f"completion {i} of {n} whose {len(logprobs)} log-probs for {len(ids)} tokens are not each finite and <= 0")
        out.append(Completion(ids, logprobs, finish, version))
    return out


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, RolloutServerError) and exc.unreachable


def _json_object(r: requests.Response) -> dict | None:
    """The answer's body as a JSON object, or None where it is not one."""
    try:
        body = r.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _error_text(r: requests.Response) -> str:
    body = _json_object(r)
    return str(body.get("error", r.text[:500])) if body is not None else r.text[:500]


class RemoteEngine:
    """The Engine interface over RolloutClient: the producer cannot tell it from a local engine."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int = 0) -> list[Completion]:
        return self.client.generate(prompts, params, seeds, min_version=min_version, version_timeout=self.client.server_timeout, max_version=self.version)

    def push(self, named: list[tuple[str, torch.Tensor]], version: int, force: bool = False, adapter: bool = False) -> None:
        self.client.push_weights(named, version, force, adapter)
        self.version = version
