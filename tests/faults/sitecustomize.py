"""A fault at the outer boundary, for tests/test_vllm.py: vLLM leaves one weight of every reload
unloaded. On PYTHONPATH of a rollout server (and so of vLLM's worker processes it starts), with
TANDEM_TEST_DROP_WEIGHT naming the weight; Python imports this module at start-up. The weights
vLLM loads at start are untouched: only vLLM's in-place reload, the path of every update, is."""

import importlib.abc
import importlib.util
import os
import sys

DROP = os.environ.get("TANDEM_TEST_DROP_WEIGHT")
RUNNER = "vllm.v1.worker.gpu_model_runner"  # its reload_weights calls vLLM's in-place reload by this name


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUNNER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            reload = module.reload_weights

            def reload_weights(vllm_config, model, weights_iterator=None, **kwargs):
                kept = ((n, t) for n, t in weights_iterator if n != DROP)
                return reload(vllm_config, model, weights_iterator=kept, **kwargs)

            module.reload_weights = reload_weights

        spec.loader.exec_module = exec_module
        return spec


if DROP:
    sys.meta_path.insert(0, _PatchOnImport())
