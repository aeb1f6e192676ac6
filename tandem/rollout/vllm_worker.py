"""Runs inside vLLM's worker processes (vLLM's `worker_extension_cls`): loads a weight update,
and makes the worker and its engine core die with the rollout server."""

import logging
import os
import select
import signal
import threading

from tandem.rollout.weights import open_sealed_memfd, parse_safetensors

SERVER_PID = "TANDEM_ROLLOUT_PID"  # set by VLLMEngine before vLLM starts its processes


class WeightLoader:
    """Mixed into vLLM's worker class; the engine calls it by name through collective_rpc."""

    def tandem_load_weights(self, path: str) -> int:
        tensors = parse_safetensors(open_sealed_memfd(path))
        # vLLM's layer-wise in-place reload: each layer's weights are loaded in checkpoint format,
        # then fused, sharded and repacked as at start; tensors keep their storage (CUDA graphs
        # hold pointers to it). A plain model.load_weights fails on repacked CPU weights.
        # A head tied to the embedding has no tensor of its own, which the reload reports as a
        # warning ("ParallelLMHead: Failed to load weights") at every update; the weight it
        # shares is loaded, and repacked below.
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level, quiet.level = quiet.level, logging.ERROR
        try:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        finally:
            quiet.setLevel(level)
        _repack_tied_heads(self.model_runner.get_model())
        return len(tensors)


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
