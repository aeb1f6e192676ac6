"""End to end through the real `tandem` command: train, checkpoint, reload; the demo learns."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import cli_here
from tandem.demo import addition_rows, write_jsonl

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole

METRIC_FIELDS = [
    "step", "loss", "grad_norm", "learning_rate", "kl", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "reward", "reward_std", "rewards/exact_match/mean", "rewards/exact_match/std",
    "rewards/digit_fraction/mean", "rewards/digit_fraction/std",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/truncated_ratio",
    "completion_tokens_per_second", "time/generate", "time/reward", "time/train", "time/weight_sync", "policy_version",
]  # fmt: skip


# A random model never answers right: this user reward (loaded from a file, as users do) gives
# every completion partial credit, so advantages are non-zero from the first step.
DIGITS_REWARD = """
def digit_fraction(prompts, completions, **kwargs):
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    (folder / "digits.py").write_text(DIGITS_REWARD)
    return write_jsonl(addition_rows(0), folder / "addition.jsonl")


def _run(tiny_model, data, out, *extra):
    return cli_here(
        "train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", out,
        "--reward_funcs", "exact_match", f"{data.parent / 'digits.py'}:digit_fraction", "--reward_weights", "1.0", "0.5",
        "--num_generations", "4", "--per_device_train_batch_size", "16", "--max_completion_length", "6",
        "--learning_rate", "1e-2", "--disable_tqdm", "true", *extra,
    )  # fmt: skip


