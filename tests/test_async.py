"""Asynchronous generation and several training processes, with real processes: a `tandem rollout`
server, `tandem train` alone and under torchrun (gloo)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ENV, Server, cli_here, command, kill_server_mid_run, killed_past_step, same_collectives, train, versions_within, wait_for_step
from tandem.demo import addition_rows, write_jsonl
from tandem.trainer import checkpoint

DIGITS = "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / 4 for c in completions]\n"
CRASH = (
    "calls = [0]\n"
    "def crash_on_third_round(prompts, completions, **kw):\n"
    "    calls[0] += 1\n"
    "    if calls[0] == 3:\n"
    "        raise ZeroDivisionError('boom in round 2')\n"
    "    return [0.0] * len(completions)\n"
)


# Keeps torch busy for about two seconds per call, releasing the GIL in every op: a background
# thread still scoring when the interpreter shuts down aborts the process.
BUSY = (
    "import torch\n"
    "def busy(prompts, completions, **kw):\n"
    "    x = torch.randn(256, 256)\n"
    "    for _ in range(3000):\n"
    "        x = torch.tanh(x @ x)\n"
    "    return [float(len(c[-1]['content']) % 3) for c in completions]\n"
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("async")
    (folder / "digits.py").write_text(DIGITS)
    (folder / "crash.py").write_text(CRASH)
    (folder / "busy.py").write_text(BUSY)
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def base_args(tiny_model, data, out, batch, *extra):
    return [
        "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", out,
        "--reward_funcs", f"{data.parent / 'digits.py'}:digits", "--num_generations", "4",
        "--per_device_train_batch_size", batch, "--max_completion_length", "4", "--learning_rate", "1e-2",
        "--disable_tqdm", "true", "--num_completions_to_log", "64", *extra,
    ]  # fmt: skip


def weight_gap(a_dir, b_dir, step: int) -> float:
    """The largest difference between two runs' weights at checkpoint `step`."""
    a = load_file(a_dir / f"checkpoint-{step}" / "model.safetensors")
    b = load_file(b_dir / f"checkpoint-{step}" / "model.safetensors")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def read(out):
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return metrics, completions


@pytest.mark.parametrize("mode", ["colocate_sync", "colocate_sync_accelerate", "colocate_sync_partial", "server_sync",
                                  pytest.param("server_async", marks=pytest.mark.quick), "server_async_partial"])
def test_two_processes_train_exactly_like_one_with_twice_the_batch(tiny_model, data, server, tmp_path, mode):
    extra = ["--max_steps", "4"]
    if not mode.startswith("colocate"):
        # The server batches two ranks' requests differently from run to run, which moves the
        # last bits of the behaviour log-probs; the correction would carry them into the loss
        # (2e-5 here). Off, the losses agree to 1e-6; the correction with 2 processes is covered
        # by the resume tests.
        extra += ["--rollout_mode", "server", "--rollout_server_urls", server.url, "--off_policy_correction", "none"]
    if mode == "server_async":
        extra += ["--async_generate", "true", "--max_staleness", "1"]
    if mode == "server_async_partial":
        extra += ["--async_generate", "true"]
    if mode.endswith("partial"):  # sequences of 4 tokens in 2 passes, across versions
        extra += ["--max_staleness", "2", "--max_tokens_per_round", "2"]
    train(1, base_args(tiny_model, data, tmp_path / "one", 32, *extra))
    train(2, base_args(tiny_model, data, tmp_path / "two", 16, *extra), launcher="accelerate" if mode.endswith("accelerate") else "torchrun",
          trace=tmp_path / "trace")  # fmt: skip
    # Both ranks ran the same collectives in the same order (tandem.trainer.dist), those of the mode.
    collectives = same_collectives(tmp_path / "trace")
    assert collectives.count("gather rewards") == 4 and collectives.count("backward (gradients synced)") == 4
    assert ("barrier servers hold the run's weights" in collectives) == mode.startswith("server")
    assert ("all together: rounds ahead generated" in collectives) == mode.startswith("server_async")
    (one, one_c), (two, two_c) = read(tmp_path / "one"), read(tmp_path / "two")
    assert len(one) == len(two) == 4  # rank 0 alone writes the log
    assert [m["reward"] for m in one] == [m["reward"] for m in two]  # the same completions, gathered
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    # The first 16 completions of each round are rank 0's in both runs.
    assert [c["completion"] for c in one_c if c["round"] == 1][:16] == [c["completion"] for c in two_c if c["round"] == 1][:16]
    # Gradients are summed in a different order (two halves all-reduced vs one batch): 4 Adam
    # steps at lr 1e-2 leave differences of a few 1e-6 (measured 4e-6 to 2e-5).
    worst = weight_gap(tmp_path / "one", tmp_path / "two", 4)
    assert worst < 1e-4, worst
    if mode.endswith("partial"):  # rank 0's tokens have the same versions in both, and some sequences crossed an update
        versions = [[c["token_versions"] for c in cs if c["round"] == r][:16] for cs in (one_c, two_c) for r in range(4)]
        assert versions[:4] == versions[4:] and any(len(v) > 1 for rnd in versions for v in rnd)


