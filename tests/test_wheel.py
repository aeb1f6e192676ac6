"""The package as users install it: a wheel in a fresh virtual environment, away from the source tree."""

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_runs_from_an_installed_wheel(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, REPO],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("tandem_rl-*.whl"))

    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # without pip of its own (3 s): this environment's pip installs into it
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies (torch, transformers, ...) come from this environment's site-packages, put
    # on the new one's path as a plain folder: its .pth files, the editable install of tandem
    # among them, are not read, so `tandem` can only come from the wheel.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    where = subprocess.run([python, "-c", "import tandem; print(tandem.__file__)"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.stdout.startswith(site), where.stdout + where.stderr  # the wheel's copy, not the source tree
    demo = subprocess.run([env_dir / "bin" / "tandem", "demo", "--max_steps", "5", "--output_dir", tmp_path / "demo"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert len((tmp_path / "demo" / "run" / "metrics.jsonl").read_text().splitlines()) == 5
