"""Every command in README.md and docs/*.md runs as a reader would run it.

Each page's ```bash blocks are joined, in order, into one bash script (set -euo pipefail) that
runs in a fresh folder holding `examples/`, links `.venv` and `.venv-vllm` to the running
environment, and, for every page but the README, a copy of the demo's output `runs/demo/`
(made by running the README's own block). A command ending in `&` (a rollout server) runs in
the background, and the page's whole process group is killed when the script ends. Two things
change before a script runs, and no more: each port 80xx becomes a free port, and a line that
`.ci/run` runs itself (`./setup.sh`, the test command) is checked to be in `.ci/run` and left out.

Blocks that need the vLLM environment (`.venv-vllm/...`) run in `test_vllm_blocks`, which gives
them the demo's data alone, as `tandem demo` writes it: they train a model of their own, and the
vLLM suite need not run the 400-step demo again. A block
that cannot run on this machine sits right after a `<!-- not run: REASON -->` comment; the
reason is required.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import free_port, needs_vllm
from tandem.demo import addition_rows, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The commands .ci/run runs, each line without the `phase "NAME"` (or `alongside "NAME"`) that times it.
CI_LINES = {re.sub(r'^(?:phase|alongside) "[^"]*" (?:nice -n \d+ )?', "", line.strip()) for line in (ROOT / ".ci" / "run").read_text().splitlines()}
FENCE = re.compile(r"(?:<!-- not run: (?P<reason>[^>]*?) -->\s*\n)?```bash\n(?P<body>.*?)```", re.S)
VLLM_ENV = ".venv-vllm/"


def _blocks(page: Path) -> list[str]:
    """The page's runnable bash blocks; a skipped block without a reason fails the test."""
    runnable = []
    for match in FENCE.finditer(page.read_text()):
        if match["reason"] is None:
            runnable.append(match["body"])
        else:
            assert match["reason"].strip(), f"{page.name}: a skipped block needs its reason"
    return runnable


def _script(blocks: list[str]) -> str:
    """The blocks as one script: lines `.ci/run` runs itself left out, ports 8000-8099 made free ones."""
    lines = []
    for line in "\n".join(blocks).splitlines():
        command = line.split(" #", 1)[0].strip()
        if command.startswith("./setup.sh") or "-m pytest" in command:
            assert command in CI_LINES, f"{command!r} is in the docs but .ci/run does not run it"
            continue
        lines.append(line)
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    ports = {p: str(free_port()) for p in set(re.findall(r"\b80\d\d\b", script))}
    return re.sub(r"\b80\d\d\b", lambda m: ports[m[0]], script)


def _run_page(blocks: list[str], cwd: Path, timeout: int = 900) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with tempfile.TemporaryFile(mode="w+") as log:  # a file: the background servers keep a pipe open
        proc = subprocess.Popen(["bash", "-c", _script(blocks)], cwd=cwd, env=env, text=True,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the page's background servers
            proc.wait()
        log.seek(0)
        out = log.read()
    assert proc.returncode == 0, out[-6000:]
    return out


def _folder(path: Path, demo: Path | None) -> Path:
    path.mkdir(parents=True)
    shutil.copytree(ROOT / "examples", path / "examples")
    for venv in (".venv", ".venv-vllm"):
        (path / venv).symlink_to(sys.prefix)
    if demo is not None:
        shutil.copytree(demo, path / "runs" / "demo")
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The README's own commands, run: they make the demo's model, data and run."""
    cwd = _folder(tmp_path_factory.mktemp("readme") / "page", None)
    _run_page(_blocks(ROOT / "README.md"), cwd)
    return cwd / "runs" / "demo"


def test_readme_block_trains_the_demo_and_its_reward_rises(demo):
    # Measured (400 steps, seed 0): first-10-step mean 0.21-0.23, last-10 0.79-0.81. The
    # threshold leaves a wide margin for other machines' numerics.
    rewards = [json.loads(line)["reward"] for line in (demo / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 400
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.3
    assert (demo / "run" / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "docs"], ids=lambda p: p.name)
def test_page_commands_run(page, demo, tmp_path):
    blocks = [b for b in _blocks(page) if VLLM_ENV not in b]
    if not blocks:
        pytest.skip(f"{page.name} has no command this environment runs")
    _run_page(blocks, _folder(tmp_path / "page", demo))


@pytest.mark.parametrize("env", [pytest.param("vllm", marks=needs_vllm)])
def test_vllm_blocks(tmp_path, env):
    blocks = [b for page in PAGES for b in _blocks(page) if VLLM_ENV in b]
    assert blocks, "the docs show no vLLM command"
    data_only = write_jsonl(addition_rows(0), tmp_path / "demo" / "addition.jsonl").parent  # as `tandem demo` (seed 0) writes it
    _run_page(blocks, _folder(tmp_path / "page", data_only))


@pytest.mark.quick
def test_every_page_is_linked_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link {page.name}"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"
