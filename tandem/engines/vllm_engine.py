"""The vLLM engine: vLLM's AsyncLLM behind the Engine protocol (`tandem rollout --engine vllm`).

vLLM runs in its own processes (an engine core and its workers); this object lives in the rollout
server and talks to it on an asyncio loop of its own thread. Token ids go in and out (vLLM's
tokenizer serves only its structured outputs: a grammar), one vLLM request per completion with
that completion's seed, so vLLM's scheduler batches every client's sequences continuously and a
sequence's tokens do not depend on the batch.
"""

import asyncio
import json
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import torch

from tandem.engines.engine import check_request, seed_bits
from tandem.rollout.types import Completion, SamplingParams
from tandem.engines.vllm_worker import SERVER_PID
from tandem.rollout.weights import check_weights, fingerprint, safetensors_stream, sealed_memfd

START_TIMEOUT = 1800.0  # seconds: a large model's first start on a GPU compiles and profiles for minutes


class VLLMEngine:
    # vLLM batches requests from every call together as they arrive; this bounds the threads
    # that wait on it, not its batch (its own --max-num-seqs does that).
    max_concurrency = 64

    def __init__(self, model_dir: str, eos_token_ids: list[int], dtype: str, options: dict, threads: int):
        from vllm.engine.arg_utils import AsyncEngineArgs

        if not eos_token_ids:
            raise ValueError("the engine needs at least one EOS token id to know when a completion stops")
        self.version = 0
        # The worker's threads, plus the engine core's process, which keeps most of a core busy
        # while requests run (measured on CPU: 8.6 s of CPU in 10 s of generation).
        self.threads = threads + 1
        self.eos_token_ids = list(eos_token_ids)
        self.model_dir = model_dir
        self.dtype = getattr(torch, dtype)
        self._spec = checkpoint_spec(model_dir, self.dtype)
        self._fingerprint: str | None = None  # of the checkpoint, computed when first asked
        self._full_update_loaded = False  # the weights live are no longer the checkpoint's
        args = AsyncEngineArgs(
            model=model_dir,
            dtype=dtype,
            # vLLM's structured outputs need its tokenizer (a grammar compiles against it), and
            # llguidance's backend is the one the transformers engine masks with (rollout.grammar)
            structured_outputs_config={"backend": "guidance"},
            # the sampled token's log-prob before any processing; the worker (tandem_setup)
            # divides the logits by the request's temperature first: log softmax(logits / T),
            # what the transformers engine records and the trainer recomputes
            logprobs_mode="raw_logprobs",
            worker_extension_cls="tandem.engines.vllm_worker.WeightLoader",
            **options,
        )
        os.environ[SERVER_PID] = str(os.getpid())  # vLLM's processes die with this one (vllm_worker)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-vllm-loop", daemon=True)
        self._thread.start()
        self.llm = self._wait(self._start(args), START_TIMEOUT, "vLLM to start")
        self._wait(self.llm.collective_rpc("tandem_setup"), START_TIMEOUT, "vLLM's workers to set up tandem's log-probs")
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.vocab_size = int(self.llm.model_config.get_vocab_size())

    async def _start(self, args):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)

    def _wait(self, coro, timeout: float | None, what: str):
        from vllm.v1.engine.exceptions import EngineDeadError

        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise RuntimeError(f"gave up after {timeout:g}s waiting for {what}") from None
        except EngineDeadError:
            # vLLM cannot recover its engine core. Stop the server (a clean shutdown) so that a
            # supervisor restarts it; the trainer then resyncs the new process.
            print("tandem rollout: vLLM's engine core died (its log above says why); stopping the server", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            raise

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int = 0) -> list[Completion]:
        check_request(self, prompts, params, seeds, min_version)
        return self._wait(self._generate(prompts, params, seeds), None, "vLLM to generate")

    async def _generate(self, prompts, params: SamplingParams, seeds) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        version = self.version  # load_weights never runs while a generate() call does
        common = dict(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            stop_token_ids=self.eos_token_ids,
            logprobs=0,  # the sampled token's only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=StructuredOutputsParams(grammar=params.grammar) if params.grammar else None,
        )

        async def one(prompt: list[int], seed: int) -> Completion:
            sampling = VLLMSamplingParams(seed=seed_bits(seed), **common)
            final = None
            async for final in self.llm.generate({"prompt_token_ids": prompt}, sampling, request_id=uuid.uuid4().hex):
                pass
            out = final.outputs[0]
            tokens = list(out.token_ids)
            logprobs = [step[tok].logprob for step, tok in zip(out.logprobs, tokens)]
            finish = out.finish_reason if out.finish_reason in ("stop", "length") else "error"
            cached = final.num_cached_tokens or 0
            return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=finish, version=version, cached_tokens=cached)

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds))))

    # ------------------------------------------------------------------ weights

    def weight_spec(self) -> dict[str, torch.Tensor]:
        return self._spec

    def base_weights(self) -> dict[str, torch.Tensor]:
        # The workers hold the weights fused and repacked, so the base is read from the checkpoint
        # (in CPU memory, the model's size, while adapters are served).
        if self._full_update_loaded:
            raise ValueError(
                "this vLLM server has served full weights pushed since it started and keeps no copy of them to merge an "
                "adapter into; restart it (`tandem rollout --model <the base model>`) to serve a LoRA run"
            )
        return dict(_checkpoint_tensors(self.model_dir, self.dtype))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        check_weights(self._spec, weights, complete=True)
        # vLLM's workers are other processes: they map a sealed memfd of ours by its /proc path
        # (passing tensors through collective_rpc would pickle them into lists).
        fd = sealed_memfd(safetensors_stream(weights)[1])
        self._fingerprint, self._full_update_loaded = None, True  # whatever happens below, not the checkpoint's
        try:
            hashes = self._wait(self._reload(f"/proc/{os.getpid()}/fd/{fd}"), None, "vLLM to load the weights")
        finally:
            os.close(fd)
        if len(set(hashes)) != 1:
            raise RuntimeError(f"vLLM's workers received different weights: fingerprints {sorted(h[:12] for h in set(hashes))}")
        self._fingerprint = hashes[0]

    async def _reload(self, path: str) -> list[str]:
        # "wait" lets requests in flight finish (the server's gate has drained them already) and
        # clears the prefix cache, whose keys and values the old weights computed.
        await self.llm.pause_generation(mode="wait", clear_cache=True)
        try:
            return await self.llm.collective_rpc("tandem_load_weights", args=(path, str(self.dtype).removeprefix("torch.")))
        finally:
            await self.llm.resume_generation()

    def fingerprint(self) -> str:
        """The checkpoint's, until an update loads: then what each worker hashed of the tensors it
        received and vLLM reported loaded (tandem_load_weights)."""
        if self._fingerprint is None and not self._full_update_loaded:
            self._fingerprint = fingerprint(_checkpoint_tensors(self.model_dir, self.dtype))
        if self._fingerprint is None:
            raise RuntimeError("the last weight update did not load; push a whole update again")
        return self._fingerprint

    def close(self) -> None:
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


def _safetensors_files(model_dir: str) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors files; the vLLM engine loads and updates weights in that format")
    return files


def checkpoint_spec(model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta tensors with the name and shape of every tensor in the checkpoint's safetensors files,
    read from their headers: the names a trainer pushes (the model's HF names, unfused)."""
    spec = {}
    for path in _safetensors_files(model_dir):
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                spec[name] = torch.empty(entry["shape"], dtype=dtype, device="meta")
    return spec


def _checkpoint_tensors(model_dir: str, dtype: torch.dtype):
    from safetensors import safe_open

    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)
