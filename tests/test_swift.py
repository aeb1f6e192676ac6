"""ms-swift's command line: its options, reward names, plugins and defaults, and its GRPO example
command under NPROC_PER_NODE against one process of twice the batch."""

import json
import math
import os
import subprocess
import sys

import datasets
import pytest

from conftest import ENV, free_port, train

from tandem.cli import build_parser
from tandem.data import sample_rows
from tandem.data.datasets import swift_messages
from tandem.rewards import score
from tandem.trainer.config import ConfigError, TrainConfig, config_from_args

PLUGIN = '''
from swift.rewards import ORM, AsyncORM, orms


class Seen(ORM):
    """What ms-swift gives a reward: strings, messages ending in the completion, token ids, the state, columns."""

    def __call__(self, completions, messages, response_token_ids, trainer_state, solution, **kwargs):
        assert all(isinstance(c, str) for c in completions) and all(m[-1]["content"] == c for m, c in zip(messages, completions))
        return [len(ids) + len(m) / 10 + self.args.max_completion_length / 1000 for ids, m in zip(response_token_ids, messages)]


class Later(AsyncORM):
    async def __call__(self, completions, **kwargs):
        return [float(len(c.split())) for c in completions]


class ExactMatch(ORM):  # registered under a tandem built-in's name: the plugin's wins
    def __call__(self, completions, **kwargs):
        return [-1.0] * len(completions)


orms["seen"], orms["later"], orms["exact_match"] = Seen, Later, ExactMatch
'''


def _config(*argv) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", "--reward_funcs", "format", *argv]))


@pytest.mark.quick
def test_ms_swifts_options_resolve_to_tandems_and_what_it_cannot_honour_is_refused(tmp_path, monkeypatch):
    cfg = _config("--dataset", "data.jsonl#100", "--tuner_type", "full", "--torch_dtype", "bfloat16", "--deepspeed", "zero2",
                  "--rollout_importance_sampling_mode", "token_truncate", "--rollout_importance_sampling_threshold", "2.0",
                  "--split_dataset_ratio", "0", "--rlhf_type", "grpo", "--lora_rank", "4", "--overlong_filter", "true")  # fmt: skip
    assert (cfg.model_name_or_path, cfg.dataset_name, cfg.dataset_sample) == ("m", "data.jsonl", 100)
    assert (cfg.use_peft, cfg.model_init_kwargs, cfg.bf16, cfg.fsdp, cfg.lora_r) == (False, {"dtype": "bfloat16"}, True, "shard_grad_op", 4)
    assert (cfg.off_policy_correction, cfg.importance_sampling_cap, cfg.mask_truncated_completions) == ("token_truncate", 2.0, True)
    assert _config("--deepspeed", "zero3").fsdp == "full_shard"
    # tandem's defaults (TRL's) unless --defaults swift: then ms-swift's, LoRA's learning rate with LoRA
    assert (_config().use_peft, _config().beta, _config().loss_type, _config().learning_rate) == (False, 0.0, "dapo", 1e-6)
    swift = _config("--defaults", "swift")
    assert (swift.use_peft, swift.lora_r, swift.lora_alpha, swift.lora_target_modules, swift.learning_rate) == (True, 8, 32, ["all-linear"], 1e-4)
    assert (swift.beta, swift.loss_type, swift.temperature, swift.weight_decay, swift.lr_scheduler_type) == (0.04, "grpo", 0.9, 0.1, "cosine")
    assert (swift.per_device_train_batch_size, swift.gradient_accumulation_steps, swift.completions_per_round()) == (1, 16, 16)
    monkeypatch.setenv("WORLD_SIZE", "2")  # ms-swift's 16 completions a step over the processes
    assert _config("--defaults", "swift", "--per_device_train_batch_size", "2").gradient_accumulation_steps == 4
    monkeypatch.delenv("WORLD_SIZE")
    full = _config("--defaults", "swift", "--tuner_type", "full", "--beta", "0")
    assert (full.use_peft, full.learning_rate, full.beta, full.lora_r) == (False, 1e-5, 0.0, 16)  # what is given wins; no LoRA options without LoRA
    refused = [
        (["--deepspeed", "zero1"], "deepspeed='zero1' on the command line: tandem shards with FSDP2: give fsdp full_shard"),
        (["--deepspeed", "ds_config.json"], "offload and DeepSpeed config files are not built"),
        (["--rlhf_type", "dpo"], "tandem trains GRPO; give grpo"),
        (["--split_dataset_ratio", "0.1"], "give eval_dataset"),
        (["--dataset", "a.jsonl#many"], "after '#' give the number of rows"),
        (["--dataset", "a.jsonl", "b.jsonl"], "2 datasets: tandem trains on one"),
        (["--tuner_type", "adalora"], "full.*or LoRA adapters"),
        (["--torch_dtype", "float16"], "tandem trains in float32 or bfloat16"),
        (["--defaults", "verl"], "defaults=.verl.: give tandem or swift"),
        (["--reward_funcs", "soft_overlong"], "soft_overlong reward needs 0 < soft_cache_length < soft_max_length"),
        (["--external_plugins", str(tmp_path / "missing.py")], "are not files"),
    ]
    for argv, message in refused:
        with pytest.raises(ConfigError, match=message):
            _config(*argv)
    with pytest.raises(SystemExit):  # argparse's error: one engine a server
        build_parser().parse_args(["rollout", "--model", "m", "--data_parallel_size", "2"])
    assert build_parser().parse_args(["rollout", "--model", "m", "--vllm_tensor_parallel_size", "2"]).tensor_parallel_size == 2


