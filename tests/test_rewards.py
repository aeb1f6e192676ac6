"""Reward loading, weights, the error policy, async functions and timeouts, math answers."""

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import cli_here

from tandem.demo import addition_rows, write_jsonl
from tandem.rewards import RewardError, close_rewards, combine, load_reward_fn, load_rewards, score
from tandem.rewards.builtin import accuracy, exact_match, length_penalty, number_format, think_format

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_builtins():
    assert exact_match(None, [" 7", [{"role": "assistant", "content": "8"}]], answer=["7", "7"]) == [1.0, 0.0]
    assert exact_match(None, ["None", "None"], answer=[None, "None"]) == [None, 1.0]  # a null answer is no opinion, not the text "None"
    assert number_format(None, ["12", "x1"]) == [1.0, 0.0]
    assert think_format(None, ["<think>a</think> <answer>b</answer>", "<answer>b</answer>"]) == [1.0, 0.0]
    # max 10: no penalty up to 8 tokens, -0.5 at 9, -1 at 10
    assert length_penalty(None, ["", "", ""], completion_ids=[[0] * 8, [0] * 9, [0] * 10], max_completion_length=10) == [0.0, -0.5, -1.0]


def test_trls_reward_functions_have_trls_definitions_and_names():
    from tandem.rewards import (accuracy_reward, callable_name, get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment,
                                reasoning_accuracy_reward, think_format_reward)  # fmt: skip

    third, half = [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{3}}"}], [{"role": "assistant", "content": r"\boxed{\frac{1}{2}}"}]
    logged = {}
    assert accuracy_reward([third, half, third], [r"\frac{1}{3}", r"\frac{1}{3}", "no math"], log_extra=logged.setdefault) == [1.0, 0.0, None]
    assert logged["answer_parsed"][2] == "[skipped]" and "solution" in logged
    assert reasoning_accuracy_reward(["<think>x</think> \\boxed{3}", "\\boxed{3}"], ["3", "3"]) == [1.0, 0.0]  # the second never ended its reasoning
    assert think_format_reward(["<think>\nreasons\n</think>\nanswer", "<think>\nreasons\nanswer"]) == [1.0, 0.0]
    # 50 of 100 tokens: cos(pi/2) = 0, so halfway between the bounds: 0.75 right, -0.75 wrong
    cosine = get_cosine_scaled_reward(max_len=100)
    assert cosine([third, half], [r"\frac{1}{3}"] * 2, [[1] * 50] * 2) == [0.75, -0.75]
    # token 3-grams: [1]*6 has 4 of which 1 is unique, 1 - 1/4 = 0.75 repeated
    assert get_repetition_penalty_reward()(completion_ids=[[1, 2, 3, 4, 5], [1] * 6, [1, 1]]) == [0.0, -0.75, 0.0]
    # 0 up to 10 - 4 = 6 tokens, then -1 per 4, -1 past 10
    assert get_soft_overlong_punishment(10, 4)(completion_ids=[[0] * 6, [0] * 8, [0] * 11]) == [0.0, -0.5, -1.0]
    assert [callable_name(f) for f in (accuracy_reward, cosine, get_soft_overlong_punishment(10, 4))] == ["accuracy_reward", "cosine_scaled_reward",
                                                                                                         "soft_overlong_punishment_reward"]  # fmt: skip


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
        "def huge(prompts, completions, **kw):\n    return [1e39, 0.0]\n"  # finite in float64, inf in float32
    )
    cases = [("boom", "raised KeyError"), ("short", "list of 2 floats"), ("words", "returned 'good'"), ("infinite", "returned -inf for completion 1; rewards must be finite"),
             ("huge", "returned 1e[+]39 for completion 0; rewards must be finite in float32")]  # fmt: skip
    for name, message in cases:
        rewards = load_rewards([f"{f}:{name}"], None)
        with pytest.raises((RuntimeError, ValueError), match=f"{name}'.*{message}"):
            score(rewards, prompts=["p", "p"], completions=["a", "b"])


@pytest.mark.parametrize("kind", ["plain", "async", "pooled"])
def test_a_function_that_calls_sys_exit_fails_naming_it(tmp_path, kind):
    # SystemExit(0) from a reward function ended the whole run with exit code 0 after 0 steps
    # (a pooled one left its worker dead and the batch unanswered until the timeout).
    f = tmp_path / "r.py"
    f.write_text("import sys\ndef quits(prompts, completions, **kw):\n    sys.exit(0)\nasync def aquits(prompts, completions, **kw):\n    sys.exit(0)\n")
    name = "aquits" if kind == "async" else "quits"
    rewards = load_rewards([f"{f}:{name}"], None, timeout=30, num_workers=1 if kind == "pooled" else 0)
    try:
        with pytest.raises(RewardError, match=f"reward function '{name}' (called sys.exit\\(0\\)|raised RuntimeError: called sys.exit\\(0\\))"):
            score(rewards, prompts=["p"], completions=["a"])
    finally:
        close_rewards(rewards)


