"""Evaluation through the real CLI: during training (colocated and against a server), and
`tandem eval` on a checkpoint, which must agree with the run's own evaluation of it."""

import json

import pytest

from conftest import cli_here, train
from tandem.demo import addition_rows, write_jsonl
from tandem.trainer.eval import pass_at_k
from test_async import DIGITS, base_args

EVAL = ["--eval_steps", "2", "--eval_num_generations", "4", "--eval_pass_threshold", "0.5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    (folder / "digits.py").write_text(DIGITS)
    write_jsonl(addition_rows(1)[:12], folder / "held_out.jsonl")
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def evals(out):
    return [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]


@pytest.mark.quick
def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2) / C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


def test_eval_during_training_equals_tandem_eval_of_the_checkpoint_in_colocated_and_server_mode(tiny_model, data, server, tmp_path):
    held_out = data.parent / "held_out.jsonl"
    common = ["--max_steps", "4", "--eval_dataset", held_out, *EVAL]
    proc = train(1, base_args(tiny_model, data, tmp_path / "colocate", 32, *common))
    assert "step 4 eval on 12 prompts: reward" in proc.stdout, proc.stdout[-2000:]
    # Without the off-policy correction a server run trains the same bits as a colocated one
    # (test_server), and the evaluation's fixed seeds give the same completions.
    train(1, base_args(tiny_model, data, tmp_path / "server", 32, *common, "--rollout_mode", "server",
                       "--rollout_server_urls", server.url, "--off_policy_correction", "none"))  # fmt: skip
    local, remote = evals(tmp_path / "colocate"), evals(tmp_path / "server")
    assert [e["step"] for e in local] == [2, 4]
    assert all(0 <= e["eval/pass@1"] <= e["eval/pass@4"] <= 1 and e["eval/prompts"] == 12 for e in local)
    strip = lambda e: {k: v for k, v in e.items() if k != "eval/seconds"}  # noqa: E731
    assert [strip(e) for e in remote] == [strip(e) for e in local]
    proc = cli_here("eval", "--model", tmp_path / "colocate" / "checkpoint-4", "--dataset", held_out, "--reward_funcs", f"{data.parent / 'digits.py'}:digits",
                   "--num_generations", "4", "--max_completion_length", "4", "--pass_threshold", "0.5", "--out", tmp_path / "eval.json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@4" in proc.stdout
    alone = json.loads((tmp_path / "eval.json").read_text())
    assert {k: alone[k] for k in strip(local[-1]) if k != "step"} == {k: v for k, v in strip(local[-1]).items() if k != "step"}


@pytest.mark.quick
def test_greedy_eval_in_an_async_run_gives_one_completion_per_prompt(tiny_model, data, server, tmp_path):
    train(1, base_args(tiny_model, data, tmp_path / "run", 32, "--max_steps", "3", "--eval_dataset", data.parent / "held_out.jsonl",
                       "--eval_greedy", "true", "--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true"))  # fmt: skip
    (last,) = evals(tmp_path / "run")  # eval_steps 0: once, at the end
    assert last["step"] == 3 and "eval/pass@1" in last and not any(k.startswith("eval/pass@") and k != "eval/pass@1" for k in last)
