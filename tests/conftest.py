import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cli(*args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """The real `tandem` command in a separate process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model written by `tandem init-model`."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    proc = run_cli("init-model", out, "--size", "tiny")
    assert proc.returncode == 0, proc.stderr
    return out