def test_partial_rollouts_keep_each_token_within_max_staleness_and_a_killed_run_resumes_bitwise(tiny_model, data, server, tmp_path):
    # Completions of up to 12 tokens, 4 per engine call, so a sequence spans up to 3 versions.
    extra = ["--max_steps", "8", "--save_steps", "2", "--max_completion_length", "12", "--rollout_mode", "server", "--rollout_server_urls",
             server.url, "--async_generate", "true", "--max_staleness", "3", "--max_tokens_per_round", "4"]  # fmt: skip
    train(1, base_args(tiny_model, data, tmp_path / "whole", 16, *extra))
    metrics, completions = read(tmp_path / "whole")
    for c in completions:  # every token of round r is of a version in [r - 3, r - 1] (round 0: 0), in order
        versions = [v for v, _ in c["token_versions"]]
        assert sum(n for _, n in c["token_versions"]) == c["completion_tokens"] and versions == sorted(versions)
        assert versions_within(c, 3), (c["round"], c["token_versions"])
        assert c["policy_version"] == versions[0]
    assert any(len(c["token_versions"]) == 3 for c in completions)
    assert all(m["staleness/max"] <= 3 for m in metrics) and max(m["partial_rollouts/crossed_update"] for m in metrics) > 0.5
    assert all(0 < m["engine/occupancy"] <= 1 for m in metrics if "engine/occupancy" in m)
    # Round 0, all of version 0 in two calls: a sequence continued from its tokens (prefilled
    # again) has the log-probs the trainer recomputes, to the last bits.
    assert metrics[0]["kl_behav_proximal"] < 1e-9
    out = tmp_path / "killed"
    latest = killed_past_step(base_args(tiny_model, data, out, 16, *extra), out, 3)
    in_flight = json.loads((latest / "in_flight_0.json").read_text())  # sequences cut short, saved with their tokens' versions
    assert any(0 < len(t["ids"]) < 12 and t["finish"] is None for f in in_flight["flights"] for t in f["seqs"])
    train(1, base_args(tiny_model, data, out, 16, *extra, "--resume_from_checkpoint", "latest"))
    resumed, resumed_c = read(out)
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in metrics] and [m["reward"] for m in resumed] == [m["reward"] for m in metrics]
    assert [c["token_versions"] for c in resumed_c] == [c["token_versions"] for c in completions]
    assert weight_gap(tmp_path / "whole", out, 8) == 0.0


