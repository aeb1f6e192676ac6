"""TRL's and ms-swift's option names: every TRL 1.16 GRPOConfig option is the same, mapped or
refused by name; a config written for TRL runs as it is, or stops at once naming each option."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from conftest import cli_here
from tandem.cli import build_parser
from tandem.trainer import compat
from tandem.trainer.config import ConfigError, TrainConfig, config_from_args

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
BASE = ["train", "--model_name_or_path", "/nonexistent/model", "--dataset_name", "/nonexistent/data.jsonl", "--reward_funcs", "exact_match"]


def trl_options() -> list[str]:
    """TRL's own GRPOConfig options: from trl where it is installed (bench/.venv-trl), else the list
    tests/trl_grpo_config_options.txt, written from the trl-1.16.0 wheel's grpo_config.py."""
    if importlib.util.find_spec("trl") is not None:
        from transformers import TrainingArguments
        from trl import GRPOConfig

        inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
        return [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited or f.name in ("learning_rate", "remove_unused_columns")]
    lines = (Path(__file__).with_name("trl_grpo_config_options.txt")).read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def test_every_trl_grpo_option_is_the_same_mapped_or_refused():
    options = trl_options()
    assert len(options) >= 77  # the issue counted 77 of GRPOConfig's own
    unknown = [name for name in options if name not in compat.OPTIONS]
    assert not unknown, f"TRL options in no column: {unknown}"
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in options:
        option = compat.OPTIONS[name]
        assert option.kind in (compat.SAME, compat.MAPPED, compat.REFUSED), name
        # "the same" is a tandem option of that very name, with TRL's default
        assert (option.kind == compat.SAME) <= (name in fields), name


@pytest.mark.parametrize("name", [n for n, o in compat.OPTIONS.items() if o.kind == compat.SAME and n in {f.name for f in dataclasses.fields(TrainConfig)}])
def test_the_same_options_keep_trls_default(name):
    # TRL 1.16's defaults, read from its grpo_config.py (and TrainingArguments' for its options)
    trl_defaults = {
        "learning_rate": 1e-6, "disable_dropout": False, "cast_lm_head_to_fp32": False, "num_generations": 8, "max_completion_length": 512,
        "shuffle_dataset": True, "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "chat_template_kwargs": None, "repetition_penalty": 1.0, "beta": 0.0, "num_iterations": 1, "epsilon": 0.2, "delta": None,
        "epsilon_high": None, "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
        "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "importance_sampling_level": "token", "reward_weights": None, "loss_type": "dapo",
        "mask_truncated_completions": False, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512,
        "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
        "entropy_coef_delta": 0.005, "entropy_target": 0.2, "off_policy_mask_threshold": None, "use_bias_correction_kl": True,
        "model_init_kwargs": None, "trust_remote_code": False, "scale_rewards": "group", "gradient_accumulation_steps": 1,
        "per_device_train_batch_size": 8, "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0, "max_grad_norm": 1.0,
        "warmup_ratio": 0.0, "warmup_steps": 0, "seed": 42, "save_total_limit": None, "ddp_timeout": 1800.0, "lr_scheduler_type": "linear",
        "max_tool_calling_iterations": None, "optim": "adamw_torch_fused",
    }  # fmt: skip
    if name not in trl_defaults:
        pytest.skip(f"{name}: a TrainingArguments option whose default is the run's own (output_dir, max_steps, ...)")
    declared = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    default = declared.default_factory() if declared.default is dataclasses.MISSING else declared.default
    # steps_per_generation and epsilon_high default to None and follow other options, in both
    assert default == trl_defaults[name], (name, default, trl_defaults[name])


def _config(*extra, config_file=None) -> TrainConfig:
    argv = BASE + list(extra) + (["--config", str(config_file)] if config_file else [])
    return config_from_args(build_parser().parse_args(argv))


TRL_CONFIG = """\
# a config written for TRL 1.16's GRPOConfig, with the TrainingArguments GRPO configs set
output_dir: {out}
learning_rate: 1.0e-5
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
max_steps: 100
max_tool_calling_iterations: 3
warmup_steps: 10
logging_steps: 5
save_strategy: steps
save_steps: 50
bf16: false
report_to: none
num_generations: 4
max_completion_length: 256
use_vllm: true
vllm_mode: server
vllm_server_host: 10.0.0.3
vllm_server_port: 8001
vllm_importance_sampling_mode: token_truncate
loss_type: grpo
beta: 0.04
num_generations_eval: 2
scale_rewards: false
remove_unused_columns: false
log_completions: true
"""


