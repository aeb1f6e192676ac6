"""Sharded training (fsdp) with real processes: torchrun with gloo, a `tandem rollout` server,
sharded checkpoints on disk, two torchrun agents as two nodes.

The model's generation config ends a completion on one token in six, so completions end at
very different lengths on each rank: every forward of a sharded model is a collective, and a
rank that stopped decoding early would hang the others (the engine's lockstep is what is tested).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import GenerationConfig

from conftest import ENV, Server, cli_here, command, free_port, kill_server_mid_run, restart_server_mid_run, same_collectives, train
from tandem.demo import addition_rows, write_jsonl
from tandem.rollout.weights import StagedWeights, buckets, fingerprint
from tandem.trainer.config import ConfigError, TrainConfig
from tandem.trainer.sharding import from_accelerate_config
from test_multiturn import ROUNDS_AGENT

DIGITS = "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / 4 for c in completions]\n"
# FSDP reduce-scatters gradients in another order than DDP all-reduces them, and one process
# sums them in a third: float rounding of the same sums. Per step that moves losses and gradient
# norms by about 1e-7; AdamW turns near-zero gradients into full-size steps, so after 4 steps at
# learning rate 1e-2 the weights differ by up to about 1e-4.
LOSS_TOL, NORM_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-3


@pytest.fixture(scope="module")
def ender(tiny_model, tmp_path_factory):
    """The tiny model, with one token in six ending a completion (generation_config's eos_token_id)."""
    out = tmp_path_factory.mktemp("fsdp") / "ender"
    shutil.copytree(tiny_model, out)
    config = GenerationConfig.from_pretrained(out)
    config.eos_token_id = [config.eos_token_id or 2, *range(6, 259, 6)]
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data(ender):
    (ender.parent / "digits.py").write_text(DIGITS)
    return write_jsonl(addition_rows(0), ender.parent / "data.jsonl")


def args(model, data, out, batch, *extra):
    return [
        "--model_name_or_path", model, "--dataset_name", data, "--output_dir", out, "--reward_funcs", f"{data.parent / 'digits.py'}:digits",
        "--num_generations", "4", "--per_device_train_batch_size", batch, "--max_completion_length", "16", "--learning_rate", "1e-2",
        "--disable_tqdm", "true", "--num_completions_to_log", "64", "--max_steps", "4", *extra,
    ]  # fmt: skip


def read(out, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def assert_trains_alike(a, b):
    ma, mb = read(a), read(b)
    assert len(ma) == len(mb) == 4
    for x, y in zip(ma, mb):
        assert abs(x["loss"] - y["loss"]) <= LOSS_TOL, (x["step"], x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= NORM_TOL * max(1.0, y["grad_norm"]), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["reward"] == y["reward"]
    for step in range(1, 5):  # rank 0 logs its own completions: the first ones of a single process's round
        first = [c["completion"] for c in read(a, "completions.jsonl") if c["step"] == step]
        assert first == [c["completion"] for c in read(b, "completions.jsonl") if c["step"] == step][: len(first)]


def exported(checkpoint, out) -> dict:
    proc = cli_here("export", checkpoint, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def colocated(ender, data, tmp_path_factory):
    """The same 4 steps: fsdp on 2 processes (a checkpoint at step 2), DDP on 2, 1 process with
    twice the batch, unsharded and sharded; with a KL term (the reference model is sharded too) and an evaluation at the
    end (every rank generates when the engine is sharded)."""
    root = tmp_path_factory.mktemp("colocated")
    held_out = write_jsonl(addition_rows(1)[:6], root / "held_out.jsonl")
    # The reference moves toward the policy every 2 steps (sync_ref_model): sharded like the policy,
    # it is mixed shard by shard, and the step-2 checkpoint holds its shards for the bitwise resume.
    extra = ["--beta", "0.04", "--eval_dataset", held_out, "--eval_num_generations", "2", "--sync_ref_model", "true", "--ref_model_sync_steps", "2"]
    train(2, args(ender, data, root / "fsdp", 8, *extra, "--fsdp", "full_shard", "--save_steps", "2"), trace=root / "trace")
    train(2, args(ender, data, root / "ddp", 8, *extra))
    train(1, args(ender, data, root / "one", 16, *extra))
    train(1, args(ender, data, root / "fsdp1", 16, *extra, "--fsdp", "full_shard"), separate=True)  # a process group of one
    return root


def test_fsdp_on_two_processes_trains_like_ddp_and_like_one_process(colocated):
    # A single process's round holds rank 0's 8 completions, then rank 1's: their longest differ,
    # so without the lockstep one rank would stop decoding while the other still gathers weights.
    one = read(colocated / "one", "completions.jsonl")
    rounds = [[c["completion_tokens"] for c in one if c["step"] == step] for step in range(1, 5)]
    assert all(len(r) == 16 for r in rounds)
    assert any(max(r[:8]) != max(r[8:]) for r in rounds), rounds
    # Every sharded forward, decoding step, gather and checkpoint is a collective: the ranks'
    # sequences are the same, and hold each kind.
    collectives = same_collectives(colocated / "trace")
    kinds = {"forward (sharded)", "forward (sharded, no gradient)", "all sequences done (sharded decoding)", "evaluation (sharded engine)", "checkpoint: shards"}
    assert kinds <= set(collectives), kinds - set(collectives)
    assert_trains_alike(colocated / "fsdp", colocated / "ddp")
    assert_trains_alike(colocated / "fsdp", colocated / "one")
    assert_trains_alike(colocated / "fsdp1", colocated / "one")
    assert read(colocated / "fsdp")[-1]["kl"] > 0
    (sharded,), (ddp,) = read(colocated / "fsdp", "eval.jsonl"), read(colocated / "ddp", "eval.jsonl")
    # The weights differ by up to WEIGHT_TOL, which can flip a sampled token of the 192: the eval
    # rewards agree to one token's worth of the reward, not to float rounding.
    assert sharded.keys() == ddp.keys()
    assert all(abs(sharded[k] - ddp[k]) <= 0.05 for k in ddp if k.startswith("eval/") and "seconds" not in k), (sharded, ddp)
    ckpt = colocated / "fsdp" / "checkpoint-4"
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "optimizer.pt").exists()
    assert sorted(p.name for p in (ckpt / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((colocated / "fsdp").glob(".tmp-*"))


UNEVEN = """import os


class Uneven:
    \"\"\"Rank 0's trajectories end after one turn, rank 1's after three.\"\"\"

    def reset(self, **row):
        self.left = 2 * int(os.environ["RANK"])

    def step(self, text):
        if not self.left:
            return None
        self.left -= 1
        return "ok"
"""


def test_fsdp_colocated_decodes_in_lockstep_across_turns_of_uneven_count(ender, data, tmp_path):
    # From its second turn rank 0 has nothing to generate, and takes part in rank 1's decoding as
    # it does when its completions end first; without it, rank 1 would wait in its forward's gather.
    (tmp_path / "uneven.py").write_text(UNEVEN)
    extra = ["--environment_factory", f"{tmp_path / 'uneven.py'}:Uneven", "--max_completion_length", "96"]
    train(2, args(ender, data, tmp_path / "fsdp", 8, *extra, "--fsdp", "full_shard"), trace=tmp_path / "trace")
    train(2, args(ender, data, tmp_path / "ddp", 8, *extra))
    assert "all trajectories done (sharded turns)" in same_collectives(tmp_path / "trace")
    assert all(m["multi_turn/turns/max"] == 3 for m in read(tmp_path / "fsdp"))  # rank 1's
    assert all(len(c["turns"]["versions"]) == 1 for c in read(tmp_path / "fsdp", "completions.jsonl"))  # rank 0 logs its own
    assert_trains_alike(tmp_path / "fsdp", tmp_path / "ddp")


def test_a_sharded_checkpoint_resumes_bitwise_and_exports_as_a_model(colocated, ender, data, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(colocated / "fsdp", out)
    shutil.rmtree(out / "checkpoint-4")
    (out / "latest").write_text("checkpoint-2\n")
    extra = ["--beta", "0.04", "--eval_dataset", colocated / "held_out.jsonl", "--eval_num_generations", "2", "--sync_ref_model", "true", "--ref_model_sync_steps", "2"]
    train(2, args(ender, data, out, 8, *extra, "--fsdp", "full_shard", "--save_steps", "2", "--resume_from_checkpoint", "latest"))
    assert [m["loss"] for m in read(out)] == [m["loss"] for m in read(colocated / "fsdp")]
    whole = exported(colocated / "fsdp" / "checkpoint-4", tmp_path / "whole")
    resumed = exported(out / "checkpoint-4", tmp_path / "again")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), "weights must be bitwise equal"
    # `tandem eval` reads a sharded checkpoint as it is, and scores it as it scores the export
    held_out = colocated / "held_out.jsonl"
    scores = [cli_here("eval", "--model", m, "--dataset", held_out, "--reward_funcs", f"{data.parent / 'digits.py'}:digits",
                      "--max_completion_length", "16", "--out", tmp_path / f"{i}.json") for i, m in enumerate([out / "checkpoint-4", tmp_path / "again"])]  # fmt: skip
    assert [p.returncode for p in scores] == [0, 0], scores[0].stderr[-2000:]
    first, second = ({k: v for k, v in json.loads((tmp_path / f"{i}.json").read_text()).items() if k.startswith("eval/") and "seconds" not in k} for i in (0, 1))
    assert first and first == second
    ddp = load_file(colocated / "ddp" / "checkpoint-4" / "model.safetensors")
    assert sorted(whole) == sorted(ddp)
    assert max((whole[k] - ddp[k]).abs().max().item() for k in ddp) < WEIGHT_TOL


def test_a_sharded_checkpoint_on_another_number_of_processes_is_refused_naming_both(colocated, ender, data, tmp_path):
    proc = subprocess.run(command(1, args(ender, data, tmp_path / "x", 16, "--fsdp", "full_shard", "--resume_from_checkpoint", colocated / "fsdp" / "checkpoint-2")),
                          capture_output=True, text=True, timeout=120, env=ENV)  # fmt: skip
    assert proc.returncode == 2
    assert "written by 2 processes, this run has 1" in proc.stderr and "tandem export" in proc.stderr, proc.stderr[-2000:]
    proc = cli_here("export", colocated / "ddp" / "checkpoint-2", tmp_path / "y")
    assert proc.returncode == 2 and "not a sharded checkpoint" in proc.stderr


def test_two_nodes_of_one_process_train_like_one_node_of_two(colocated, ender, data, tmp_path):
    """Two torchrun agents, each a node (--nnodes 2), meeting at a c10d rendezvous on loopback."""
    out = tmp_path / "nodes"
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
              "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "tandem-test", "-m", "tandem.cli", "train"]  # fmt: skip
    run = [*launch, *map(str, args(ender, data, out, 8, "--fsdp", "full_shard", "--beta", "0.04", "--sync_ref_model", "true", "--ref_model_sync_steps", "2"))]
    nodes = [subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    try:
        errors = [node.communicate(timeout=300)[1] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    assert [m["loss"] for m in read(out)] == [m["loss"] for m in read(colocated / "fsdp")]


@pytest.fixture(scope="module")
def server(ender):
    s = Server(ender)
    yield s
    s.stop()


def server_args(ender, data, out, url, mode, *extra):
    # The server batches two runs' requests differently, which moves the last bits of the behaviour
    # log-probs; without the correction they stay out of the loss (as in test_async).
    return args(ender, data, out, 8, "--rollout_mode", "server", "--rollout_server_urls", url, "--async_generate", str(mode == "async"),
                "--verify_weight_sync", "true", "--off_policy_correction", "none", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def sharded_sync(ender, data, server, tmp_path_factory):
    """fsdp on 2 processes with the server, in sync mode."""
    out = tmp_path_factory.mktemp("server") / "fsdp"
    train(2, server_args(ender, data, out, server.url, "sync", "--fsdp", "full_shard"), trace=out.parent / "trace-sync")
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp_with_a_rollout_server_trains_like_ddp_and_pushes_what_it_trains(ender, data, server, sharded_sync, tmp_path, mode):
    sharded, extra = sharded_sync, []
    if mode == "async":  # with partial rollouts: sequences carried across the sharded pushes
        sharded, extra = tmp_path / "fsdp", ["--max_staleness", "2", "--max_tokens_per_round", "8"]
        train(2, server_args(ender, data, sharded, server.url, mode, "--fsdp", "full_shard", *extra), trace=tmp_path / "trace-async")
    collectives = same_collectives(sharded.parent / f"trace-{mode}")
    assert "gather weights" in collectives and ("all together: rounds ahead generated" in collectives) == (mode == "async")
    train(2, server_args(ender, data, tmp_path / "ddp", server.url, mode, *extra))
    assert_trains_alike(sharded, tmp_path / "ddp")  # and verify_weight_sync checked every push's fingerprint
    assert not list(sharded.glob(".push-*")), "the staged pushes are removed at the end"


def test_a_sync_agent_run_sharded_with_a_rollout_server_trains_like_ddp(ender, data, server, tmp_path):
    # agent_func: each rank runs its own groups' agents against its own endpoint, sharded or not.
    (tmp_path / "rounds_agent.py").write_text(ROUNDS_AGENT)
    extra = ["--reward_funcs", "environment", "--agent_func", f"{tmp_path / 'rounds_agent.py'}:rounds", "--max_completion_length", "96"]
    train(2, server_args(ender, data, tmp_path / "fsdp", server.url, "sync", *extra, "--fsdp", "full_shard"))
    train(2, server_args(ender, data, tmp_path / "ddp", server.url, "sync", *extra))
    assert all(m["multi_turn/turns/max"] > 1 and m["agents/errors"] == 0 for m in read(tmp_path / "fsdp"))
    assert_trains_alike(tmp_path / "fsdp", tmp_path / "ddp")


def test_a_restarted_server_gets_the_staged_weights_back_and_the_run_goes_on(ender, data, sharded_sync, tmp_path):
    """The client's copy of the last push is its staging on disk: a new server process gets it."""
    server = Server(ender)
    out = tmp_path / "restarted"
    run = server_args(ender, data, out, server.url, "sync", "--fsdp", "full_shard", "--rollout_server_timeout", "90")
    trainer = subprocess.Popen(command(2, run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        stderr, server = restart_server_mid_run(server, ender, trainer, out, step=2)
    finally:
        server.stop()
    assert trainer.returncode == 0, stderr[-20000:]
    assert f"rollout server {server.url} restarted" in stderr
    assert [m["loss"] for m in read(out)] == [m["loss"] for m in read(sharded_sync)]


def test_killing_the_server_stops_every_sharded_process_with_an_error_naming_it(ender, data, tmp_path):
    server = Server(ender)
    out = tmp_path / "killed"
    run = args(ender, data, out, 8, "--max_steps", "100000", "--rollout_mode", "server", "--rollout_server_urls", server.url,
               "--rollout_server_timeout", "5", "--async_generate", "true", "--fsdp", "full_shard")  # fmt: skip
    trainer = subprocess.Popen(command(2, run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    stderr, waited = kill_server_mid_run(server, trainer, out, step=2, timeout=60)
    assert trainer.returncode != 0
    assert f"rollout server {server.url}" in stderr and "rollout_server_timeout=5.0s" in stderr, stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes still running: {leftovers}"


@pytest.mark.quick
def test_staged_weights_read_back_bucket_by_bucket_with_the_same_fingerprint(tmp_path):
    g = torch.Generator().manual_seed(0)
    named = [(f"layer.{i}.weight", torch.randn(64, 64, generator=g)) for i in range(5)] + [("a.bias", torch.randn(7, generator=g))]
    staged = StagedWeights.write(iter(named), tmp_path / "push", bucket_bytes=2 * 64 * 64 * 4)
    assert len(staged) == len(named) and len(staged.files) == len(list(buckets(named, 2 * 64 * 64 * 4))) == 3
    assert fingerprint(staged) == fingerprint(named)
    assert {k: v for b in staged.buckets() for k, v in b.items()}.keys() == dict(named).keys()
    assert all(torch.equal(dict(named)[k], t) for k, t in staged)
    again = StagedWeights.write(iter(named[:2]), tmp_path / "push", bucket_bytes=2 * 64 * 64 * 4)  # a crashed run's staging is replaced
    assert len(again) == 2 and fingerprint(again) == fingerprint(named[:2])
    again.remove()
    assert not (tmp_path / "push").exists()


ACCELERATE_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: false
  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


@pytest.mark.quick
def test_an_accelerate_fsdp_config_file_shards_the_run_as_it_says(ender, data, tmp_path):
    (tmp_path / "fsdp.yaml").write_text(ACCELERATE_FSDP)
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp.yaml"), "--main_process_port", str(free_port())]
    proc = subprocess.run([*launch, "-m", "tandem.cli", "train", *map(str, args(ender, data, out, 8, "--max_steps", "2"))],
                          capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["fsdp"] == "shard_grad_op" and resolved["fsdp_config"] == {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
    assert sorted(p.name for p in (out / "checkpoint-2" / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.quick
def test_what_tandem_cannot_take_from_an_accelerate_fsdp_config_is_a_config_error():
    # (accelerate itself stops an fsdp_version 1 run on a CPU before tandem starts; on GPUs tandem says it)
    base = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    for env, message in [({**base, "FSDP_VERSION": "1"}, "set fsdp_version: 2"), ({**base, "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params")]:
        with pytest.raises(ConfigError, match=message):
            from_accelerate_config(TrainConfig(), env)
    config = TrainConfig(fsdp="full_shard")
    from_accelerate_config(config, {**base, "FSDP_RESHARD_AFTER_FORWARD": "false"})
    assert config.fsdp == "full_shard", "an fsdp option given wins over the environment"
