"""Runs inside vLLM's worker processes (vLLM's `worker_extension_cls`): loads a weight update."""

import logging

from tandem.rollout.weights import open_sealed_memfd, parse_safetensors


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
