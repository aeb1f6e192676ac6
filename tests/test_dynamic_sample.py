"""DAPO's dynamic sampling through the real CLI: groups whose rewards agree are replaced, in
sync and async modes, with partial rollouts and with several processes, reproducibly and with
an exact resume."""

import json

import pytest
from safetensors.torch import load_file

from conftest import train, versions_within
from tandem.demo import addition_rows, write_jsonl

# Half the prompts teach nothing: an even first operand scores 1 whatever the completion. The
# others score the parity of the completion's first token, which varies within a group.
HALF_AGREE = """
def half_agree(prompts, completions, completion_ids, **kw):
    firsts = [int((p[0]["content"] if isinstance(p, list) else p)[0]) for p in prompts]
    return [1.0 if a % 2 == 0 else float(ids[0] % 2) for a, ids in zip(firsts, completion_ids)]
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dynamic")
    (folder / "half_agree.py").write_text(HALF_AGREE)
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def args(tiny_model, data, out, *extra):
    return [
        "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", out,
        "--reward_funcs", f"{data.parent / 'half_agree.py'}:half_agree", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--max_completion_length", "6", "--learning_rate", "1e-2",
        "--disable_tqdm", "true", "--num_completions_to_log", "64", "--max_steps", "4", *extra,
    ]  # fmt: skip


def read(out):
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return metrics, completions


def first_operand(completion_row) -> int:
    return int(completion_row["prompt"].split("user\n", 1)[1][0])


@pytest.mark.quick
def test_agreeing_groups_are_replaced_and_counted(tiny_model, data, tmp_path):
    train(1, args(tiny_model, data, tmp_path / "off"))
    train(1, args(tiny_model, data, tmp_path / "on", "--dynamic_sample", "true", "--max_resample_times", "8"))
    (off, _), (on, logged) = read(tmp_path / "off"), read(tmp_path / "on")
    assert all("dynamic_sample/dropped_groups" not in m for m in off)
    assert sum(m["frac_reward_zero_std"] for m in off) / 4 > 0.3
    # About 60% of the groups agree; eight draws leave a group's place unfilled with odds of
    # 0.6^8 < 2%. In these seeded runs every trained group has differing rewards, and no even
    # operand is trained.
    assert all(m["frac_reward_zero_std"] == 0 for m in on)
    assert all(first_operand(row) % 2 == 1 for row in logged)
    assert len(logged) == 4 * 16  # every round is full: 4 groups of 4
    dropped = [m["dynamic_sample/dropped_groups"] for m in on]
    resampled = [m["dynamic_sample/resampled_completions"] for m in on]
    assert sum(dropped) > 0 and all(r % 4 == 0 for r in resampled)  # whole groups of 4
    # The first draw replaces exactly the dropped groups of the round's own prompts, so the
    # completions generated for replacements are at least 4 per group dropped from those.
    assert all(r >= 4 * min(d, 4) for d, r in zip(dropped, resampled) if d)
    assert [m["reward"] for m in on] != [m["reward"] for m in off]


def test_resume_is_exact_with_dynamic_sampling(tiny_model, data, tmp_path):
    common = ["--dynamic_sample", "true", "--max_steps", "6", "--save_steps", "3"]
    train(1, args(tiny_model, data, tmp_path / "run", *common))
    whole = read(tmp_path / "run")[0]
    weights = load_file(tmp_path / "run" / "checkpoint-6" / "model.safetensors")
    train(1, args(tiny_model, data, tmp_path / "run", *common, "--resume_from_checkpoint", tmp_path / "run" / "checkpoint-3"))
    resumed = read(tmp_path / "run")[0]
    keys = ["loss", "reward", "dynamic_sample/dropped_groups", "dynamic_sample/resampled_completions"]
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in whole]
    again = load_file(tmp_path / "run" / "checkpoint-6" / "model.safetensors")
    assert all((weights[k] == again[k]).all() for k in weights)


def test_two_processes_sync_and_async_draw_the_same_rounds(tiny_model, data, server, tmp_path):
    # Each rank fills its own groups, without a collective; a round's draws depend on the seed,
    # the round and the rank only, so an async run (max_staleness 0) repeats the sync run exactly.
    common = ["--dynamic_sample", "true", "--rollout_mode", "server", "--rollout_server_urls", server.url,
              "--off_policy_correction", "none", "--per_device_train_batch_size", "8"]  # fmt: skip
    train(2, args(tiny_model, data, tmp_path / "sync", *common))
    train(2, args(tiny_model, data, tmp_path / "async", *common, "--async_generate", "true", "--max_staleness", "0"))
    (sync, sync_logged), (async_, async_logged) = read(tmp_path / "sync"), read(tmp_path / "async")
    keys = ["loss", "reward", "frac_reward_zero_std", "dynamic_sample/dropped_groups", "dynamic_sample/resampled_completions"]
    assert [[m[k] for k in keys] for m in sync] == [[m[k] for k in keys] for m in async_]
    assert sum(m["dynamic_sample/dropped_groups"] for m in sync) > 0
    assert [r["completion"] for r in sync_logged] == [r["completion"] for r in async_logged]


def test_partial_rollouts_replace_agreeing_groups_at_the_due_version_and_resume_exactly(tiny_model, data, server, tmp_path):
    # Completions of up to 6 tokens, 2 a version: a sequence spans up to 3 versions, and the
    # checkpoint at step 3 holds sequences in flight. Replacements are generated whole when
    # their round is due, at version r - 1.
    common = ["--dynamic_sample", "true", "--max_resample_times", "8", "--rollout_mode", "server", "--rollout_server_urls", server.url,
              "--async_generate", "true", "--max_staleness", "2", "--max_tokens_per_round", "2", "--max_steps", "6", "--save_steps", "3"]  # fmt: skip
    out = tmp_path / "run"
    train(1, args(tiny_model, data, out, *common))
    whole, logged = read(out)
    weights = load_file(out / "checkpoint-6" / "model.safetensors")
    assert all(m["frac_reward_zero_std"] == 0 for m in whole)
    assert sum(m["dynamic_sample/dropped_groups"] for m in whole) > 0 and len(logged) == 6 * 16
    assert all(first_operand(row) % 2 == 1 for row in logged)
    # The round's own groups carry their tokens' versions, some across an update; replacements
    # are of one version, the round's due one.
    carried = [c for c in logged if "token_versions" in c]
    for c in carried:
        assert versions_within(c, 2), (c["round"], c["token_versions"])
    assert any(len(c["token_versions"]) > 1 for c in carried)
    replacements = [c for c in logged if "token_versions" not in c]
    assert replacements and all(c["policy_version"] == max(0, c["round"] - 1) for c in replacements)
    in_flight = json.loads((out / "checkpoint-3" / "in_flight_0.json").read_text())["flights"]
    assert any(t["finish"] is None for f in in_flight for t in f["seqs"])  # the resume continues sequences cut short
    train(1, args(tiny_model, data, out, *common, "--resume_from_checkpoint", out / "checkpoint-3"))
    resumed, resumed_logged = read(out)
    keys = ["loss", "reward", "dynamic_sample/dropped_groups", "dynamic_sample/resampled_completions"]
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in whole]
    assert [c["completion"] for c in resumed_logged] == [c["completion"] for c in logged]
    again = load_file(out / "checkpoint-6" / "model.safetensors")
    assert all((weights[k] == again[k]).all() for k in weights)