def test_reward_workers_die_with_their_trainer(tiny_model, tmp_path):
    import signal
    import subprocess
    import sys

    import psutil

    # A worker busy in a reward kept spinning (about 0.6 of a core) long after a SIGKILL of its trainer.
    f = tmp_path / "spin.py"
    f.write_text("def spin(prompts, completions, **kw):\n    while True:\n        pass\n")
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--output_dir", tmp_path / "run",
         "--reward_funcs", f"{f}:spin", "--reward_num_workers", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
         "--max_completion_length", "2", "--disable_tqdm", "true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        busy = []
        while not busy:  # the worker is spinning in the reward
            assert trainer.poll() is None and time.monotonic() < deadline, "no busy reward worker"
            busy = [c for c in psutil.Process(trainer.pid).children(recursive=True) if c.cpu_percent(interval=0.2) > 50]
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        gone, alive = psutil.wait_procs(busy, timeout=10)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    for p in alive:
        p.kill()
    assert not alive, "reward workers outlived their trainer"


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


def test_accuracy_verifies_equivalent_answers_and_has_no_opinion_on_unparsable_solutions():
    cases = [
        ("The answer is \\boxed{0.5}", "$\\frac{1}{2}$", 1.0),  # LaTeX solution, boxed decimal answer
        ("So x = 7.", "7", 1.0),  # plain answer in prose
        ("The result is 2/4", "\\frac{1}{2}", 1.0),  # an unreduced fraction equals the reduced one
        ("\\boxed{x(x+2)}", "$x^2+2x$", 1.0),  # equivalent expressions
        ([{"role": "assistant", "content": "$\\frac{3}{4}$"}], "0.75", 1.0),  # a chat completion
        ("I think 8", "7", 0.0),
        ("", "3", 0.0),  # no answer at all is wrong, not "no opinion"
        ("7", "no answer here", None),  # the gold answer does not parse: no opinion
    ]
    assert accuracy(None, [c for c, _, _ in cases], solution=[s for _, s, _ in cases]) == [want for _, _, want in cases]
    with pytest.raises(ValueError, match="'solution' column"):
        accuracy(None, ["1"])


def _module(tmp_path, source: str) -> str:
    path = tmp_path / "slow_rewards.py"
    path.write_text(source)
    return str(path)


def test_async_functions_of_one_batch_run_concurrently(tmp_path):
    # Each function waits for the other to start: run one after the other, both would time out.
    f = _module(tmp_path, """
import asyncio
started = {}
async def _meet(me, other, n):
    started[me] = asyncio.get_running_loop().create_future()
    while other not in started:
        await asyncio.sleep(0.01)
    started[me].set_result(True)
    await started[other]
    return [1.0] * n
async def ping(prompts, completions, **kw):
    return await _meet("ping", "pong", len(completions))
async def pong(prompts, completions, **kw):
    return await _meet("pong", "ping", len(completions))
def plain(prompts, completions, **kw):
    return [0.5] * len(completions)
""")
    rewards = load_rewards([f"{f}:ping", f"{f}:plain", f"{f}:pong"], None, timeout=10)
    assert score(rewards, prompts=["p"] * 2, completions=["a", "b"]).tolist() == [[1.0, 0.5, 1.0]] * 2


def test_a_call_past_reward_timeout_fails_naming_it_or_gives_no_opinion(tmp_path, capsys):
    f = _module(tmp_path, """
import asyncio, time
def hangs(prompts, completions, **kw):
    time.sleep(60)
async def hangs_async(prompts, completions, **kw):
    await asyncio.sleep(60)
def fine(prompts, completions, **kw):
    return [1.0] * len(completions)
""")
    for name in ("hangs", "hangs_async"):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"'{name}' took longer than reward_timeout=0.3s.*reward_on_timeout=none"):
            score(load_rewards([f"{f}:{name}", f"{f}:fine"], None, timeout=0.3), prompts=["p"], completions=["a"])
        assert time.monotonic() - start < 5  # a hung plain function's thread is left behind, not waited for
        table = score(load_rewards([f"{f}:{name}", f"{f}:fine"], None, timeout=0.3, on_timeout="none"), prompts=["p"] * 2, completions=["a", "b"])
        assert torch.isnan(table[:, 0]).all() and table[:, 1].tolist() == [1.0, 1.0]
        assert f"'{name}' took longer than reward_timeout=0.3s; its 2 rewards of this batch are None" in capsys.readouterr().err