@pytest.mark.quick
def test_a_dataset_sample_is_ms_swifts_and_its_messages_rows_give_the_prompt():
    rows = datasets.Dataset.from_list([{"i": i} for i in range(6)])
    # 14 of 6 rows: every row twice, then 2 drawn without replacement, by the seed
    picked = sample_rows(rows, 14, seed=3)["i"]
    assert sorted(picked[:12]) == sorted(list(range(6)) * 2) and len(set(picked[12:])) == 2
    assert picked == sample_rows(rows, 14, seed=3)["i"] and sample_rows(rows, 4, seed=3)["i"] != sample_rows(rows, 4, seed=4)["i"]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    ds = swift_messages(datasets.Dataset.from_list([{"messages": [*chat, {"role": "assistant", "content": "a"}]}, {"messages": chat}]))
    assert ds["prompt"] == [chat, chat] and ds["messages"][0][-1]["content"] == "a"


@pytest.mark.quick
def test_ms_swifts_rewards_score_by_its_definitions():
    cfg = TrainConfig(reward_funcs=["format", "cosine", "repetition", "soft_overlong"], max_completion_length=10, soft_cache_length=4)
    rewards = cfg.load_rewards()
    completions = ["<think>a</think> <answer>1/2</answer>", "a b c a b c", "<think>a</think><answer>3</answer> x", "two words"]
    ids = [[0] * 5, [0] * 10, [0] * 8, [0] * 6]
    table = score(rewards, prompts=["p"] * 4, completions=completions, completion_ids=ids, solution=["$0.5$", "7", "3", "no math here"])
    # format: think then answer and nothing after. cosine over 10 tokens: a right answer falls from
    # 1.0 at 0 to 0.5 at 10, 0.5 + 0.5 (1 + cos(pi t/10)) / 2: 0.75 at 5 (1/2 = 0.5), 0.5477 at 8;
    # a wrong one rises from -0.5 to 0.0, -0.5 (1 + cos(pi t/10)) / 2: 0 at 10, -0.1727 at 6.
    # repetition: 3-grams abc bca cab abc, 3 of 4 unique: -1 * 0.25; under 3 words 0.
    # soft_overlong: 0 up to 10 - 4 = 6 tokens, then -1 per 4 beyond.
    expected = [[1.0, 0.75, 0.0, 0.0], [0.0, 0.0, -0.25, -1.0], [0.0, 0.5 + 0.5 * (1 + math.cos(0.8 * math.pi)) / 2, 0.0, -0.5],
                [0.0, -0.5 * (1 + math.cos(0.6 * math.pi)) / 2, 0.0, 0.0]]  # fmt: skip
    assert table.flatten().tolist() == pytest.approx([v for row in expected for v in row], abs=1e-6)
    # accuracy: the <answer> tag's text if there is one, else the boxed answer; an unparsable
    # solution scores 0 (ms-swift's), where tandem's own accuracy has no opinion
    swift = TrainConfig(reward_funcs=["accuracy"], defaults="swift").load_rewards()
    tandem = TrainConfig(reward_funcs=["accuracy"]).load_rewards()
    completions = ["<answer>\\frac{1}{2}</answer>", "so it is \\boxed{3}", "so it is 4", "anything"]
    columns = dict(prompts=["p"] * 4, completions=completions, completion_ids=[[0]] * 4, solution=["$0.5$", "3", "3", "no math here"])
    assert score(swift, **columns)[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert math.isnan(score(tandem, **columns)[3, 0])


@pytest.mark.quick
def test_an_ms_swift_plugin_registers_rewards_that_are_called_as_ms_swift_calls_them(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    cfg = TrainConfig(reward_funcs=["seen", "later", "exact_match"], external_plugins=[str(plugin)], max_completion_length=10)
    rewards = cfg.load_rewards()
    assert [r.name for r in rewards] == ["seen", "later", "exact_match"]
    prompts = [[{"role": "user", "content": "q"}], "plain"]
    completions = [[{"role": "assistant", "content": "x y"}], "z"]  # chat completions reach ms-swift's rewards as text
    table = score(rewards, prompts=prompts, completions=completions, completion_ids=[[1, 2, 3], [4]], solution=["a", "b"], trainer_state=None)
    # seen: tokens + messages / 10 + max_completion_length / 1000 (from args, the run's config)
    assert table.flatten().tolist() == pytest.approx([3.21, 2.0, -1.0, 1.21, 1.0, -1.0])
    with pytest.raises(ConfigError, match="'seen' cannot reach reward_num_workers=2 worker processes"):
        TrainConfig(reward_funcs=["seen"], external_plugins=[str(plugin)], reward_num_workers=2).load_rewards()


def test_ms_swifts_example_command_on_two_processes_trains_like_one_of_twice_the_batch(tiny_model, server, tmp_path):
    # examples/train/grpo/external/grpo_7b.sh with --async_generate true, `swift rlhf --rlhf_type
    # grpo` replaced by `tandem train`, on the tiny model; rewards that vary with its random text
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}], "solution": str(2 * a)}
            for a in range(10)]  # fmt: skip
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)

    def args(out, batch):
        return ["--model", tiny_model, "--reward_funcs", "accuracy", "cosine", "repetition", "soft_overlong", "seen", "--soft_cache_length", "4",
                "--external_plugins", plugin, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
                "--vllm_server_port", server.url.rsplit(":", 1)[1], "--async_generate", "true", "--tuner_type", "full", "--torch_dtype", "float32",
                "--dataset", f"{data}#16", "--load_from_cache_file", "true", "--split_dataset_ratio", "0", "--max_completion_length", "8",
                "--num_train_epochs", "2", "--per_device_train_batch_size", batch, "--learning_rate", "1e-2", "--gradient_accumulation_steps", "2",
                "--save_total_limit", "2", "--logging_steps", "1", "--warmup_ratio", "0.05", "--dataloader_num_workers", "4", "--dataset_num_proc", "4",
                "--num_generations", "4", "--temperature", "1.0", "--top_p", "0.9", "--top_k", "50", "--log_completions", "true",
                "--num_iterations", "1", "--beta", "0.04", "--defaults", "swift", "--output_dir", out, "--disable_tqdm", "true",
                # the server batches two ranks' requests differently, which moves the behaviour
                # log-probs' last bits; the correction would carry them into the loss (test_async)
                "--off_policy_correction", "none"]  # fmt: skip

    train(1, args(tmp_path / "one", "8"))
    env = {**ENV, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    two = subprocess.run([sys.executable, "-m", "tandem.cli", "train", *map(str, args(tmp_path / "two", "4"))], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resolved config (2 process(es), ms-swift's defaults)" in two.stdout
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("one", "two"))
    # 16 prompts of 4 completions, 2 epochs, 4 prompts a round of one step: 8 steps
    assert len(one) == len(two) == 8
    assert [m["reward"] for m in one] == [m["reward"] for m in two] and len({m["reward"] for m in one}) > 1
    assert [m["rewards/seen/mean"] for m in one] == [m["rewards/seen/mean"] for m in two]
    assert [m["loss"] for m in one] == pytest.approx([m["loss"] for m in two], abs=1e-6)
    saved = (tmp_path / "two" / "config.yaml").read_text()
    assert "use_peft: false" in saved and "beta: 0.04" in saved and "loss_type: grpo" in saved and "dataset_sample: 16" in saved
    assert os.path.isdir(tmp_path / "two" / "checkpoint-8")
