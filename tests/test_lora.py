"""LoRA (use_peft) through the real `tandem` command: every mode, two processes, exact resume,
the server merging pushed adapters, the merged export, and bad options."""

import re
import subprocess
from pathlib import Path

import pytest
import requests
import torch
from peft import PeftModel
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import cli_here, killed_past_step, restart_server_mid_run
from tandem.demo import addition_rows, write_jsonl
from tandem.rollout.client import RolloutClient
from tandem.engines.engine import TransformersEngine, eos_token_ids
from tandem.rollout.types import SamplingParams
from tandem.rollout.weights import fingerprint
from tandem.trainer.lora import adapter_weights
from test_async import DIGITS, ENV, base_args, command, read, train

# Adapters on every linear layer; no dropout, so a step is a function of the weights alone and
# runs in different modes compute the same bits.
LORA = ["--use_peft", "true", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_dropout", "0.0"]
PROMPT = [1, 120, 118, 104, 117, 13, 54, 46, 55]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    (folder / "digits.py").write_text(DIGITS)
    return write_jsonl(addition_rows(0), folder / "data.jsonl")


def adapters(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / f"checkpoint-{step}" / "adapter_model.safetensors")


def test_the_demo_task_reward_rises_with_lora(tmp_path):
    # Measured (300 steps, seeds 0, 1, 2): first-10-step mean 0.23-0.25, last-10 0.49-0.52, a
    # rise of 0.25-0.27; the threshold leaves a wide margin for other machines' numerics.
    config = Path(__file__).resolve().parents[1] / "examples" / "addition_lora.yaml"
    proc = cli_here("demo", "--config", config, "--output_dir", tmp_path / "demo", "--max_steps", "300", "--seed", "0", one_thread=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, _ = read(tmp_path / "demo" / "run")
    rewards = [m["reward"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.12, (first, last)
    assert (tmp_path / "demo" / "run" / "checkpoint-300" / "adapter_model.safetensors").is_file()


def test_server_mode_with_lora_trains_like_colocated_mode_and_pushes_only_adapters(tiny_model, data, server, tmp_path):
    extra = [*LORA, "--max_steps", "4", "--beta", "0.05", "--lora_modules_to_save", "norm"]  # the final norm, trained whole
    # Without the off-policy correction the trainer's loss depends on the completions alone,
    # and the server samples them from merged weights as the colocated engine does from
    # the adapter layers: the same tokens, so the same losses.
    train(1, base_args(tiny_model, data, tmp_path / "server", 32, *extra, "--rollout_mode", "server",
                       "--rollout_server_urls", server.url, "--verify_weight_sync", "true", "--off_policy_correction", "none"))  # fmt: skip
    served = requests.get(server.url + "/weights/fingerprint", timeout=30).json()
    train(1, base_args(tiny_model, data, tmp_path / "colocate", 32, *extra))
    (remote, remote_c), (local, local_c) = read(tmp_path / "server"), read(tmp_path / "colocate")
    assert [c["completion"] for c in remote_c] == [c["completion"] for c in local_c]
    assert [m["loss"] for m in remote] == [m["loss"] for m in local]
    assert [m["kl"] for m in remote] == [m["kl"] for m in local] and remote[-1]["kl"] > 0  # the reference: adapters disabled
    assert [m["policy_version"] for m in remote] == [1, 2, 3, 4]
    # The server holds the base it started with and the adapters of the last push, as sent.
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "server" / "checkpoint-4")
    assert served["version"] == 4
    assert served["adapter_fingerprint"] == fingerprint(adapter_weights(trained))
    assert served["base_fingerprint"] == fingerprint(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())


def test_two_processes_with_lora_train_like_one_with_twice_the_batch(tiny_model, data, tmp_path):
    extra = [*LORA, "--max_steps", "4"]
    train(1, base_args(tiny_model, data, tmp_path / "one", 32, *extra))
    train(2, base_args(tiny_model, data, tmp_path / "two", 16, *extra))
    (one, one_c), (two, two_c) = read(tmp_path / "one"), read(tmp_path / "two")
    assert [m["reward"] for m in one] == [m["reward"] for m in two]
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    a, b = adapters(tmp_path / "one", 4), adapters(tmp_path / "two", 4)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4  # gradients summed in another order


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["colocate", "server_async_partial"])
def test_sigkill_then_resume_with_lora_gives_bitwise_equal_adapters(tiny_model, data, tmp_path, mode, request):
    extra = [*LORA, "--lora_dropout", "0.1", "--beta", "0.05", "--max_steps", "9", "--save_steps", "3"]
    if mode == "server_async_partial":  # async, with sequences carried across adapter pushes (partial rollouts)
        server = request.getfixturevalue("server")
        extra += ["--rollout_mode", "server", "--rollout_server_urls", server.url, "--async_generate", "true",
                  "--max_staleness", "2", "--max_tokens_per_round", "2"]  # fmt: skip
    train(1, base_args(tiny_model, data, tmp_path / "whole", 32, *extra))
    out = tmp_path / "killed"
    assert killed_past_step(base_args(tiny_model, data, out, 32, *extra), out, 4).name in ("checkpoint-3", "checkpoint-6")
    train(1, base_args(tiny_model, data, out, 32, *extra, "--resume_from_checkpoint", "latest"))
    whole, resumed = adapters(tmp_path / "whole", 9), adapters(out, 9)
    assert whole.keys() == resumed.keys() and all((whole[k] == resumed[k]).all() for k in whole), "adapters must be bitwise equal"
    (m_whole, _), (m_resumed, _) = read(tmp_path / "whole"), read(out)
    assert [m["step"] for m in m_resumed] == list(range(1, 10))
    assert [m["loss"] for m in m_resumed] == [m["loss"] for m in m_whole]


@pytest.mark.quick
def test_merge_writes_a_full_model_that_computes_what_base_and_adapters_do(tiny_model, data, tmp_path):
    train(1, base_args(tiny_model, data, tmp_path / "run", 32, *LORA, "--max_steps", "2"))
    proc = cli_here("merge", tmp_path / "run" / "checkpoint-2", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "run" / "checkpoint-2")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert not torch.equal(expected, AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits)  # the adapters did train
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    proc = cli_here("merge", tmp_path / "merged", tmp_path / "again")
    assert proc.returncode != 0 and "not a LoRA checkpoint" in proc.stderr


def test_a_server_serves_pushed_adapters_merged_as_a_local_adapted_model_generates(tiny_model, server, tmp_path):
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), _trained_adapter(tiny_model, tmp_path))
    client = RolloutClient([server.url], server_timeout=30)
    try:
        client.wait_until_ready()
        pushed = adapter_weights(peft_model)
        assert client.push_weights(pushed, version=1, adapter=True) == [1]
        params = SamplingParams(max_tokens=6)
        seeds = list(range(8))
        served = client.generate([PROMPT] * 8, params, seeds, min_version=1)
        eos = eos_token_ids(AutoTokenizer.from_pretrained(tiny_model), peft_model.generation_config, str(tiny_model))
        local = TransformersEngine(peft_model.eval(), eos, 0).generate([PROMPT] * 8, params, seeds)
        assert [c.token_ids for c in served] == [c.token_ids for c in local]
        for s, lc in zip(served, local):
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lc.logprobs), atol=1e-5, rtol=0)
        # A bad factor is refused as it arrives, naming the tensor and the fix.
        name, a = pushed[0]
        r = requests.post(server.url + "/weights/begin", json={"version": 2, "num_tensors": 2, "adapter": True}, timeout=30)
        uid = r.json()["update_id"]
        body = save({name: torch.zeros(a.shape[0], a.shape[1] + 1)})
        r = requests.put(f"{server.url}/weights/{uid}/chunk", data=body, headers={"Content-Type": "application/octet-stream"}, timeout=30)
        assert r.status_code == 400 and name in r.json()["error"] and "columns" in r.json()["error"], r.text
    finally:
        client.close()


