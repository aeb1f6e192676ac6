"""Reward loading, weights, and the error policy."""

import math

import pytest
import torch

from tandem.rewards import combine, load_reward_fn, load_rewards, score
from tandem.rewards.builtin import exact_match, length_penalty, number_format, think_format


def test_builtins():
    assert exact_match(None, [" 7", [{"role": "assistant", "content": "8"}]], answer=["7", "7"]) == [1.0, 0.0]
    assert number_format(None, ["12", "x1"]) == [1.0, 0.0]
    assert think_format(None, ["<think>a</think> <answer>b</answer>", "<answer>b</answer>"]) == [1.0, 0.0]
    # max 10: no penalty up to 8 tokens, -0.5 at 9, -1 at 10
    assert length_penalty(None, ["", "", ""], completion_ids=[[0] * 8, [0] * 9, [0] * 10], max_completion_length=10) == [0.0, -0.5, -1.0]


def test_user_function_from_file_and_module(tmp_path, monkeypatch):
    f = tmp_path / "my_rewards.py"
    f.write_text("def shout(prompts, completions, **kw):\n    return [float(c.isupper()) for c in completions]\n")
    fn = load_reward_fn(f"{f}:shout")
    assert fn(prompts=None, completions=["A", "a"]) == [1.0, 0.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_rewards:shout")(prompts=None, completions=["B"]) == [1.0]


@pytest.mark.parametrize("spec, message", [("nosuch", "neither a built-in"), ("/no/file.py:f", "does not exist"), ("json:nosuchfn", "no function")])
def test_bad_specs(spec, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_reward_fn(spec)


def test_weights_must_match():
    with pytest.raises(ValueError, match="reward_weights has 2 values for 1"):
        load_rewards(["exact_match"], [1.0, 2.0])


def _fn(values=None, exc=None):
    def reward(prompts, completions, **kw):
        if exc:
            raise exc
        return values

    return reward


def test_raising_or_miscounting_functions_fail_naming_the_function(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "def boom(prompts, completions, **kw):\n    raise KeyError('answer')\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def words(prompts, completions, **kw):\n    return ['good'] * len(completions)\n"
        "def infinite(prompts, completions, **kw):\n    return [1.0, float('-inf')]\n"
    )
    cases = [("boom", "raised KeyError"), ("short", "list of 2 floats"), ("words", "returned 'good'"), ("infinite", "returned -inf for completion 1; rewards must be finite")]
    for name, message in cases:
        rewards = load_rewards([f"{f}:{name}"], None)
        with pytest.raises((RuntimeError, ValueError), match=f"{name}'.*{message}"):
            score(rewards, prompts=["p", "p"], completions=["a", "b"])


def test_none_and_nan_are_no_opinion(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "def a(prompts, completions, **kw):\n    return [1.0, None, None]\n"
        "def b(prompts, completions, **kw):\n    return [0.5, 2.0, float('nan')]\n"
    )
    rewards = load_rewards([f"{f}:a", f"{f}:b"], [1.0, 2.0])
    table = score(rewards, prompts=["p"] * 3, completions=["x"] * 3)
    assert math.isnan(table[1, 0]) and math.isnan(table[2, 1])
    total = combine(table, [1.0, 2.0])
    # row 0: 1 + 2*0.5 = 2; row 1: only b: 4; row 2: nobody had an opinion
    assert total[:2].tolist() == [2.0, 4.0] and math.isnan(total[2])
    assert isinstance(total, torch.Tensor)
