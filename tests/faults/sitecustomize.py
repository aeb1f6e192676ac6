"""Faults at the outer boundary, injected into a rollout server (a process the trainer only talks
to) by tests. On PYTHONPATH of that server (and so of vLLM's worker processes it starts), Python
imports this module at start-up; each fault is off unless its variable is set:

TANDEM_TEST_DROP_WEIGHT=NAME   (tests/test_vllm.py) vLLM leaves that weight of every reload
    unloaded. The weights vLLM loads at start are untouched: only vLLM's in-place reload, the
    path of every update, is.
TANDEM_TEST_REFUSE_VERSION=N   the server refuses the first update to version N (HTTP 500), as a
    server whose engine failed mid-push does; a later update to N, forced, is taken."""

import importlib.abc
import importlib.util
import os
import sys

DROP = os.environ.get("TANDEM_TEST_DROP_WEIGHT")
REFUSE = os.environ.get("TANDEM_TEST_REFUSE_VERSION")
RUNNER = "vllm.v1.worker.gpu_model_runner"  # its reload_weights calls vLLM's in-place reload by this name
SERVING = "tandem.server.serving"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patch(module) right after the module `name` is first imported."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _drop_weight(module):
    reload = module.reload_weights

    def reload_weights(vllm_config, model, weights_iterator=None, **kwargs):
        kept = ((n, t) for n, t in weights_iterator if n != DROP)
        return reload(vllm_config, model, weights_iterator=kept, **kwargs)

    module.reload_weights = reload_weights


def _refuse_version(module):
    begin, refused = module.RolloutService.begin_update, []

    def begin_update(self, version, *args, **kwargs):
        if version == int(REFUSE) and not refused:
            refused.append(version)
            raise module.EngineFailure(f"update to version {version} refused by the test's fault (TANDEM_TEST_REFUSE_VERSION)")
        return begin(self, version, *args, **kwargs)

    module.RolloutService.begin_update = begin_update


if DROP:
    sys.meta_path.insert(0, _PatchOnImport(RUNNER, _drop_weight))
if REFUSE:
    sys.meta_path.insert(0, _PatchOnImport(SERVING, _refuse_version))
