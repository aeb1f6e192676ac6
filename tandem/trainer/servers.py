"""The trainer's side of its rollout servers (server mode): connecting, the weights they start
from, pushes and their checks. Every rank connects and generates; rank 0 alone pushes."""

import os
import socket
from pathlib import Path

import torch

from tandem.rollout.client import RemoteEngine, RolloutClient, RolloutServerError
from tandem.rollout.weights import StagedWeights, fingerprint, in_name_order
from tandem.trainer.config import TrainConfig
from tandem.trainer.setup import trainer_threads

Named = list[tuple[str, torch.Tensor]] | StagedWeights  # StagedWeights when training is sharded


class Servers:
    def __init__(self, config: TrainConfig, vocab_size: int, world: int, is_main: bool):
        """Wait for every server to be ready and check it can serve this tokenizer's vocabulary."""
        self.config = config
        self.client = RolloutClient(
            config.rollout_server_urls,
            api_key=config.rollout_api_key,
            connect_timeout=config.rollout_connect_timeout,
            request_timeout=config.rollout_request_timeout,
            server_timeout=config.rollout_server_timeout,
            transport=config.weight_transport,
        )
        self.engine = RemoteEngine(self.client)
        self.infos = self.client.wait_until_ready()
        sharing = trainer_threads(self.infos, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if sharing is not None and config.async_generate:  # in sync mode the two take turns
            torch.set_num_threads(sharing[0])
            if is_main:
                print(f"tandem: {sharing[1]}", flush=True)
        for url, info in zip(config.rollout_server_urls, self.infos):
            if info["vocab_size"] < vocab_size:
                raise ValueError(f"rollout server {url} serves {info['model']} with vocabulary {info['vocab_size']}, smaller than this tokenizer's {vocab_size}")

    @property
    def _key(self) -> str:
        """The fingerprint that says whether a server holds what we push."""
        return "adapter_fingerprint" if self.config.use_peft else "fingerprint"

    def start(self, policy: Named, base: Named | None, version: int, run_id: str) -> None:
        """Rank 0, before any generation: hold every server for this run (refused when another
        run holds one), and make each hold our weights and version. A server left running by an
        earlier (crashed) trainer of this run takes this trainer's. With LoRA (`base` given), a
        server whose base weights are not ours is refused."""
        self.client.claim(run_id, f"in {Path(self.config.output_dir).resolve()} on {socket.gethostname()} (pid {os.getpid()})")
        served = self.client.fingerprints()
        if base is not None:
            expected = dict(zip(self.config.rollout_server_urls, self._served_as(base)))
            self._check_base(served, expected)
            # A server that restarts mid-run may come back with another model: checked again
            # before it gets an adapter (issue 27: a run trained on against another base).
            self.client.check_new_process = lambda url: self._check_base([self.client.fingerprint(url)], {url: expected[url]})
        mine = fingerprint(policy)
        if any(fp.get(self._key) != mine or fp["version"] != version for fp in served):
            self.engine.push(policy, version=version, force=True, adapter=self.config.use_peft)

    def push(self, policy: Named, version: int) -> None:
        """Rank 0: make `version` live on every server, checked when verify_weight_sync."""
        self.engine.push(policy, version, adapter=self.config.use_peft)
        if self.config.verify_weight_sync:
            self._verify(policy, version)

    def close(self) -> None:
        self.client.release()
        self.client.close()

    def _served_as(self, named: Named) -> list[str]:
        """weights.fingerprint of `named` as each server holds them: in its dtype."""
        hashes: dict[str, str] = {}
        for info in self.infos:
            if info["dtype"] not in hashes:
                dtype = getattr(torch, info["dtype"])
                hashes[info["dtype"]] = fingerprint(((n, t.to(dtype)) for n, t in in_name_order(named)), ordered=True)
        return [hashes[info["dtype"]] for info in self.infos]

    def _check_base(self, served: list[dict], expected: dict[str, str]) -> None:
        """LoRA: each server's base weights (its full weights, under an adapter or not) hash to
        `expected[url]`, our base's fingerprint in that server's dtype."""
        model = self.config.model_name_or_path
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
        served = self.client.fingerprints()
        mine_each = [fingerprint(policy)] * len(served) if self.config.use_peft else self._served_as(policy)
        for url, fp, mine in zip(self.config.rollout_server_urls, served, mine_each):
            if fp.get(self._key) != mine or fp["version"] != version:
                raise RolloutServerError(
                    f"rollout server {url} holds different weights after the push of version {version} "
                    f"(server version {fp['version']}, {self._key} {(fp.get(self._key) or 'none')[:12]}, trainer {mine[:12]})"
                )
