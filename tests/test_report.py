"""report_to through the real CLI: TensorBoard's event files read back with TensorBoard's own
reader, W&B's offline run folder, and a tracker whose package is missing."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import cli_here
from tandem.demo import addition_rows, write_jsonl
from test_async import DIGITS, base_args

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    (folder / "digits.py").write_text(DIGITS)
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_metric_at_the_steps_of_metrics_jsonl(tiny_model, data, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = cli_here("train", *base_args(tiny_model, data, out, 32, "--max_steps", "3", "--report_to", "tensorboard"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = metrics(out)
    events = EventAccumulator(str(out / "tandem"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for key in ("reward", "loss", "time/generate", "completions/mean_length", "policy_version"):
        assert key in tags, (key, tags)
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [m["step"] for m in logged]
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in logged], rel=1e-6)  # stored as float32
    # The logged completions, as a Markdown table in the text tab, at the steps they were logged.
    (text,) = [t for t in events.Tags()["tensors"] if t.startswith("completions")]
    first = events.Tensors(text)[0]
    table = first.tensor_proto.string_val[0].decode()
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert first.step == completions[0]["step"] and table.startswith("| step | round | prompt | completion |")
    assert len(table.splitlines()) == 2 + sum(c["step"] == first.step for c in completions)


def test_wandb_offline_writes_its_run_folder_with_the_metrics(tiny_model, data, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = cli_here("train", *base_args(tiny_model, data, out, 32, "--max_steps", "3", "--report_to", "wandb"))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    # W&B's offline format has no Python reader; its history records hold each key and each
    # value as JSON text, so every logged loss appears in the file as json.dumps writes it.
    # wandb.finish() returns before W&B's own service process has written the records (seen
    # once: the file held its 8-byte header when read, all 18 kB a moment later), so wait for them.
    wanted = [b"completions/mean_length", b"completions", *(json.dumps(m["loss"]).encode() for m in metrics(out))]
    deadline = time.monotonic() + 60
    while not all(w in (raw := runs[0].read_bytes()) for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    for w in wanted:
        assert w in raw, (w, len(raw))


def test_wandb_without_an_account_is_one_line_naming_login_and_offline(tiny_model, data, tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path), "NETRC": str(tmp_path / "none")}
    args = map(str, base_args(tiny_model, data, tmp_path / "run", 32, "--report_to", "wandb"))
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "train", *args],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "no W&B API key is configured: run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline" in proc.stderr


@pytest.mark.parametrize(
    "report_to, message",
    [
        pytest.param(["trackio"], "report_to=['trackio']: needs the trackio package: pip install trackio",
                     marks=pytest.mark.skipif(importlib.util.find_spec("trackio") is not None, reason="trackio is installed here")),
        (["tensorbord"], "report_to=['tensorbord']: ['tensorbord'] unknown; give any of ['tensorboard', 'trackio', 'wandb'], or none"),
        (["none", "wandb"], "none cannot be combined"),
    ],
)
def test_a_tracker_that_cannot_work_fails_before_training_naming_the_fix(tiny_model, data, tmp_path, report_to, message):
    proc = cli_here("train", *base_args(tiny_model, data, tmp_path / "run", 32, "--max_steps", "1", "--report_to", *report_to))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def run(tiny_model, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    proc = cli_here("train", *base_args(tiny_model, data, out, 32, "--max_steps", "3", "--num_completions_to_log", "8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_plot_writes_a_png_of_one_run_or_several_overlaid(run, tmp_path):
    pytest.importorskip("matplotlib")
    proc = cli_here("plot", run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = run / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    proc = cli_here("plot", run, run, "--smooth", "2", "--out", tmp_path / "both.png")
    assert proc.returncode == 0 and (tmp_path / "both.png").stat().st_size > 20_000, proc.stderr[-2000:]
    proc = cli_here("plot", tmp_path / "nothing")
    assert proc.returncode == 2 and "has no metrics.jsonl" in proc.stderr


def test_plot_panels_find_per_function_rewards_and_smooth_skips_missing_values():
    from tandem.plot import _keys, smooth

    records = [{"reward": 1.0, "rewards/a/mean": 0.5, "rewards/a/std": 0.1, "rewards/b/mean": 0.2}]
    assert _keys("rewards/*/mean", records) == ["rewards/a/mean", "rewards/b/mean"]
    assert _keys("kl", records) == []
    assert smooth([1.0, None, 3.0, float("nan"), 5.0], 2) == [1.0, 1.0, 3.0, 3.0, 5.0]


def test_show_prints_the_logged_completions_of_a_step(run):
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    last = max(line["step"] for line in logged)
    proc = cli_here("show", run, "--width", "400")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = proc.stdout.splitlines()
    assert rows[0].startswith(f"step {last}, round ") and "digits" in rows[1]
    shown = [line for line in logged if line["step"] == last]
    assert len(rows) == 2 + len(shown)
    for row, line in zip(rows[2:], shown):
        assert f"{line['advantage']:+.3f}" in row and "".join(c if c.isprintable() else repr(c)[1:-1] for c in line["completion"]) in row
    proc = cli_here("show", run, "--step", "99")
    assert proc.returncode == 2 and "no completions logged at step 99" in proc.stderr


def test_show_into_a_pipe_its_reader_closed_exits_0(run, monkeypatch):
    # `tandem show RUN | head -8` (docs/multi-turn.md): head may exit before show writes, and
    # show then raised BrokenPipeError, which failed the page under `set -o pipefail`.
    from tandem.cli import main

    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert main(["show", str(run)]) == 0
