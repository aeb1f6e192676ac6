"""Config loading, overrides and validation, through the real CLI where it matters."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_here, run_cli
from tandem.cli import build_parser
from tandem.trainer.config import ConfigError, TrainConfig, config_from_args

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole

BASE = ["train", "--model_name_or_path", "/nonexistent/model", "--dataset_name", "/nonexistent/data.jsonl", "--reward_funcs", "exact_match"]


def _config(*extra, config_file=None) -> TrainConfig:
    argv = BASE + list(extra) + (["--config", str(config_file)] if config_file else [])
    return config_from_args(build_parser().parse_args(argv))


def test_yaml_then_command_line_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learning_rate: 1e-5\nnum_generations: 4\nper_device_train_batch_size: 8\nreward_weights: [2]\n")
    cfg = _config("--learning_rate", "3e-4", config_file=f)
    assert cfg.learning_rate == 3e-4  # command line wins
    assert cfg.num_generations == 4  # from YAML
    assert cfg.reward_weights == [2.0]
    assert cfg.steps_per_generation == cfg.gradient_accumulation_steps == 1
    assert cfg.epsilon_high == cfg.epsilon


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--num_generations", "1"], "num_generations"),
        (["--num_generations", "3", "--per_device_train_batch_size", "8"], "per_device_train_batch_size"),
        (["--epsilon", "0"], "epsilon"),
        (["--epsilon", "-0.1"], "epsilon"),
        (["--loss_type", "ppo"], "loss_type"),
        (["--scale_rewards", "median"], "scale_rewards"),
        (["--temperature", "0"], "temperature"),
        (["--reward_weights", "1", "2"], "reward_weights"),
        (["--gradient_accumulation_steps", "2", "--steps_per_generation", "3"], "steps_per_generation"),
        (["--max_steps", "0"], "max_steps"),
        (["--reward_timeout", "0"], "reward_timeout"),
        (["--reward_on_timeout", "skip"], "reward_on_timeout"),
        (["--reward_model_dtype", "int8"], "reward_model_dtype"),
        (["--reward_model_batch_size", "0"], "reward_model_batch_size"),
        (["--reward_num_workers", "-1"], "reward_num_workers"),
        (["--max_resample_times", "-1"], "max_resample_times"),
        (["--fsdp", "hybrid_shard"], "fsdp"),
        (["--fsdp", "full_shard shard_grad_op"], "fsdp"),
        (["--fsdp", "full_shard", "--fsdp_config", '{"offload_params": true}'], "fsdp_config"),
        (["--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 1}'], "fsdp_config"),
        (["--fsdp", "full_shard", "--fsdp_config", '{"reshard_after_forward": "yes"}'], "fsdp_config"),
        (["--fsdp", "full_shard", "--fsdp_config", "[1, 2]"], "fsdp_config"),
        (["--fsdp", "full_shard", "--fsdp_config", "{not json"], "fsdp_config"),
        (["--fsdp_config", '{"version": 2}'], "fsdp_config"),
        (["--fsdp", "full_shard", "--use_peft", "true"], "fsdp"),
        (["--fsdp", "full_shard", "--dynamic_sample", "true"], "fsdp"),
        (["--fsdp", "full_shard", "--max_tokens_per_round", "8", "--max_staleness", "2"], "fsdp"),  # colocated: ranks' calls differ
        (["--tools", "calculator", "--tool_parser", "xml"], "tool_parser"),
        (["--tools", "calculator", "--tool_timeout", "0"], "tool_timeout"),
        (["--tools", "calculator", "--max_tool_calling_iterations", "-1"], "max_tool_calling_iterations"),
        (["--tools", "calculator", "--max_tool_response_tokens", "0"], "max_tool_response_tokens"),
        (["--rollout_func", "agent.py:run", "--fsdp", "full_shard"], "fsdp"),
        (["--reward_funcs", "environment"], "reward_funcs"),
        (["--rollout_func", "agent.py:run", "--tools", "calculator"], "rollout_func"),
        (["--rollout_mode", "server", "--async_generate", "true", "--max_tokens_per_round", "0"], "max_tokens_per_round"),
        (["--rollout_mode", "server", "--async_generate", "true", "--max_tokens_per_round", "8", "--rollout_func", "agent.py:run"], "max_tokens_per_round"),
        # Values that trained nothing or never ended, and ones that failed only once the model had loaded.
        (["--learning_rate", "inf"], "learning_rate"),
        (["--max_grad_norm", "inf"], "max_grad_norm"),
        (["--ddp_timeout", "inf"], "ddp_timeout"),
        (["--rollout_server_timeout", "inf"], "rollout_server_timeout"),
        (["--reward_weights", "nan"], "reward_weights"),
        (["--reward_weights", "inf"], "reward_weights"),
        (["--weight_decay", "-0.1"], "weight_decay"),
        (["--adam_beta1", "1.5"], "adam_beta1"),
        (["--adam_beta2", "-0.1"], "adam_beta2"),
        (["--lr_scheduler_type", "cosinus"], "lr_scheduler_type"),
        (["--seed", "-1"], "seed"),
        (["--seed", str(2**32)], "seed"),
    ],
)
def test_bad_values_name_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        _config(*extra)


def test_fsdp_config_is_a_mapping_in_yaml_json_or_a_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("fsdp: full_shard auto_wrap\nfsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: [Qwen2DecoderLayer]\n")
    assert _config(config_file=f).fsdp_config == {"fsdp_transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
    assert _config("--fsdp", "shard_grad_op", "--fsdp_config", '{"reshard_after_forward": true}').fsdp_config == {"reshard_after_forward": True}
    (tmp_path / "fsdp.json").write_text('{"version": 2}')
    assert _config("--fsdp", "full_shard", "--fsdp_config", str(tmp_path / "fsdp.json")).fsdp_config == {"version": 2}


def test_unknown_yaml_key_fails_with_a_suggestion(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learning_rte: 1e-5\n")
    with pytest.raises(ConfigError, match="unknown key 'learning_rte'.*did you mean 'learning_rate'"):
        _config(config_file=f)


def test_wrong_yaml_type_names_the_field(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("num_generations: eight\n")
    with pytest.raises(ConfigError, match="num_generations"):
        _config(config_file=f)


def test_bad_config_fails_through_the_cli_before_the_model_loads(tmp_path):
    # The model path does not exist: the error must be about the field, reached before any load.
    proc = run_cli(*BASE, "--num_generations", "1", "--output_dir", tmp_path / "run")
    assert proc.returncode == 2
    assert "num_generations" in proc.stderr and "/nonexistent/model" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_options_without_effect_in_the_run_warn_naming_what_they_need():
    warnings = _config("--eval_steps", "5", "--max_staleness", "2", "--lora_r", "8", "--verify_weight_sync", "true").warnings()
    assert "eval_steps=5 has no effect without an eval_dataset" in warnings
    assert "max_staleness=2 has no effect without async_generate true or max_tokens_per_round" in warnings
    assert "lora_r=8 has no effect without use_peft true" in warnings
    assert "verify_weight_sync=True has no effect without rollout_mode server" in warnings
    partial = _config("--rollout_mode", "server", "--async_generate", "true", "--max_tokens_per_round", "8").warnings()
    assert any("max_tokens_per_round with max_staleness 1 carries no sequence across versions" in w for w in partial)
    colocated = _config("--max_tokens_per_round", "8", "--max_staleness", "2", "--off_policy_correction", "token_mask").warnings()
    assert colocated == []  # partial rollouts take max_staleness, and correct for their older tokens, colocated too
    assert _config().warnings() == []  # defaults never warn
    assert _config("--use_peft", "true", "--lora_r", "8").warnings() == []


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (lambda d: (d / "bad.yaml").write_text("learning_rate: [1e-5\n"), ["--config", "{d}/bad.yaml"], "config file {d}/bad.yaml is not valid YAML"),
        (lambda d: None, ["--model_name_or_path", "{d}/no_such_model"], "model_name_or_path={d}/no_such_model: no such folder"),
        (lambda d: (d / "out").write_text(""), ["--output_dir", "{d}/out"], "output_dir={d}/out is a file; give a folder"),
        (lambda d: (d / "afile").write_text(""), ["--output_dir", "{d}/afile/run"], "output_dir={d}/afile/run: cannot write there (Not a directory)"),
        (lambda d: (d / "q.jsonl").write_text('{"question": "1+1="}\n'), ["--dataset_name", "{d}/q.jsonl"], "has no 'prompt' column"),
    ],
)
def test_a_users_mistake_ends_with_exit_code_2_and_one_message(tiny_model, tmp_path, make, extra, message):
    # Each was a raw traceback (yaml's, transformers' "Repo id must be in the form", mkdir's
    # OSError) or a clear message under a traceback with exit code 1.
    make(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = ["train", "--model_name_or_path", tiny_model, "--dataset_name", data, "--reward_funcs", "exact_match", "--output_dir", tmp_path / "run"]
    args += [a.format(d=tmp_path) for a in extra]
    proc = cli_here(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message.format(d=tmp_path) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    os.environ["TANDEM_DEBUG"] = "1"  # the traceback on request
    try:
        assert "Traceback" in cli_here(*args).stderr
    finally:
        del os.environ["TANDEM_DEBUG"]


def test_unknown_command_line_option_fails_with_a_suggestion():
    proc = cli_here(*BASE, "--learning_rte", "1e-5", "--numgenerations", "4", "--learning_rat", "1e-4")  # a prefix is not taken
    assert proc.returncode == 2
    assert "unknown option --learning_rte; did you mean --learning_rate?" in proc.stderr
    assert "unknown option --numgenerations; did you mean --num_generations?" in proc.stderr
    assert "unknown option --learning_rat; did you mean --learning_rate?" in proc.stderr
    assert len(proc.stderr.splitlines()) == 3 and "usage:" not in proc.stderr, proc.stderr  # one line each, no usage block


def test_the_console_script_imports_module_specs_from_the_working_directory(tmp_path):
    """`tandem` (the installed script, not `python -m`) imports a module beside the user, as `python -m` would."""
    (tmp_path / "my_rewards.py").write_text('raise SystemExit("my_rewards imported")\n')
    proc = subprocess.run([Path(sys.executable).with_name("tandem"), *BASE[:-1], "my_rewards:fn"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)  # fmt: skip
    assert "my_rewards imported" in proc.stderr, proc.stderr[-2000:]


def test_trl_names_of_the_off_policy_options_are_accepted(tmp_path):
    cfg = _config("--vllm_importance_sampling_mode", "token_truncate", "--vllm_importance_sampling_clip_max", "2.5",
                  "--vllm_importance_sampling_clip_min", "0.5")  # fmt: skip
    assert (cfg.off_policy_correction, cfg.importance_sampling_cap, cfg.importance_sampling_clip_min) == ("token_truncate", 2.5, 0.5)
    assert _config("--vllm_importance_sampling_correction", "false").off_policy_correction == "none"
    assert _config("--vllm_importance_sampling_cap", "4").importance_sampling_cap == 4.0  # TRL's deprecated name
    f = tmp_path / "trl.yaml"
    f.write_text("vllm_importance_sampling_mode: token_mask\nvllm_importance_sampling_clip_max: 2\n")
    cfg = _config(config_file=f)
    assert (cfg.off_policy_correction, cfg.importance_sampling_cap) == ("token_mask", 2.0)
    # TRL 1.16's defaults: correction on, sequence_mask, upper bound 3, no lower bound
    default = _config()
    assert (default.off_policy_correction, default.importance_sampling_cap, default.importance_sampling_clip_min) == ("sequence_mask", 3.0, None)
    with pytest.raises(ConfigError, match="off_policy_correction is given twice"):
        _config("--vllm_importance_sampling_mode", "token_mask", "--off_policy_correction", "none")
    with pytest.raises(ConfigError, match="importance_sampling_clip_min"):
        _config("--importance_sampling_clip_min", "1.5")


def test_gspo_with_a_token_sum_loss_warns_and_names_the_loss_type_to_use(tmp_path):
    proc = cli_here(*BASE, "--importance_sampling_level", "sequence", "--loss_type", "dapo", "--output_dir", tmp_path / "run")
    assert "importance_sampling_level 'sequence' with loss_type 'dapo'" in proc.stderr
    assert "use loss_type grpo" in proc.stderr
    proc = cli_here(*BASE, "--importance_sampling_level", "sequence", "--loss_type", "grpo", "--output_dir", tmp_path / "run2")
    assert "importance_sampling_level" not in proc.stderr


def test_help_explains_every_option():
    proc = cli_here("train", "--help")
    assert proc.returncode == 0
    for name in TrainConfig.__dataclass_fields__:
        assert f"--{name}" in proc.stdout, name
    assert "Completions per prompt" in proc.stdout


@pytest.mark.parametrize(
    "cuda, native_cpu, requested, expected, warns",
    [
        (False, False, None, False, False),  # CPU: fp32 unless asked
        (False, True, None, False, False),
        (False, False, True, True, True),  # asked for on a CPU that emulates bf16: a warning
        (False, True, True, True, False),  # AVX512-BF16 or AMX: no warning
        (True, False, None, True, False),  # a CUDA GPU with bf16: on by default, as TRL
        (True, False, False, False, False),
    ],
)
def test_bf16_default_follows_the_hardware(monkeypatch, cuda, native_cpu, requested, expected, warns):
    # The hardware is the outer boundary here: its probes are replaced, the decision is tandem's.
    import torch

    from tandem.trainer.setup import resolve_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_cpu)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    bf16, warning = resolve_bf16(requested)
    assert bf16 is expected
    assert (warning is not None) is warns
    if warns:
        assert "--bf16 true" in warning and "AVX512-BF16" in warning


def test_an_environment_run_without_reward_funcs_is_told_to_give_environment():
    args = build_parser().parse_args(BASE[:-2] + ["--environment_factory", "env.py:Game"])
    with pytest.raises(ConfigError, match="reward_funcs=\\[\\]: give at least one: --reward_funcs environment, the environment's get_reward"):
        config_from_args(args)


def test_rollout_server_urls_take_commas_and_each_is_checked_at_start():
    # one string of several, as environment variables hold them
    assert _config("--rollout_mode", "server", "--rollout_server_urls", "http://a:1,http://b:2").rollout_server_urls == ["http://a:1", "http://b:2"]
    for url, problem in [("localhost:8000", "has no scheme"), ("http://a:port", "has a port that is not a number"), ("ftp://a:1", "has the scheme 'ftp'"),
                         ("http://:80", "has no host")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"rollout_server_urls=.*'{re.escape(url)}' {problem}.*give each as http://HOST:PORT"):
            _config("--rollout_mode", "server", "--rollout_server_urls", "http://ok:1", url)