def test_partial_rollouts_without_a_background_thread_make_the_async_run_and_resume_exactly_colocated(tiny_model, data, server, tmp_path):
    # In sync mode (a server, or colocated) the trainer's request for a round first runs the
    # calls of the live version: the rounds, versions and tokens of the async run, bit for bit.
    # Colocated, those tokens are of older weights too, so the behaviour log-probs go into the loss.
    partial = ["--max_steps", "6", "--max_completion_length", "12", "--max_staleness", "3", "--max_tokens_per_round", "4"]
    served = ["--rollout_mode", "server", "--rollout_server_urls", server.url]
    train(1, base_args(tiny_model, data, tmp_path / "async", 16, *partial, *served, "--async_generate", "true"))
    train(1, base_args(tiny_model, data, tmp_path / "sync", 16, *partial, *served))
    (a, a_c), (b, b_c) = read(tmp_path / "async"), read(tmp_path / "sync")
    assert [c["token_versions"] for c in a_c] == [c["token_versions"] for c in b_c] and any(len(c["token_versions"]) > 1 for c in a_c)
    assert [c["completion"] for c in a_c] == [c["completion"] for c in b_c]
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and weight_gap(tmp_path / "async", tmp_path / "sync", 6) == 0.0
    out = tmp_path / "colocated"
    train(1, base_args(tiny_model, data, out, 16, *partial, "--save_steps", "3"))
    whole, whole_c = read(out)
    for c in whole_c:
        assert versions_within(c, 3), (c["round"], c["token_versions"])
    assert any(len(c["token_versions"]) > 1 for c in whole_c) and max(m["staleness/max"] for m in whole) == 3
    assert all("kl_behav_proximal" in m for m in whole)
    in_flight = json.loads((out / "checkpoint-3" / "in_flight_0.json").read_text())
    assert any(t["finish"] is None and t["ids"] for f in in_flight["flights"] for t in f["seqs"])
    final = load_file(out / "checkpoint-6" / "model.safetensors")
    train(1, base_args(tiny_model, data, out, 16, *partial, "--save_steps", "3", "--resume_from_checkpoint", out / "checkpoint-3"))
    resumed, resumed_c = read(out)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole] and [c["completion"] for c in resumed_c] == [c["completion"] for c in whole_c]
    again = load_file(out / "checkpoint-6" / "model.safetensors")
    assert all((final[k] == again[k]).all() for k in final)


FAULTS = Path(__file__).parent / "faults"  # faults injected into a rollout server (its sitecustomize.py)