def _trained_adapter(tiny_model, tmp_path) -> Path:
    """An adapter with non-zero B (PEFT starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_a_lora_trainer_refuses_a_server_with_another_base_model_at_start_and_after_a_restart(tiny_model, data, server, tmp_path):
    other = tmp_path / "other"
    assert cli_here("init-model", other, "--size", "tiny", "--seed", "1").returncode == 0
    args = [*LORA, "--max_steps", "8", "--rollout_mode", "server", "--rollout_server_urls", server.url]
    # Mid-run: the server comes back as a process serving another model. Its adapters would be
    # merged into the wrong base (a run once went on with kl_behav_proximal at 4-7); the restarted
    # process is checked as a new server is, before it gets the adapters again.
    out = tmp_path / "restarted"
    trainer = subprocess.Popen(command(1, base_args(tiny_model, data, out, 32, *args)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    stderr, restarted = restart_server_mid_run(server, other, trainer, out, 2)
    try:
        assert trainer.returncode == 1, stderr[-2000:]
        assert f"rollout server {server.url} serves other base weights" in stderr and f"--model {tiny_model}" in stderr, stderr[-2000:]
        assert len((out / "metrics.jsonl").read_text().splitlines()) < 8
        # At start: refused before any generation.
        proc = cli_here("train", *base_args(tiny_model, data, tmp_path / "run", 32, *args))
    finally:
        restarted.stop()
    assert proc.returncode == 1
    assert f"rollout server {server.url} serves other base weights" in proc.stderr and f"--model {tiny_model}" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--lora_target_modules", "q_proj", "attn_out"], "lora_target_modules=['q_proj', 'attn_out']: ['attn_out'] name no linear module"),
        (["--lora_modules_to_save", "head"], "lora_modules_to_save=['head']: ['head'] name no module"),
        (["--lora_modules_to_save", "lm_head"], "lora_modules_to_save=['lm_head']: ['lm_head'] share one weight with ['model.embed_tokens']"),
        (["--lora_target_modules", "q_proj", "lm_head"], "['lm_head'] share one weight"),  # the tiny model ties them
        (["--lora_r", "0"], "lora_r=0: must be >= 1"),
        (["--lora_dropout", "1.0"], "lora_dropout=1.0: must be in [0, 1)"),
        (["--lora_target_modules", "all-linear", "q_proj"], "lora_target_modules=['all-linear', 'q_proj']: give all-linear alone"),
    ],
)
def test_bad_lora_options_fail_before_training_naming_the_field(tiny_model, data, tmp_path, options, message):
    proc = cli_here("train", *base_args(tiny_model, data, tmp_path / "run", 32, "--use_peft", "true", "--max_steps", "1", *options))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    if "linear module" in message:
        assert all(f"'{kind}'" in proc.stderr.split("its linear modules are")[1] for kind in ("q_proj", "down_proj", "lm_head"))  # what the model has
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_lora_checkpoint_resumed_without_use_peft_is_refused(tiny_model, data, tmp_path):
    train(1, base_args(tiny_model, data, tmp_path / "run", 32, *LORA, "--max_steps", "1"))
    proc = cli_here("train", *base_args(tiny_model, data, tmp_path / "run", 32, "--max_steps", "2", "--resume_from_checkpoint", "latest"))
    assert proc.returncode == 2 and "holds LoRA adapters: resume it with use_peft true" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.quick
def test_adapter_updates_are_checked_and_merged_as_base_plus_b_a():
    from tandem.rollout.adapters import check_adapter, check_pairs, merge

    g = torch.Generator().manual_seed(0)
    spec = {"q.weight": torch.randn(4, 3, generator=g), "norm.weight": torch.randn(3, generator=g)}
    a, b = torch.randn(2, 3, generator=g), torch.randn(4, 2, generator=g)
    update = {"q.weight.lora_A": a, "q.weight.lora_B": b}
    check_adapter(spec, update)
    check_pairs(update)
    merged = merge(spec, update)
    torch.testing.assert_close(merged["q.weight"], spec["q.weight"] + b @ a)
    assert merged["norm.weight"] is spec["norm.weight"]  # untouched weights are not copied
    refused = {
        "arrived without its partner 'q.weight.lora_B'": {"q.weight.lora_A": a},
        "lora_A has rank 2, lora_B rank 3": {"q.weight.lora_A": a, "q.weight.lora_B": torch.ones(4, 3)},
        "no 2-D weight 'norm.weight'": {"norm.weight.lora_A": a},
        "lora_B is 2-D with 4 rows": {"q.weight.lora_B": torch.ones(5, 2)},
        "also arrived whole": {"q.weight": spec["q.weight"], "q.weight.lora_A": a},
        "NaN or inf": {"q.weight.lora_A": torch.full((2, 3), float("nan")), "q.weight.lora_B": b},
    }
    for message, bad in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            check_adapter(spec, bad)  # each chunk as it arrives
            check_pairs(bad)  # the whole update at commit