def _train(tiny_model, data, out, *extra):
    proc = _run(tiny_model, data, out, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_completions_and_loadable_checkpoints(tiny_model, data, tmp_path):
    out = tmp_path / "run"
    metrics = _train(tiny_model, data, out, "--max_steps", "3", "--save_steps", "2")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        missing = [f for f in METRIC_FIELDS if f not in m]
        assert not missing, missing
        assert math.isfinite(m["loss"]) and math.isfinite(m["entropy"])
    assert metrics[-1]["policy_version"] == 3

    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert completions and {"prompt", "completion", "reward", "advantage", "finish_reason"} <= set(completions[0])

    assert (out / "latest").read_text().strip() == "checkpoint-3"
    assert (out / "checkpoint-2").is_dir()
    ckpt = out / "checkpoint-3"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    AutoTokenizer.from_pretrained(ckpt)
    assert (ckpt / "config.yaml").is_file()
    before = load_file(tiny_model / "model.safetensors")
    after = load_file(ckpt / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "training should move most weight tensors"
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_resume_drops_a_torn_last_log_line_and_says_so(tiny_model, data, tmp_path):
    # A write cut short (a kill mid-line, a full disk, power loss) leaves a last line that is not
    # JSON; every resume used to stop on it with a JSONDecodeError.
    out = tmp_path / "run"
    first = _train(tiny_model, data, out, "--max_steps", "2", "--save_steps", "1")
    for log in ("metrics.jsonl", "completions.jsonl"):
        with open(out / log, "a") as fh:
            fh.write('{"step": 3, "loss": 0.12')
    proc = _run(tiny_model, data, out, "--max_steps", "2", "--save_steps", "1", "--resume_from_checkpoint", out / "checkpoint-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{out / 'metrics.jsonl'}: dropped its last line, cut short" in proc.stderr
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [1, 2] and resumed[1]["loss"] == first[1]["loss"]
    assert all(json.loads(line)["step"] <= 2 for line in (out / "completions.jsonl").read_text().splitlines())


def test_a_second_run_into_a_run_folder_is_refused_unless_it_resumes_or_overwrites(tiny_model, data, tmp_path):
    out = tmp_path / "run"
    first = _train(tiny_model, data, out, "--max_steps", "2", "--save_steps", "1")
    before = (out / "metrics.jsonl").read_text()
    # Appending would log steps 1, 2, 1, 2 and replace the first run's checkpoints.
    proc = _run(tiny_model, data, out, "--max_steps", "2", "--learning_rate", "5e-3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"output_dir={out} holds a run (checkpoint-1, checkpoint-2, completions.jsonl, latest, ...)" in proc.stderr
    assert "--resume_from_checkpoint latest" in proc.stderr and "--overwrite_output_dir true" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before
    again = _train(tiny_model, data, out, "--max_steps", "1", "--learning_rate", "5e-3", "--overwrite_output_dir", "true")
    assert [m["step"] for m in again] == [1] and not (out / "checkpoint-2").exists()
    assert again[0]["loss"] == first[0]["loss"]  # step 1 of the same model and seed: a fresh start, not the old weights
    # Resuming (the run's own checkpoint) is the way to go on: a changed learning rate is listed,
    # a changed group size refused, naming the field (the checkpoint's rounds hold groups of 4).
    resumed = _run(tiny_model, data, out, "--max_steps", "2", "--learning_rate", "2e-3", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "with changed options: max_steps: 1 -> 2; learning_rate: 0.005 -> 0.002" in resumed.stdout
    refused = _run(tiny_model, data, out, "--max_steps", "3", "--num_generations", "8", "--resume_from_checkpoint", "latest")
    assert refused.returncode == 2 and "num_generations: 4 in the checkpoint, 8 now" in refused.stderr, refused.stderr[-2000:]


def test_kl_iterations_and_other_loss_options_run(tiny_model, data, tmp_path):
    metrics = _train(
        tiny_model, data, tmp_path / "run", "--max_steps", "4", "--save_steps", "0",
        "--beta", "0.1", "--num_iterations", "2", "--steps_per_generation", "2", "--gradient_accumulation_steps", "1",
        "--per_device_train_batch_size", "8", "--loss_type", "grpo", "--importance_sampling_level", "sequence",
        "--scale_rewards", "batch",
    )  # fmt: skip
    # 2 micro-batches x 2 iterations = 4 optimizer steps per round, so one round
    assert [m["round"] for m in metrics] == [0, 0, 0, 0]
    assert all(m["kl"] is not None and m["kl"] >= 0 for m in metrics)
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy equals the reference before the first step
    assert metrics[-1]["kl"] > 0


def test_dapo_step_whose_completions_are_all_truncated_and_masked_has_loss_zero(tiny_model, data, tmp_path):
    # Two tokens: the random model almost never stops that soon, so every completion of a step
    # is truncated and, masked, leaves the step without a loss token (once a crash).
    metrics = _train(tiny_model, data, tmp_path / "run", "--max_steps", "2", "--save_steps", "0",
                     "--max_completion_length", "2", "--mask_truncated_completions", "true", "--loss_type", "dapo")  # fmt: skip
    empty = [m for m in metrics if m["completions/truncated_ratio"] == 1.0]
    assert empty, "expected a step whose every completion was truncated"
    assert all(m["loss"] == 0.0 and m["skipped_steps"] == 0 for m in empty)


# Rewards of +-1e38 with scale_rewards none: advantages of 1e38, a loss and gradients past float32.
HUGE_REWARD = "def huge(prompts, completions, **kw):\n    return [1e38 if i % 2 else -1e38 for i in range(len(completions))]\n"


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_a_non_finite_step_never_updates_the_weights(tiny_model, data, tmp_path, policy):
    (tmp_path / "huge.py").write_text(HUGE_REWARD)
    args = ["train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", tmp_path / "run",
            "--reward_funcs", f"{tmp_path / 'huge.py'}:huge", "--scale_rewards", "none", "--num_generations", "4",
            "--per_device_train_batch_size", "16", "--max_completion_length", "6", "--learning_rate", "1e-2",
            "--max_steps", "2", "--disable_tqdm", "true", "--on_nonfinite", policy]  # fmt: skip
    proc = cli_here(*args)
    if policy == "error":
        assert proc.returncode == 1
        assert "tandem: step 1: loss" in proc.stderr and "the weights were not updated" in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [1, 2]
    assert "WARNING: this run trained nothing: none of its 2 steps" in proc.stderr, proc.stderr[-2000:]  # it said nothing, with exit code 0
    before = load_file(tiny_model / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_steps_without_any_reward_warn_and_stop_under_on_nonfinite_error(tiny_model, data, tmp_path):
    # Every reward None (no function has an opinion): every advantage is 0 and nothing trains.
    (tmp_path / "mute.py").write_text("def mute(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    args = ["--reward_funcs", f"{tmp_path / 'mute.py'}:mute", "--reward_weights", "1.0", "--max_steps", "12", "--save_steps", "0"]
    warned = _run(tiny_model, data, tmp_path / "warned", *args)
    assert warned.returncode == 0
    assert "WARNING: step 10: the last 10 steps trained nothing" in warned.stderr and "every reward was None" in warned.stderr, warned.stderr[-2000:]
    stopped = _run(tiny_model, data, tmp_path / "stopped", *args, "--on_nonfinite", "error")
    assert stopped.returncode == 1 and "step 10: the last 10 steps trained nothing" in stopped.stderr, stopped.stderr[-2000:]
    assert len((tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()) == 10


def test_a_prompt_past_the_models_positions_is_refused_naming_its_row(tiny_model, tmp_path):
    # Colocated, it trained silently past the 1024 positions the model knows (a server refuses it with a 400).
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "7" * 1000, "answer": "7"}) + "\n")
    proc = cli_here("train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", tmp_path / "run", "--reward_funcs", "exact_match",
                    "--max_prompt_length", "2000", "--max_completion_length", "30")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"dataset {data}, row 1: its prompt of 1000 tokens and max_completion_length=30 need 1030 positions, more than the model's max_position_embeddings=1024" in proc.stderr


@pytest.mark.parametrize(
    "cap, steps, message, procs",
    [
        (100_000, 2, "could not write checkpoint-1 in {out} (SafetensorError", 1),  # the model's weights (563 kB) fail
        (800_000, 2, "could not write checkpoint-1 in {out} (OSError: writing optimizer.pt failed", 1),  # torch.save's (1.1 MB): a raw RuntimeError
        (12_000, 30, "could not write metrics.jsonl in {out} (OSError", 1),  # a log line, before any save: a raw OSError
        # rank 0's weights fail; rank 1 said "Parent directory .tmp-checkpoint-1 does not exist" (rank 0 had removed it)
        (100_000, 2, "could not write checkpoint-1 in {out} (SafetensorError", 2),
    ],
)
def test_a_disk_that_cannot_hold_a_file_ends_the_run_naming_it_and_leaves_nothing_half_written(tiny_model, data, tmp_path, cap, steps, message, procs):
    from conftest import command

    import resource
    import signal
    import subprocess
    import sys

    # Files capped (RLIMIT_FSIZE) as on a full disk, past what is written before the write tried.
    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG) instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    out = tmp_path / "run"
    args = ["--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", out, "--reward_funcs", "exact_match", "--num_generations", "4",
            "--per_device_train_batch_size", 8 // procs, "--max_completion_length", "4", "--max_steps", steps, "--save_steps", "1" if steps == 2 else "0",
            "--disable_tqdm", "true", "--num_completions_to_log", "1"]  # fmt: skip
    proc = subprocess.run(command(procs, args), capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tandem: " + message.format(out=out) in proc.stderr, proc.stderr[-2000:]
    if procs == 2:  # rank 1 names rank 0's failure, and no staging folder went missing under it
        assert f"could not write checkpoint-1 in {out} (OSError: another training process could not write its part" in proc.stderr, proc.stderr[-3000:]
        assert "Parent directory" not in proc.stderr and "gloo" not in proc.stderr
    else:
        assert "Traceback" not in proc.stderr
    assert not list(out.glob(".tmp-checkpoint-*")) and not (out / "latest").exists()


def test_bf16_reference_model_runs_under_the_policys_numerics(tiny_model, data, tmp_path):
    # The policy and the reference hold the same weights before the first step: under the same
    # bf16 autocast their log-probs are the same bits, so KL is exactly 0 (it was ~2e-7 when the
    # reference ran in fp32). After a step at lr 1e-2 it is not.
    metrics = _train(tiny_model, data, tmp_path / "run", "--max_steps", "2", "--save_steps", "0", "--bf16", "true", "--beta", "0.1")
    assert metrics[0]["kl"] == 0.0
    assert metrics[1]["kl"] > 0


@pytest.fixture(scope="module")
def hub_like_model(tiny_model, tmp_path_factory):
    """The tiny model as hub checkpoints are stored, in bf16, and with dropout 0.3 in its attention."""
    out = tmp_path_factory.mktemp("model") / "bf16-dropout"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attention_dropout=0.3)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def test_a_model_saved_in_bf16_trains_in_fp32_as_trls_default(hub_like_model, data, tmp_path):
    # Loaded in bf16 (transformers 5 keeps a checkpoint's dtype), Adam's first step of about 1e-6
    # per weight is under half a bf16 ulp of weights near 0.02 (ulp 1.2e-4): 2% of the weights
    # moved. In fp32 every weight with a gradient moves.
    out = tmp_path / "run"
    proc = _run(hub_like_model, data, out, "--max_steps", "1", "--save_steps", "0", "--learning_rate", "1e-6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the policy trains float32 weights (the default, as TRL's" in proc.stdout and "bf16 mixed precision off" in proc.stdout
    before, after = load_file(hub_like_model / "model.safetensors"), load_file(out / "checkpoint-1" / "model.safetensors")
    layers = [k for k in before if k.startswith("model.layers.")]
    assert all(after[k].dtype == torch.float32 for k in layers)
    moved = sum(int((after[k] != before[k].float()).sum()) for k in layers) / sum(before[k].numel() for k in layers)
    assert moved > 0.99, moved


def test_dropout_acts_in_the_training_forward_unless_disable_dropout(hub_like_model, data, tmp_path):
    # The policy used to stay in eval mode (as from_pretrained returns it): runs with and without
    # disable_dropout were bitwise equal. Dropout 0.3 in the training forward moves other weights.
    weights = []
    for disable in ("false", "true"):
        out = tmp_path / disable
        _train(hub_like_model, data, out, "--max_steps", "2", "--save_steps", "0", "--disable_dropout", disable)
        weights.append(load_file(out / "checkpoint-2" / "model.safetensors"))
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("loss_type, metric", [("cispo", "cispo_clip_ratio"), ("sapo", None), ("luspo", "clip_ratio/region_mean"), ("vespo", "vespo/phi_seq_mean")])
def test_each_new_loss_type_trains(tiny_model, data, tmp_path, loss_type, metric):
    out = tmp_path / "run"
    metrics = _train(tiny_model, data, out, "--max_steps", "2", "--save_steps", "0", "--loss_type", loss_type, "--epsilon_high", "5.0" if loss_type == "cispo" else "0.2")
    assert all(math.isfinite(m["loss"]) for m in metrics) and (metric is None or metric in metrics[0])
    before, after = load_file(tiny_model / "model.safetensors"), load_file(out / "checkpoint-2" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_masks_of_the_policy_gradient_keep_what_they_say(tiny_model, data, tmp_path):
    # top_entropy_quantile 0.25: about a quarter of the loss tokens keep their policy gradient
    # (ties at the threshold keep a few more); off_policy_mask_threshold 0 with two passes a
    # round: in the second, the policy has moved, so sequences with a negative advantage whose
    # tokens drifted (sampling - current > 0 on average) are dropped.
    hot = _train(tiny_model, data, tmp_path / "hot", "--max_steps", "2", "--save_steps", "0", "--top_entropy_quantile", "0.25")
    assert all(0.2 <= m["policy_gradient/kept_tokens"] <= 0.4 for m in hot), [m["policy_gradient/kept_tokens"] for m in hot]
    masked = _train(tiny_model, data, tmp_path / "masked", "--max_steps", "2", "--save_steps", "0", "--off_policy_mask_threshold", "0",
                    "--num_iterations", "2")  # fmt: skip
    assert masked[0]["policy_gradient/kept_tokens"] == 1.0  # first pass: the policy is the sampler's
    assert masked[1]["policy_gradient/kept_tokens"] < 1.0


def test_the_adaptive_entropy_bonus_moves_and_resumes_exactly(tiny_model, data, tmp_path):
    # The random model's entropy (about 5.5 nats) is below the target of 6: after each step the
    # coefficient grows by delta (0.02, 0.025, ...). It applies from step 2: before the first step
    # no entropy has been measured (TRL starts at inf, above any target), so step 1's is 0.
    args = ["--max_steps", "4", "--save_steps", "2", "--use_adaptive_entropy", "true", "--entropy_coef", "0.02", "--entropy_coef_delta", "0.005",
            "--entropy_target", "6.0"]  # fmt: skip
    whole = _train(tiny_model, data, tmp_path / "whole", *args)
    assert [m["entropy_coef"] for m in whole] == pytest.approx([0.0, 0.025, 0.03, 0.035])
    # The same run, resumed from its step-2 checkpoint: the coefficient and the last entropy come back.
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", out)
    shutil.rmtree(out / "checkpoint-4")
    (out / "latest").write_text("checkpoint-2\n")
    resumed = _train(tiny_model, data, out, *args, "--resume_from_checkpoint", "latest")
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole] and [m["entropy_coef"] for m in resumed] == [m["entropy_coef"] for m in whole]


def test_a_moving_reference_changes_the_kl_and_resumes_exactly(tiny_model, data, tmp_path):
    base = ["--max_steps", "4", "--save_steps", "2", "--beta", "0.1", "--learning_rate", "5e-2"]
    still = _train(tiny_model, data, tmp_path / "still", *base)
    moving = _train(tiny_model, data, tmp_path / "moving", *base, "--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5")
    # step 1's KL is 0 either way (policy = reference); from step 2 the reference has moved toward the policy
    assert moving[0]["kl"] == still[0]["kl"] == 0.0 and moving[2]["kl"] < still[2]["kl"]
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "moving", out)
    shutil.rmtree(out / "checkpoint-4")
    (out / "latest").write_text("checkpoint-2\n")
    assert (out / "checkpoint-2" / "reference.safetensors").is_file()
    resumed = _train(tiny_model, data, out, *base, "--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5",
                     "--resume_from_checkpoint", "latest")  # fmt: skip
    assert [m["kl"] for m in resumed] == [m["kl"] for m in moving] and [m["loss"] for m in resumed] == [m["loss"] for m in moving]


EXIT = """
import sys, tandem.cli

class Record:  # garbage in a cycle when main returns, with a finalizer that writes its file
    def __init__(self, path):
        self.path, self.me = path, self
    def __del__(self):
        open(self.path, "w").write("finalized")

def main():
    Record(sys.argv[1])
    return 3

tandem.cli.main = main
tandem.cli.run()
"""


def test_the_tandem_process_exits_with_mains_code_and_finalizes_the_garbage_it_leaves(tmp_path):
    # run() skips Python's last collections at exit (gc.freeze); the garbage main() left must still
    # be finalized, as Python's exit would, before the process ends.
    proc = subprocess.run([sys.executable, "-c", EXIT, tmp_path / "record"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "record").read_text() == "finalized"


def test_a_save_that_fails_in_any_way_leaves_no_staging_folder(tiny_model, data, tmp_path, monkeypatch):
    # Only a disk error removed the staging folder; any other failure (a value json could not
    # write, in one case) left it behind on the disk.
    from tandem.trainer import checkpoint

    def broken():
        raise TypeError("Object of type float32 is not JSON serializable")

    monkeypatch.setattr(checkpoint, "rng_state", broken)
    out = tmp_path / "run"
    proc = _run(tiny_model, data, out, "--max_steps", "1", "--save_steps", "1")
    assert proc.returncode == 1 and "not JSON serializable" in proc.stderr, proc.stderr[-2000:]
    assert not list(out.glob(".tmp-checkpoint-*")) and not (out / "latest").exists()