@pytest.mark.parametrize("procs", [1, 2])
def test_a_partial_rollouts_run_whose_push_fails_saves_what_it_trained_and_resumes_as_if_nothing_happened(tiny_model, data, server, tmp_path, procs):
    # The push of version 4 (after step 4) is refused once. The checkpoint saved then held weights
    # of v4 with the sequences in flight as of v2 (the live version's - 1): resumed, round 4's
    # token versions were [[1,4],[2,4],[4,4]] where they are [[1,4],[2,4],[3,4]]. With 2
    # processes nothing was saved: the steps since checkpoint-3 were lost.
    extra = ["--max_steps", "7", "--save_steps", "3", "--max_completion_length", "12", "--rollout_mode", "server", "--async_generate", "true",
             "--max_staleness", "3", "--max_tokens_per_round", "4"]  # fmt: skip
    batch = 16 // procs
    train(procs, base_args(tiny_model, data, tmp_path / "whole", batch, *extra, "--rollout_server_urls", server.url))
    faulty = Server(tiny_model, env={**ENV, "PYTHONPATH": str(FAULTS), "TANDEM_TEST_REFUSE_VERSION": "4"})
    out = tmp_path / "failed"
    args = base_args(tiny_model, data, out, batch, *extra, "--rollout_server_urls", faulty.url)
    try:
        failed = cli_here("train", *args) if procs == 1 else subprocess.run(command(procs, args), capture_output=True, text=True, env=ENV, timeout=300)
        assert failed.returncode == 1, failed.stderr[-3000:]
        assert "refused by the test's fault" in failed.stderr and "tandem: trained 4 of 7 steps; checkpoint saved at step 4" in failed.stderr, failed.stderr[-3000:]
        if procs == 2:  # process 1 says one line
            assert "tandem: process 1 stopped with the run: another training process's weight push failed" in failed.stderr
        assert checkpoint.resolve("latest", out) == out / "checkpoint-4"
        train(procs, [*args, "--resume_from_checkpoint", "latest"])  # the server takes version 4 this time
    finally:
        faulty.stop()
    (whole, whole_c), (resumed, resumed_c) = read(tmp_path / "whole"), read(out)
    assert [m["step"] for m in resumed] == list(range(1, 8))
    assert [c["token_versions"] for c in resumed_c] == [c["token_versions"] for c in whole_c]
    assert [m["reward"] for m in resumed] == [m["reward"] for m in whole]
    if procs == 1:
        assert [m["loss"] for m in resumed] == [m["loss"] for m in whole] and weight_gap(tmp_path / "whole", out, 7) == 0.0
    else:  # two ranks' requests are batched differently from run to run (see test_resume)
        assert weight_gap(tmp_path / "whole", out, 7) < 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_two_processes_equal_one_with_accumulation_and_several_iterations(tiny_model, data, tmp_path, loss_type):
    # Two micro-batches per optimizer step (gradient_accumulation_steps 2) and two passes over each
    # round (num_iterations 2), so the second step of a round recomputes the proximal log-probs.
    extra = ["--max_steps", "4", "--loss_type", loss_type, "--gradient_accumulation_steps", "2",
             "--steps_per_generation", "2", "--num_iterations", "2", "--save_steps", "0"]  # fmt: skip
    train(1, base_args(tiny_model, data, tmp_path / "one", 16, *extra))
    train(2, base_args(tiny_model, data, tmp_path / "two", 8, *extra))
    (one, _), (two, _) = read(tmp_path / "one"), read(tmp_path / "two")
    assert [m["round"] for m in one] == [0, 0, 1, 1]
    assert [m["reward"] for m in one] == [m["reward"] for m in two]
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    worst = weight_gap(tmp_path / "one", tmp_path / "two", 4)
    assert worst < 1e-4, worst


def test_max_staleness_one_uses_version_r_minus_1_or_r(tiny_model, data, server, tmp_path):
    args = base_args(tiny_model, data, tmp_path / "run", 16, "--max_steps", "6", "--rollout_mode", "server",
                     "--rollout_server_urls", server.url, "--async_generate", "true", "--max_staleness", "1")  # fmt: skip
    train(1, args)
    metrics, completions = read(tmp_path / "run")
    pairs = {(c["round"], c["policy_version"]) for c in completions}
    assert all(r - 1 <= v <= r for r, v in pairs), sorted(pairs)
    assert any(v == r - 1 for r, v in pairs), "with max_staleness 1 the next round overlaps the current one"
    assert all(m["staleness/max"] <= 1 for m in metrics)


def test_importance_weights_reach_the_loss_of_a_real_run(tiny_model, data, server, tmp_path):
    # Round 1 is generated with version 0 and trained at version 1. With the correction off the
    # weights are 1, as if the behaviour log-probs were the proximal ones: the loss must differ.
    # Round 0 is on-policy in both runs (the server computes in fp32 like the trainer): same loss.
    common = ["--max_steps", "2", "--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true",
              "--max_staleness", "1", "--save_steps", "0"]  # fmt: skip
    train(1, base_args(tiny_model, data, tmp_path / "on", 16, *common, "--off_policy_correction", "token_truncate"))
    train(1, base_args(tiny_model, data, tmp_path / "off", 16, *common, "--off_policy_correction", "none"))
    (on, _), (off, _) = read(tmp_path / "on"), read(tmp_path / "off")
    assert [m["reward"] for m in on] == [m["reward"] for m in off]  # the same completions
    # Measured: step 1 losses 4e-9 and -7e-9; step 2 0.0096 (weights 0.56 to 1.59) against -6e-9.
    assert on[0]["loss"] == pytest.approx(off[0]["loss"], abs=1e-6)
    assert abs(on[1]["loss"] - off[1]["loss"]) > 1e-3
    assert on[1]["kl_behav_proximal"] > 100 * on[0]["kl_behav_proximal"]