def test_a_trl_config_runs_as_it_is_with_what_was_mapped_listed(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text(TRL_CONFIG.format(out=tmp_path / "run"))
    cfg = _config(config_file=path)
    assert cfg.rollout_mode == "server" and cfg.rollout_server_urls == ["http://10.0.0.3:8001"]
    assert (cfg.learning_rate, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.loss_type) == (1e-5, 8, 2, "grpo")
    assert cfg.warmup_steps == 10 and cfg.warmup() == 10 and cfg.off_policy_correction == "token_truncate"
    assert cfg.eval_num_generations == 2 and cfg.scale_rewards == "none" and cfg.max_tool_calling_iterations == 3
    notes = "\n".join(cfg.notes)
    assert "logging_steps: tandem logs every step to metrics.jsonl" in notes
    assert "num_generations_eval -> eval_num_generations 2" in notes
    assert "use_vllm: use_vllm with vllm_mode server: rollout_mode server" in notes
    # The CLI prints the list at start (and fails later, here, on the model that does not exist).
    proc = cli_here("train", "--config", path, "--model_name_or_path", tmp_path / "no_model", "--dataset_name", tmp_path / "d.jsonl",
                    "--reward_funcs", "exact_match")  # fmt: skip
    assert "tandem: from TRL's and ms-swift's names:\n  " in proc.stdout and "vllm_server_host -> rollout_server_urls" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(
    "line, message",
    [
        ("use_vllm: true\nvllm_mode: colocate", "vllm_mode='colocate': vLLM inside the training process is not built in tandem"),
        ("label_smoothing_factor: 0.1", "label_smoothing_factor=0.1: a transformers TrainingArguments option that tandem does not use; remove it (its default, 0.0"),
        ("learning_rate: null", "learning_rate: null is not allowed"),
        ("num_generations_eval: 0", "num_generations_eval (tandem's eval_num_generations)=0: must be >= 1"),
        ("model_init_kwargs: {dtype: float8}", "model_init_kwargs={'dtype': 'float8'}: its dtype must be one of"),
        ("warmup_steps: 7.5", "warmup_steps=7.5: must be a whole number of steps, or a share of max_steps"),
        ("gradient_checkpointing_kwargs: {use_reentrant: true}", "only {use_reentrant: false} is accepted"),
        ("vllm_gpu_memory_utilization: 0.9", "give it to the rollout server (`tandem rollout --engine vllm --gpu-memory-utilization`)"),
        ("generation_kwargs: {top_p: 0.9, stop: ['x']}", "['stop'] have no tandem equivalent"),
        ("multi_objective_aggregation: normalize_then_sum", "normalize_then_sum (GDPO) is not built"),
        ("push_to_hub: true", "tandem train does not upload to the hub"),
        ("optim: adafactor", "optim='adafactor': must be one of ('adamw_torch_fused', 'adamw_torch')"),
        ("vllm_server_base_url: http://a:1\nrollout_server_urls: [http://b:2]", "rollout_server_urls is given twice"),
    ],
)
def test_a_trl_option_tandem_cannot_honour_is_refused_by_name(tmp_path, line, message):
    path = tmp_path / "trl.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(config_file=path)


def test_trl_and_ms_swift_names_work_on_the_command_line_too():
    cfg = _config("--vllm_server_base_url", "http://h:9", "--rollout_mode", "server", "--overlong_filter", "true",
                  "--generation_kwargs", '{"top_k": 5, "max_tokens": 64}', "--vllm_importance_sampling_correction", "false")  # fmt: skip
    assert cfg.rollout_server_urls == ["http://h:9"] and cfg.mask_truncated_completions is True
    assert (cfg.top_k, cfg.max_completion_length, cfg.off_policy_correction) == (5, 64, "none")
    # ms-swift's lists of hosts and ports
    cfg = _config("--rollout_mode", "server", "--vllm_server_host", "a", "b", "--vllm_server_port", "1", "2")
    assert cfg.rollout_server_urls == ["http://a:1", "http://b:2"]


def test_generation_batch_size_sets_the_steps_per_generation(monkeypatch):
    # 64 completions a round over 2 processes of 8 per micro-batch: 4 micro-batches a round each
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _config("--per_device_train_batch_size", "8", "--generation_batch_size", "64").steps_per_generation == 4
    with pytest.raises(ConfigError, match="must be a multiple of per_device_train_batch_size \\* processes = 16"):
        _config("--per_device_train_batch_size", "8", "--generation_batch_size", "40")
    with pytest.raises(ConfigError, match="give one of the two"):
        _config("--per_device_train_batch_size", "8", "--generation_batch_size", "64", "--steps_per_generation", "2")


def test_the_docs_table_is_the_codes():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert compat.markdown() in page, "docs/configuration.md's table differs: paste `python -m tandem.trainer.compat` into it"


def test_options_read_with_another_see_it_whichever_layer_gave_it(tmp_path):
    # Resolved one source at a time, YAML warmup_steps 10 with --max_steps 1000 warmed up 100
    # steps (a ratio of the YAML's own max_steps), 7 of 25 became ceil(0.28 * 25) = 8, and a
    # YAML host with a port on the command line connected to 127.0.0.1.
    path = tmp_path / "trl.yaml"
    path.write_text("warmup_steps: 10\nmax_steps: 100\nuse_vllm: true\nvllm_mode: server\nvllm_server_host: 10.0.0.3\n")
    cfg = _config("--max_steps", "1000", "--vllm_server_port", "9000", config_file=path)
    assert (cfg.max_steps, cfg.warmup(), cfg.rollout_server_urls) == (1000, 10, ["http://10.0.0.3:9000"])
    path.write_text("warmup_steps: 7\nmax_steps: 25\n")
    assert _config(config_file=path).warmup() == 7 and _config(config_file=path).to_dict()["warmup_steps"] == 7
    assert _config("--warmup_steps", "0.1", "--max_steps", "25").warmup() == 3  # transformers 5: below 1, a share, rounded up
    # the command line still overrides the file's option under another name that sets the same one
    path.write_text("vllm_server_base_url: http://a:1\nrollout_mode: server\n")
    assert _config("--rollout_server_urls", "http://b:2", config_file=path).rollout_server_urls == ["http://b:2"]


def test_a_later_layer_overrides_only_what_it_sets_and_the_files_own_values_are_checked(tmp_path):
    path = tmp_path / "trl.yaml"
    # --temperature overrides one of the three options generation_kwargs sets: the other two stay
    path.write_text("generation_kwargs: {temperature: 0.9, top_k: 20, max_tokens: 256}\n")
    cfg = _config("--temperature", "0.7", config_file=path)
    assert (cfg.temperature, cfg.top_k, cfg.max_completion_length) == (0.7, 20, 256)
    assert any("top_k set as tandem's options; temperature given again later" in n for n in cfg.notes), cfg.notes
    # TRL's correction switched on again on the command line overrides the file's none
    path.write_text("off_policy_correction: none\n")
    assert _config("--vllm_importance_sampling_correction", "true", config_file=path).off_policy_correction == "sequence_mask"
    path.write_text("vllm_importance_sampling_mode: token_mask\nvllm_importance_sampling_correction: true\n")
    assert _config(config_file=path).off_policy_correction == "token_mask"
    # a bad value the command line overrides is still refused, naming the file
    path.write_text("max_steps: five\n")
    with pytest.raises(ConfigError, match=f"max_steps='five': expected int \\(in {path}\\)"):
        _config("--max_steps", "2", config_file=path)
    # TRL evaluates nothing under eval_strategy no; a later eval_dataset asks for it, one beside it contradicts it
    path.write_text("eval_strategy: 'no'\n")
    assert _config("--eval_dataset", "x.jsonl", config_file=path).eval_dataset == "x.jsonl"
    assert _config("--eval_strategy", "no", "--eval_steps", "0").eval_dataset is None
    path.write_text("eval_strategy: 'no'\neval_dataset: x.jsonl\n")
    with pytest.raises(ConfigError, match="eval_dataset is given twice .* as eval_strategy='no' \\(which sets it to None\\)"):
        _config(config_file=path)


def test_a_grpo_config_dumped_by_trl_runs_as_it_is(tmp_path):
    # tests/trl_grpo_config_dump.yaml: `yaml.safe_dump(GRPOConfig(output_dir="runs/trl", bf16=False).to_dict())`
    # with trl 1.16.0 and transformers 5.23.0: every option of GRPOConfig and TrainingArguments,
    # 60 of them null (TRL's defaults), hub_token as its placeholder, max_steps -1 (epochs).
    dump = Path(__file__).with_name("trl_grpo_config_dump.yaml")
    nulls = {k for k, v in yaml.safe_load(dump.read_text()).items() if v is None and k in compat.OPTIONS}
    assert nulls <= compat.TRL_NULL_DEFAULTS, nulls - compat.TRL_NULL_DEFAULTS  # the table of TRL's null defaults is TRL's
    cfg = _config("--max_steps", "4", config_file=dump)
    assert (cfg.eval_num_generations, cfg.num_completions_to_log, cfg.importance_sampling_cap) == (4, 4, 3.0)  # nulls: tandem's defaults
    assert (cfg.eval_steps, cfg.fsdp, cfg.loss_type, cfg.learning_rate, cfg.gradient_checkpointing) == (0, "", "dapo", 1e-6, True)
    notes = "\n".join(cfg.notes)
    assert "num_train_epochs: no effect: max_steps 4 is given" in notes and "TrainingArguments options tandem does not use, at their defaults" in notes
    # without max_steps, its -1: the steps follow from num_train_epochs, as TRL's do (trainer/build.py)
    cfg = _config(config_file=dump)
    assert (cfg.max_steps, cfg.num_train_epochs) == (-1, 3.0)
    assert [cfg.steps_for_epochs(100, 1), cfg.steps_for_epochs(100, 2)] == [300, 150]  # a round is 1 prompt a process, 1 step
    # rounds of 16 completions, 4 prompts, a step each; a dataset short of a round still trains a step an epoch
    cfg = _config("--num_train_epochs", "0.5", "--max_steps", "0", "--gradient_accumulation_steps", "2", "--num_generations", "4")
    assert [cfg.steps_for_epochs(160, 1), cfg.steps_for_epochs(3, 1)] == [20, 1]
