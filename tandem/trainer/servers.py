"""The trainer's side of its rollout servers (server mode): connecting, the weights they start
from, pushes and their checks. Every rank connects and generates; rank 0 alone pushes."""

import os
from dataclasses import dataclass

import torch

from tandem.rollout.client import RemoteEngine, RolloutClient, RolloutServerError
from tandem.rollout.weights import StagedWeights, fingerprint, fingerprint_as
from tandem.trainer.setup import lent_threads, trainer_threads

Named = list[tuple[str, torch.Tensor]] | StagedWeights  # StagedWeights when training is sharded


@dataclass(frozen=True)
class ServerOptions:
    """The rollout servers of a run and how to talk to them (TrainConfig's values)."""

    urls: list[str]
    api_key: str | None
    connect_timeout: float
    request_timeout: float
    server_timeout: float
    transport: str
    delta: bool  # delta_weight_updates
    balance: str  # rollout_balance
    replica_timeout: float  # rollout_replica_timeout
    adapters: bool  # LoRA: pushes hold adapters, checked against the base the servers hold
    verify: bool  # verify_weight_sync: every push's fingerprint checked
    model: str  # model_name_or_path, for the messages
    run_name: str  # where the run is, for a server another run holds


class Servers:
    def __init__(self, options: ServerOptions, vocab_size: int, world: int, is_main: bool, share_cores: bool):
        """Wait for every server to be ready and check it can serve this tokenizer's vocabulary.
        `share_cores` (async mode): training overlaps generation, so the trainer leaves the
        cores of servers on this host free (in sync mode the two take turns, and the servers
        generate on every core)."""
        self.options, self.world = options, world
        self.client = RolloutClient(
            options.urls,
            api_key=options.api_key,
            connect_timeout=options.connect_timeout,
            request_timeout=options.request_timeout,
            server_timeout=options.server_timeout,
            transport=options.transport,
            delta=options.delta,
            balance=options.balance,
            replica_timeout=options.replica_timeout,
        )
        self.engine = RemoteEngine(self.client)
        self.infos = self.client.wait_until_ready()
        # Servers on this host's CPU: in async mode training leaves them their cores; in sync
        # mode it waits while they generate, and lends them its own.
        self.lent: dict[str, int] = {}  # url -> threads this run lends that server's generation
        if share_cores:
            sizing = trainer_threads(self.infos, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            if sizing is not None:
                torch.set_num_threads(sizing[0])
        else:
            sizing = lent_threads(options.urls, self.infos)
            if sizing is not None:
                self.lent = sizing[0]
        if sizing is not None and is_main:
            print(f"tandem: {sizing[1]}", flush=True)
        for url, info in zip(options.urls, self.infos):
            if info["vocab_size"] < vocab_size:
                raise ValueError(f"rollout server {url} serves {info['model']} with vocabulary {info['vocab_size']}, smaller than this tokenizer's {vocab_size}")
        if len(options.urls) > 1:  # every process takes a replica that stops answering out of its fleet
            self.client.watch()

    @property
    def _key(self) -> str:
        """The fingerprint that says whether a server holds what we push."""
        return "adapter_fingerprint" if self.options.adapters else "fingerprint"

    def start(self, policy: Named, base: Named | None, version: int, run_id: str) -> None:
        """Rank 0, before any generation: hold every server for this run (refused when another
        run holds one), and make each hold our weights and version. A server left running by an
        earlier (crashed) trainer of this run takes this trainer's. With LoRA (`base` given), a
        server whose base weights are not ours is refused."""
        self.client.claim(run_id, self.options.run_name, self.lent)
        served = self.client.fingerprints()
        if base is not None:
            expected = dict(zip(self.options.urls, self._served_as(base)))
            self._check_base(served, expected)
            # A server that restarts mid-run may come back with another model: checked again
            # before it gets an adapter (issue 27: a run trained on against another base).
            self.client.check_new_process = lambda url: self._check_base([self.client.fingerprint(url)], {url: expected[url]})
        mine = fingerprint(policy)
        if any(fp.get(self._key) != mine or fp["version"] != version for fp in served):
            self.engine.push(policy, version=version, force=True, adapter=self.options.adapters)
        if self.world > 1:  # another process's request may be the one that meets a restart
            self.client.watch()

    def push(self, policy: Named, version: int) -> None:
        """Rank 0: make `version` live on every server, checked when verify_weight_sync."""
        self.engine.push(policy, version, adapter=self.options.adapters)
        if self.options.verify:
            self._verify(policy, version)

    def metrics(self) -> dict[str, float]:
        """What the push sent, and with several servers, the fleet's replicas up and its events so
        far, as this process saw them: replicas taken out and put back, sequences generated again
        elsewhere."""
        record = {"weights/push_mb": self.client.push_bytes / 2**20}
        if len(self.options.urls) > 1:
            fleet = self.client.fleet
            record.update({"servers/up": float(len(fleet.up()))} | {f"servers/{k}": float(v) for k, v in fleet.events.items()})
        return record

    def close(self) -> None:
        self.client.release()
        self.client.close()

    def _served_as(self, named: Named) -> list[str]:
        """weights.fingerprint of `named` as each server holds them: in its dtype."""
        hashes: dict[str, str] = {}
        for info in self.infos:
            if info["dtype"] not in hashes:
                hashes[info["dtype"]] = fingerprint_as(named, getattr(torch, info["dtype"]))
        return [hashes[info["dtype"]] for info in self.infos]

    def _check_base(self, served: list[dict], expected: dict[str, str]) -> None:
        """LoRA: each server's base weights (its full weights, under an adapter or not) hash to
        `expected[url]`, our base's fingerprint in that server's dtype."""
        model = self.options.model
        for (url, mine), fp in zip(expected.items(), served):
            theirs = fp.get("base_fingerprint") or fp["fingerprint"]
            if theirs != mine:
                raise RolloutServerError(
                    f"rollout server {url} serves other base weights than model_name_or_path={model} (fingerprint {theirs[:12]}, "
                    f"trainer {mine[:12]}); adapters only fit the model they are trained on: restart it as `tandem rollout --model {model}`"
                )

    def _verify(self, policy: Named, version: int) -> None:
        """Hash our weights in each server's dtype (its copy rounds the same way) and compare;
        adapters are hashed as sent (the server keeps them as received)."""
        urls = self.client.fleet.up()  # a replica taken out gets the last weights whole when it is put back
        served = self.client.fingerprints(urls)
        all_urls = self.options.urls
        mine_each = dict(zip(all_urls, [fingerprint(policy)] * len(all_urls) if self.options.adapters else self._served_as(policy)))
        for url, fp in zip(urls, served):
            mine = mine_each[url]
            if fp.get(self._key) != mine or fp["version"] != version:
                raise RolloutServerError(
                    f"rollout server {url} holds different weights after the push of version {version} "
                    f"(server version {fp['version']}, {self._key} {(fp.get(self._key) or 'none')[:12]}, trainer {mine[:12]})"
                )