def test_async_with_max_staleness_zero_equals_sync(tiny_model, data, server, tmp_path):
    common = ["--max_steps", "4", "--rollout_mode", "server", "--rollout_server_urls", server.url]
    train(1, base_args(tiny_model, data, tmp_path / "sync", 16, *common))
    train(1, base_args(tiny_model, data, tmp_path / "async0", 16, *common, "--async_generate", "true", "--max_staleness", "0"))
    sync, async0 = read(tmp_path / "sync")[0], read(tmp_path / "async0")[0]
    assert [m["loss"] for m in sync] == [m["loss"] for m in async0]
    assert [m["reward"] for m in sync] == [m["reward"] for m in async0]


def test_an_async_run_ends_with_its_background_thread_idle_and_exits_0(tiny_model, data, server, tmp_path):
    # A 2-process async run used to abort after its last step now and then ("terminate called
    # without an active exception", SIGABRT): the producer thread was still generating and
    # scoring rounds past the last when the interpreter shut down. With a reward function that
    # keeps torch busy, that happened on every run; now no round past the last is generated.
    args = base_args(tiny_model, data, tmp_path / "run", 16, "--max_steps", "2", "--rollout_mode", "server",
                     "--rollout_server_urls", server.url, "--async_generate", "true", "--max_staleness", "1",
                     "--reward_funcs", f"{data.parent / 'busy.py'}:busy", "--save_steps", "0")  # fmt: skip
    proc = subprocess.run(command(2, args), capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


def test_a_reward_crash_in_the_background_reaches_the_trainer(tiny_model, data, server, tmp_path):
    args = base_args(tiny_model, data, tmp_path / "run", 16, "--max_steps", "10", "--rollout_mode", "server",
                     "--rollout_server_urls", server.url, "--async_generate", "true",
                     "--reward_funcs", f"{data.parent / 'crash.py'}:crash_on_third_round")  # fmt: skip
    proc = cli_here("train", *args, timeout=120)
    assert proc.returncode != 0
    assert "reward function 'crash_on_third_round' raised ZeroDivisionError: boom in round 2" in proc.stderr


@pytest.mark.parametrize("procs, mode", [(1, "sync"), (1, "async"), (2, "sync"), (2, "async")])
def test_killing_the_server_stops_every_process_with_an_error_naming_it(tiny_model, data, tmp_path, procs, mode):
    server = Server(tiny_model)
    out = tmp_path / f"killed-{procs}-{mode}"
    args = base_args(tiny_model, data, out, 16, "--max_steps", "100000", "--rollout_mode", "server",
                     "--rollout_server_urls", server.url, "--rollout_server_timeout", "5",
                     "--async_generate", "true" if mode == "async" else "false")  # fmt: skip
    trainer = subprocess.Popen(command(procs, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    # rollout_server_timeout (5 s) of retries, plus the error path and torchrun's shutdown
    stderr, waited = kill_server_mid_run(server, trainer, out, step=2, timeout=60)
    assert trainer.returncode != 0
    assert f"rollout server {server.url}" in stderr and "rollout_server_timeout=5.0s" in stderr, stderr[-3000:]
    assert waited < 60
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes still running: {leftovers}"


def test_killing_the_launcher_ends_its_workers_and_no_second_trainer_runs_in_their_folder_meanwhile(tiny_model, data, tmp_path):
    # torchrun SIGKILLed alone left its workers training (all 200 steps), and a resume into their
    # folder was not refused while they ran.
    out = tmp_path / "run"
    trainer = subprocess.Popen(command(2, base_args(tiny_model, data, out, 8, "--max_steps", "100000", "--save_steps", "1")),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        wait_for_step(out, 2, trainer)
        second = cli_here("train", *base_args(tiny_model, data, out, 16, "--max_steps", "4", "--resume_from_checkpoint", "latest"))
        assert second.returncode == 2 and f"output_dir={out} is in use by a trainer that still runs (pid " in second.stderr, second.stderr[-2000:]
        trainer.kill()  # torchrun alone
        _, stderr = trainer.communicate(timeout=30)  # its stderr ends once its workers are gone too
    finally:
        if trainer.poll() is None:
            trainer.kill()
    deadline = time.monotonic() + 15
    while (left := subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"workers still running: {left}"
    assert stderr.count("its launcher (torchrun or accelerate launch) is gone; it ends too") == 2, stderr[-2000:]
    checkpoint.RunFolderLock(out).release()  # theirs went with them


def test_a_failing_trainer_exits_within_seconds_while_a_stopped_server_holds_its_request(tiny_model, data, server, tmp_path):
    # The client's request threads were an executor's, which Python joins at exit: a trainer that
    # failed while a server held its request lived on for rollout_request_timeout (here 120 s).
    out = tmp_path / "run"
    args = base_args(tiny_model, data, out, 16, "--max_steps", "1000", "--rollout_mode", "server", "--rollout_server_urls", server.url,
                     "--async_generate", "true", "--rollout_request_timeout", "120")  # fmt: skip
    # SIGINT as a terminal delivers it: a suite started in the background (`.ci/run &`) hands its
    # processes SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    trainer = subprocess.Popen(command(1, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**ENV, "PYTHONFAULTHANDLER": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        wait_for_step(out, 2, trainer)
        os.kill(server.proc.pid, signal.SIGSTOP)  # from now on every request is held
        time.sleep(1.0)  # the producer's next request is in flight
        trainer.send_signal(signal.SIGINT)  # the trainer fails: a user's Ctrl-C
        start = time.monotonic()
        try:
            _, stderr = trainer.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # faulthandler prints where each thread waits (seen once in CI, not since)
            trainer.send_signal(signal.SIGABRT)
            _, stderr = trainer.communicate(timeout=30)
            raise AssertionError(f"the trainer did not exit within 60s of SIGINT; its threads:\n{stderr[-12000:]}") from None
        took = time.monotonic() - start
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode != 0 and "KeyboardInterrupt" in stderr, stderr[-2000:]
    assert took < 15, f"the trainer took {took:.0f}s to exit"


def test_a_second_run_on_a_server_another_run_holds_is_refused_at_start_naming_it(tiny_model, data, server, tmp_path):
    # Two runs' pushes used to interleave until one died on a 409 after its first step, having
    # saved a useless checkpoint-0 and advised restarting the server.
    served = ["--rollout_mode", "server", "--rollout_server_urls", server.url]
    busy = ["--reward_funcs", f"{data.parent / 'busy.py'}:busy"]  # about 2 s a round: the first run is still on when the second starts
    first = subprocess.Popen(command(1, base_args(tiny_model, data, tmp_path / "first", 16, "--max_steps", "4", *served, *busy)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        wait_for_step(tmp_path / "first", 1, first)
        second = cli_here("train", *base_args(tiny_model, data, tmp_path / "second", 16, "--max_steps", "2", *served))
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-2000:]
    assert second.returncode == 1
    assert f"rollout server {server.url} refused this run's claim on it (POST /run): HTTP 409: this server serves the run in {tmp_path / 'first'} on" in second.stderr, second.stderr[-2000:]
    assert "restart the rollout server" not in second.stderr and not (tmp_path / "second" / "checkpoint-0").exists()
    assert [m["step"] for m in read(tmp_path / "first")[0]] == [1, 2, 3, 4]  # the first run never noticed
    # The first run let the server go at its end: the next run gets it.
    train(1, base_args(tiny_model, data, tmp_path / "third", 16, "--max_steps", "1", *served))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_stops_every_rank_within_seconds_with_a_checkpoint(tiny_model, data, server, tmp_path, mode):
    # What a scheduler sends before it preempts a job: it killed every rank at once, with no save.
    out = tmp_path / "run"
    args = base_args(tiny_model, data, out, 16, "--max_steps", "1000", "--save_steps", "1000", "--rollout_mode", "server",
                     "--rollout_server_urls", server.url, "--async_generate", "true" if mode == "async" else "false")  # fmt: skip
    trainer = subprocess.Popen(command(2, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_step(out, 3, trainer)
        trainer.send_signal(signal.SIGTERM)  # to torchrun, which passes it to every rank
        start = time.monotonic()
        _, stderr = trainer.communicate(timeout=90)
        took = time.monotonic() - start
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode != 0 and took < 30, (trainer.returncode, took, stderr[-2000:])
    assert "stopped by SIGTERM after step" in stderr and f"resume with --resume_from_checkpoint latest --output_dir {out}" in stderr, stderr[-3000:]
    step = len(read(out)[0])
    assert step >= 3 and checkpoint.resolve("latest", out) == out / f"checkpoint-{step}"  # whole, at the last step logged


# A reward function that answers its first call, then hangs (a judge that stopped answering).
HANGS_AFTER_ONE = "import time\ncalls = []\ndef judge(prompts, completions, **kw):\n    calls.append(1)\n    if len(calls) > 1:\n        time.sleep(3600)\n    return [0.5] * len(completions)\n"


@pytest.mark.parametrize("how", ["past sigterm_timeout", "a second SIGTERM", "before any checkpoint"])
def test_sigterm_ends_a_stuck_round_within_its_bound_with_143_and_the_last_checkpoint(tiny_model, data, tmp_path, how):
    # The round after step 1 (or the first round) waits on a reward function without timeout
    # (reward_timeout none). A SIGTERM used to wait for it forever (or reward_timeout, 600 s by
    # default), a second one was ignored, and the exit code was then 2. With no checkpoint yet,
    # the message said to resume from latest, which is refused.
    first = how == "before any checkpoint"
    hangs = HANGS_AFTER_ONE.replace("    if len(calls) > 1:", f"    if len(calls) > 0:\n        open({str(tmp_path / 'called')!r}, 'w').close()")
    (tmp_path / "judge.py").write_text(hangs if first else HANGS_AFTER_ONE)
    out = tmp_path / "run"
    args = base_args(tiny_model, data, out, 16, "--max_steps", "10", "--save_steps", "1", "--reward_funcs", f"{tmp_path / 'judge.py'}:judge",
                     "--reward_timeout", "none", "--sigterm_timeout", "300" if how == "a second SIGTERM" else "4")  # fmt: skip
    trainer = subprocess.Popen(command(1, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        if first:  # into round 0's reward
            while not (tmp_path / "called").exists():
                assert trainer.poll() is None, trainer.communicate()[1][-2000:]
                time.sleep(0.05)
        else:
            wait_for_step(out, 1, trainer)
            time.sleep(1)  # into round 1's reward
        start = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        if how == "a second SIGTERM":
            time.sleep(0.5)
            trainer.send_signal(signal.SIGTERM)
        _, stderr = trainer.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 143 and took < (5 if how == "a second SIGTERM" else 15), (trainer.returncode, took, stderr[-2000:])
    why = "a second SIGTERM came" if how == "a second SIGTERM" else "the round in flight did not end within sigterm_timeout=4s"
    assert f"tandem: stopped by SIGTERM: {why}" in stderr, stderr[-2000:]
    if first:
        assert "there is no checkpoint yet: start the run again" in stderr and "resume" not in stderr, stderr[-2000:]
        return
    assert f"latest still names checkpoint-1: resume with --resume_from_checkpoint latest --output_dir {out}" in stderr, stderr[-2000:]
    assert checkpoint.resolve("latest", out) == out / "checkpoint-1"


def test_async_generate_needs_server_mode(tiny_model, data, tmp_path):
    proc = cli_here("train", *base_args(tiny_model, data, tmp_path / "x", 16, "--async_generate", "true"))
    assert proc.returncode == 2 and "async_generate" in proc.stderr and "rollout_mode: server" in proc.stderr