def test_a_reward_model_scores_through_the_cli_as_transformers_scores_each_text_alone(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm, policy, data = tmp_path / "rm", tmp_path / "policy", tmp_path / "data.jsonl"
    assert cli_here("init-model", rm, "--size", "tiny", "--reward-model", "--seed", "1").returncode == 0
    assert cli_here("init-model", policy, "--size", "tiny").returncode == 0
    write_jsonl(addition_rows(0), data)
    proc = cli_here("train", "--config", EXAMPLES / "reward_model.yaml", "--model_name_or_path", policy, "--dataset_name", data,
                   "--output_dir", tmp_path / "run", "--max_steps", "2", "--reward_funcs", f"model:{rm}", "exact_match",
                   "--reward_model_batch_size", "5", "--num_completions_to_log", "16")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 32
    tokenizer, model = AutoTokenizer.from_pretrained(rm), AutoModelForSequenceClassification.from_pretrained(rm).eval()
    for row in rows:  # one text at a time: no padding, so the batched, padded scores are checked too
        question = row["prompt"].split("user\n", 1)[1].split("<|im_end|>", 1)[0]
        answer = row["completion"]  # logged with its special tokens; the rewards see it without them
        for special in tokenizer.all_special_tokens:
            answer = answer.replace(special, "")
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}, {"role": "assistant", "content": answer}], tokenize=False)
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        assert row["rewards/rm"] == pytest.approx(want, abs=1e-5)
    spread = {round(row["rewards/rm"], 6) for row in rows}
    assert len(spread) > 1  # the scores depend on the text


def test_a_reward_spec_that_does_not_load_is_a_config_error(tiny_model, tmp_path):
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    proc = cli_here("train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_funcs", f"model:{tmp_path / 'no_model'}")
    assert proc.returncode == 2 and "config error: reward_funcs entry 'model:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # a file that does not compile, or fails while it loads, names itself and the line (it was a traceback and exit 1)
    (tmp_path / "broken.py").write_text("def score(prompts, completions, **kw)\n    return [1.0] * len(completions)\n")
    (tmp_path / "fails.py").write_text("import math\nWEIGHT = math.sqrt(-1)\n")
    for spec, message in ((f"{tmp_path / 'broken.py'}:score", "broken.py, line 1: expected ':'"),
                          (f"{tmp_path / 'fails.py'}:score", "loading " + str(tmp_path / "fails.py") + " raised ValueError: math domain error")):  # fmt: skip
        proc = cli_here("train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_funcs", spec)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_worker_processes_split_the_batch_and_run_signal_timeouts_a_thread_cannot(tmp_path):
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    f = _module(tmp_path, f"""
import os, time
from math_verify import parse
def pid(prompts, completions, **kw):  # each slice waits for the other: two at once, or none waits long
    open(os.path.join({str(arrived)!r}, str(os.getpid())), "w").close()
    end = time.monotonic() + 15
    while len(os.listdir({str(arrived)!r})) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    return [float(os.getpid())] * len(completions)
def parsed(prompts, completions, **kw):  # math-verify's default timeout sets a SIGALRM: main thread only
    return [float(len(parse(c)) > 0) for c in completions]
def hangs(prompts, completions, **kw):
    time.sleep(60)
""")
    with pytest.raises(RuntimeError, match="'parsed' raised ValueError: Math-Verify 'parse' function doesn't support threaded"):
        score(load_rewards([f"{f}:parsed"], None), prompts=["p"], completions=["1"])
    rewards = load_rewards([f"{f}:pid", f"{f}:parsed", f"{f}:hangs"], None, timeout=20, on_timeout="none", num_workers=2)
    try:
        table = score(rewards[:2], prompts=["p"] * 5, completions=["1", "2", "x", "3", "4"])
        pids = table[:, 0].tolist()
        assert len(set(pids)) == 2 and os.getpid() not in pids  # two slices, at once in two workers
        assert pids[:2] == [pids[0]] * 2 and pids[3:] == [pids[4]] * 2  # contiguous slices, in order
        assert table[:, 1].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
        rewards[2].fn.timeout = 0.5  # the pool enforces the timeout, and ends the stuck worker
        start = time.monotonic()
        assert torch.isnan(score(rewards[2:], prompts=["p"], completions=["1"])).all()
        assert time.monotonic() - start < 10
        assert score(rewards[:1], prompts=["p"], completions=["1"]).tolist() != [pids[:1]]  # a fresh pool
    finally:
        close_rewards(rewards)


def test_reward_workers_score_a_run_as_the_thread_does(tiny_model, tmp_path):
    data = write_jsonl(addition_rows(0), tmp_path / "data.jsonl")
    runs = {}
    for workers in ("0", "2"):
        out = tmp_path / f"workers{workers}"
        proc = cli_here("train", "--config", EXAMPLES / "addition.yaml", "--model_name_or_path", tiny_model, "--dataset_name", data,
                       "--output_dir", out, "--max_steps", "3", "--reward_funcs", "exact_match", "number_format", "--reward_num_workers", workers)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[workers] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ["reward", "rewards/exact_match/mean", "rewards/number_format/mean", "loss"]
    assert [[m[k] for k in keys] for m in runs["0"]] == [[m[k] for k in keys] for m in runs["2"]]
