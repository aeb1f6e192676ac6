"""TRL's and ms-swift's option names, and what tandem does with each: a config written for TRL
1.16's GRPOConfig (with the TrainingArguments that GRPO configs set) or for ms-swift's GRPO
arguments runs as it is, or stops at once naming each option it cannot honour.

Every TRL 1.16 GRPOConfig option is in OPTIONS, as one of
  same     the same name, meaning and default (a TrainConfig field);
  mapped   a TRL or ms-swift name for a tandem option, resolved into it (the printed config shows
           the result), or a value that means here what tandem does anyway (said in the printed
           list, never dropped silently);
  refused  a config error that says why and what to do instead.
docs/configuration.md holds the table (`python -m tandem.trainer.compat` prints it), and
tests/test_compat.py checks it against TRL's own list of options.
"""

import json
from dataclasses import dataclass
from typing import Callable

SAME, MAPPED, REFUSED = "same", "mapped", "refused"


class Refused(ValueError):
    """A value tandem cannot honour; the message says why and what to do."""


@dataclass(frozen=True)
class Option:
    kind: str
    doc: str  # what tandem does with it, for the table
    # raw value, every given value -> (tandem options it sets, a line for the printed list or None);
    # raises Refused. None: a TrainConfig field of the same name (kind "same").
    resolve: Callable[[object, dict], tuple[dict, str | None]] | None = None


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no", "none", "null"):
        return False
    raise Refused(f"expected true or false, got {value!r}")


def _given(value) -> bool:
    """Whether a value asks for something (not None, empty, false or 0)."""
    return value not in (None, "", [], {}, False, 0, "none", "null", "None", "false", "False", "0")


def rename(target: str, doc: str = "") -> Option:
    return Option(MAPPED, doc or f"`{target}`", lambda v, _: ({target: v}, None))


def inert(ok: Callable[[object], bool], why: str, instead: str) -> Option:
    """Accepted when `ok(value)` (what tandem does anyway: said in the printed list), else refused."""

    def resolve(value, _):
        if ok(value):
            return {}, why
        raise Refused(f"{why}; {instead}")

    return Option(MAPPED, f"no effect: {why}" + (f"; otherwise refused: {instead}" if instead else ""), resolve)


def refuse(why: str) -> Option:
    def resolve(value, _):
        raise Refused(why)

    return Option(REFUSED, why, resolve)


def refuse_if_given(why: str) -> Option:
    """Refused unless left at TRL's default of nothing (None, false, 0), which is accepted silently."""

    def resolve(value, _):
        if _given(value):
            raise Refused(why)
        return {}, None

    return Option(REFUSED, f"refused when set: {why}", resolve)


def _server_urls(value, given: dict) -> tuple[dict, str | None]:
    """vllm_server_host and vllm_server_port (ms-swift: lists of each) as rollout_server_urls."""
    hosts = given.get("vllm_server_host", "0.0.0.0")
    ports = given.get("vllm_server_port", 8000)
    hosts = hosts if isinstance(hosts, list) else [hosts]
    ports = ports if isinstance(ports, list) else [ports]
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        raise Refused(f"{len(hosts)} hosts and {len(ports)} ports: give one port per host")
    # TRL's default host 0.0.0.0 is the server's bind address; a client reaches it on loopback
    urls = [f"http://{'127.0.0.1' if h == '0.0.0.0' else h}:{int(p)}" for h, p in zip(hosts, ports)]
    return {"rollout_server_urls": urls}, None


def _use_vllm(value, given: dict) -> tuple[dict, str | None]:
    if not _bool(value):
        return {}, None
    mode = given.get("vllm_mode", "colocate")
    if mode != "server":
        raise Refused(
            f"vllm_mode={mode!r}: vLLM inside the training process is not built in tandem. Start a server "
            "(`tandem rollout --engine vllm --model MODEL`) and give vllm_mode server with its vllm_server_base_url, or use "
            "rollout_mode colocate (tandem's own engine)"
        )
    return {"rollout_mode": "server"}, "use_vllm with vllm_mode server: rollout_mode server (vLLM behind `tandem rollout --engine vllm`)"


def _generation_kwargs(value, given: dict) -> tuple[dict, str | None]:
    value = json.loads(value) if isinstance(value, str) else value or {}
    sampling = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    other = sorted(set(value) - sampling - {"max_tokens"})
    if other:
        raise Refused(f"{other} have no tandem equivalent; tandem samples with {sorted(sampling)} and max_completion_length")
    out = {k: v for k, v in value.items() if k in sampling}
    if "max_tokens" in value:
        out["max_completion_length"] = value["max_tokens"]
    return out, f"generation_kwargs: {sorted(out)} set as tandem's options" if out else None


def _importance_sampling_correction(value, given: dict) -> tuple[dict, str | None]:
    """false: no correction. true: a correction, so that it overrides an earlier none: the mode
    given with it (TRL's vllm_importance_sampling_mode, or tandem's own name), else TRL's default."""
    if not _bool(value):
        return {"off_policy_correction": "none"}, None
    mode = given.get("vllm_importance_sampling_mode", given.get("off_policy_correction"))
    return {"off_policy_correction": "sequence_mask" if mode in (None, "none") else mode}, None


def _scale_rewards(value, given: dict) -> tuple[dict, str | None]:
    """TRL took true/false before group/batch/none: true is group, false none."""
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return {"scale_rewards": "group" if _bool(value) else "none"}, None
    return {"scale_rewards": value}, None


def _num_train_epochs(value, given: dict) -> tuple[dict, str | None]:
    """transformers' rule: max_steps >= 1 overrides it; else the steps follow from the epochs
    (max_steps -1, TRL's default, where it is not given)."""
    if not _given(value):
        return {}, None
    try:
        max_steps = int(given["max_steps"]) if "max_steps" in given else None
    except (TypeError, ValueError):
        max_steps = 1  # not a number: max_steps's own check names it
    if max_steps is not None and max_steps >= 1:
        return {}, f"no effect: max_steps {max_steps} is given, which overrides it (as in transformers)"
    return {"num_train_epochs": value} | ({"max_steps": -1} if max_steps is None else {}), None


def _save_strategy(value, given: dict) -> tuple[dict, str | None]:
    if value in ("steps", "SaveStrategy.STEPS"):
        return {}, None
    if value == "no":
        return {"save_steps": 0}, "save_strategy no: save_steps 0 (tandem still saves at the end)"
    raise Refused(f"save_strategy={value!r}: tandem saves every save_steps steps (save_strategy steps) and at the end")


def _eval_strategy(value, given: dict) -> tuple[dict, str | None]:
    """TRL does not evaluate under eval_strategy no, whatever eval_dataset is given."""
    if value in ("no", "IntervalStrategy.NO"):
        return {"eval_dataset": None}, None
    if value in ("steps", "IntervalStrategy.STEPS"):
        return {}, None
    raise Refused(f"eval_strategy={value!r}: tandem evaluates every eval_steps steps with an eval_dataset (eval_strategy steps)")


def _overlong_filter(value, given: dict) -> tuple[dict, str | None]:
    return {"mask_truncated_completions": _bool(value)}, None


def _swift_dataset(value, given: dict) -> tuple[dict, str | None]:
    """ms-swift's `--dataset name_or_path#N`: the dataset, and N rows sampled from it."""
    values = value if isinstance(value, list) else [value]
    if len(values) != 1:
        raise Refused(f"{len(values)} datasets: tandem trains on one; join them into one file (a 'prompt' or 'messages' column)")
    name, marked, sample = str(values[0]).rpartition("#")
    if not marked:
        name, sample = sample, ""
    if sample and not sample.isdigit():
        raise Refused(f"after '#' give the number of rows to sample, e.g. {name}#1000")
    return {"dataset_name": name} | ({"dataset_sample": int(sample)} if sample else {}), None


def _tuner_type(value, given: dict) -> tuple[dict, str | None]:
    if value not in ("full", "lora"):
        raise Refused("tandem trains every weight (full) or LoRA adapters (lora)")
    return {"use_peft": value == "lora"}, None


def _torch_dtype(value, given: dict) -> tuple[dict, str | None]:
    """ms-swift loads the weights in torch_dtype and trains under bf16 autocast with bfloat16."""
    if value not in ("float32", "bfloat16"):
        raise Refused("tandem trains in float32 or bfloat16")
    return {"model_init_kwargs": {"dtype": value}, "bf16": value == "bfloat16"}, None


def _deepspeed(value, given: dict) -> tuple[dict, str | None]:
    """ZeRO-3 shards parameters, gradients and optimizer state as FSDP's full_shard does; ZeRO-2
    keeps the parameters whole through each step, as shard_grad_op does between forward and backward."""
    stage = {"zero3": "full_shard", "zero2": "shard_grad_op"}.get(str(value))
    if stage is None:
        raise Refused("tandem shards with FSDP2: give fsdp full_shard (ZeRO-3's sharding) or shard_grad_op (ZeRO-2's); offload and "
                      "DeepSpeed config files are not built")  # fmt: skip
    return {"fsdp": stage}, f"fsdp {stage} (FSDP2's equivalent of {value})"


def swift_defaults(values: dict, processes: int) -> dict:
    """ms-swift 4's GRPO defaults (swift/arguments) for the options `values` does not set: LoRA
    unless tuner_type full, and its learning rate for that; beta 0.04, loss grpo, temperature 0.9;
    1 completion a micro-batch, accumulated to 16 completions a step over the processes."""
    lora = _bool(values.get("use_peft", True))
    batch = int(values.get("per_device_train_batch_size", 1))
    out = {"use_peft": lora, "learning_rate": 1e-4 if lora else 1e-5, "beta": 0.04, "loss_type": "grpo", "temperature": 0.9,
           "weight_decay": 0.1, "lr_scheduler_type": "cosine", "per_device_train_batch_size": batch,
           "gradient_accumulation_steps": -(-16 // (batch * processes))}  # fmt: skip
    if lora:
        out |= {"lora_r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": ["all-linear"]}
    return {k: v for k, v in out.items() if k not in values}


_NO_HUB = "tandem train does not upload to the hub: the Python API's GRPOTrainer does (GRPOConfig(push_to_hub=True), trainer.push_to_hub()), or copy output_dir yourself"
_SERVER_SIDE = "a vLLM engine option: give it to the rollout server (`tandem rollout --engine vllm {flag}`)"


def _server_side(flag: str, default) -> Option:
    return inert(lambda v: v in (default, None) or str(v) == str(default), f"{flag} is an engine option of the rollout server", _SERVER_SIDE.format(flag=flag))


OPTIONS: dict[str, Option] = {
    # --- TRL 1.16 GRPOConfig: its own options (and the two TrainingArguments defaults it changes) ---
    "learning_rate": Option(SAME, "peak AdamW learning rate (default 1e-6)"),
    "model_init_kwargs": Option(SAME, "passed to from_pretrained of the policy and the reference"),
    "trust_remote_code": Option(SAME, "passed to the model's and tokenizer's from_pretrained"),
    "router_aux_loss_coef": refuse_if_given("tandem adds no MoE router load-balancing loss; drop router_aux_loss_coef"),
    "disable_dropout": Option(SAME, "every dropout of the policy and reference off, attention layers' dropout probability too (TRL's leaves that on)"),
    "cast_lm_head_to_fp32": Option(SAME, "the output layer computes in fp32 under bf16"),
    "remove_unused_columns": inert(lambda v: not _bool(v), "tandem passes every dataset column to the reward functions", "give remove_unused_columns false"),
    "num_generations": Option(SAME, "completions per prompt"),
    "num_generations_eval": rename("eval_num_generations"),
    "max_completion_length": Option(SAME, "tokens per completion (default 512)"),
    "ds3_gather_for_generation": inert(lambda v: _bool(v), "tandem does not use DeepSpeed; with fsdp, colocated decoding gathers one layer at a time",
                                       "sharded generation without gathering is not built: give ds3_gather_for_generation true, or use a rollout server"),  # fmt: skip
    "shuffle_dataset": Option(SAME, "a seeded permutation per epoch"),
    "pad_to_multiple_of": inert(lambda v: True, "tandem pads each length bucket to its own longest sequence", ""),
    "generation_batch_size": Option(SAME, "completions per round over every process; sets steps_per_generation"),
    "steps_per_generation": Option(SAME, "micro-batches per generation round"),
    "temperature": Option(SAME, "sampling temperature, also of the trained log-probs"),
    "top_p": Option(SAME, "nucleus sampling"),
    "top_k": Option(SAME, "top-k sampling (0: off)"),
    "min_p": Option(MAPPED, "`min_p` (TRL's none is 0)", lambda v, _: ({"min_p": 0.0 if v in (None, "none", "null") else v}, None)),
    "generation_kwargs": Option(MAPPED, "its temperature, top_p, top_k, min_p, repetition_penalty and max_tokens set tandem's options; any other key is refused", _generation_kwargs),
    "chat_template_kwargs": Option(SAME, "extra arguments of the chat template"),
    "repetition_penalty": Option(SAME, "CTRL's penalty"),
    "cache_implementation": refuse_if_given("the transformers engine keeps its own KV cache; drop cache_implementation"),
    "use_vllm": Option(MAPPED, "with vllm_mode server: rollout_mode server (a `tandem rollout --engine vllm` server); vllm_mode colocate is refused", _use_vllm),
    "vllm_mode": inert(lambda v: v in ("server", "colocate"), "read with use_vllm", "give server or colocate"),
    "vllm_model_impl": _server_side("--model-impl", "vllm"),
    "vllm_enable_sleep_mode": refuse_if_given("sleep mode belongs to vLLM colocated with training, which tandem does not build"),
    "vllm_structured_outputs_regex": refuse_if_given("structured outputs are not built in tandem's engines; drop vllm_structured_outputs_regex"),
    "vllm_server_base_url": Option(MAPPED, "`rollout_server_urls` (one URL)", lambda v, _: ({"rollout_server_urls": [v]} if v else {}, None)),
    "vllm_server_host": Option(MAPPED, "with vllm_server_port, `rollout_server_urls` (ms-swift: lists of each)", _server_urls),
    "vllm_server_port": Option(MAPPED, "with vllm_server_host, `rollout_server_urls`", _server_urls),
    "vllm_server_timeout": rename("rollout_server_timeout"),
    "vllm_group_port": inert(lambda v: True, "tandem pushes weights over HTTP or shared memory, not an NCCL group", ""),
    "vllm_gpu_memory_utilization": _server_side("--gpu-memory-utilization", 0.3),
    "vllm_max_model_length": _server_side("--max-model-len", None),
    "vllm_tensor_parallel_size": _server_side("--tensor-parallel-size", 1),
    "beta": Option(SAME, "KL coefficient (0: no reference model)"),
    "num_iterations": Option(SAME, "passes over each round"),
    "epsilon": Option(SAME, "lower clip range"),
    "delta": Option(SAME, "two-sided clipping"),
    "epsilon_high": Option(SAME, "upper clip range (cispo: the weight's bound)"),
    "sapo_temperature_neg": Option(SAME, "sapo's gate, negative advantages"),
    "sapo_temperature_pos": Option(SAME, "sapo's gate, positive advantages"),
    "vespo_k_pos": Option(SAME, "vespo's gamma weight"),
    "vespo_lambda_pos": Option(SAME, "vespo's gamma weight"),
    "vespo_k_neg": Option(SAME, "vespo's gamma weight"),
    "vespo_lambda_neg": Option(SAME, "vespo's gamma weight"),
    "importance_sampling_level": Option(SAME, "token, or sequence (GSPO)"),
    "reward_weights": Option(SAME, "one per reward function"),
    "multi_objective_aggregation": inert(lambda v: v == "sum_then_normalize", "tandem sums the weighted rewards, then normalises them in the group",
                                         "normalize_then_sum (GDPO) is not built: give sum_then_normalize"),  # fmt: skip
    "scale_rewards": Option(MAPPED, "`scale_rewards` (group, batch, none; TRL's older true/false are group and none)", _scale_rewards),
    "loss_type": Option(SAME, "grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo; dapo, cispo and vespo over several optimizer steps a round: TRL's divisor with token_normalizer round_mean"),
    "mask_truncated_completions": Option(SAME, "truncated completions out of the loss"),
    "sync_ref_model": Option(SAME, "TR-DPO's moving reference (not with LoRA, as in TRL)"),
    "ref_model_mixup_alpha": Option(SAME, "TR-DPO's alpha"),
    "ref_model_sync_steps": Option(SAME, "TR-DPO's period"),
    "top_entropy_quantile": Option(SAME, "train the highest-entropy tokens only"),
    "entropy_coef": Option(SAME, "entropy bonus"),
    "use_adaptive_entropy": Option(SAME, "the entropy bonus steered to entropy_target"),
    "entropy_coef_min": Option(SAME, "adaptive entropy bonus"),
    "entropy_coef_max": Option(SAME, "adaptive entropy bonus"),
    "entropy_coef_delta": Option(SAME, "adaptive entropy bonus"),
    "entropy_target": Option(SAME, "adaptive entropy bonus"),
    "max_tool_calling_iterations": Option(SAME, "most tool-calling turns per trajectory"),
    "vllm_importance_sampling_correction": Option(MAPPED, "false: `off_policy_correction none`; true: the mode given (`vllm_importance_sampling_mode`), else sequence_mask",
                                                  _importance_sampling_correction),
    "vllm_importance_sampling_mode": rename("off_policy_correction"),
    "vllm_importance_sampling_clip_max": rename("importance_sampling_cap"),
    "vllm_importance_sampling_clip_min": rename("importance_sampling_clip_min"),
    "vllm_importance_sampling_cap": rename("importance_sampling_cap", "`importance_sampling_cap` (TRL's deprecated name)"),
    "off_policy_mask_threshold": Option(SAME, "DeepSeek-V3.2's off-policy sequence masking"),
    "use_bias_correction_kl": Option(SAME, "the KL weighted by the ratio (default true, as TRL)"),
    "log_completions": inert(lambda v: True, "tandem writes num_completions_to_log completions a step to completions.jsonl, and to W&B and TensorBoard", ""),
    "log_multimodal": inert(lambda v: True, "tandem trains on text", ""),
    "num_completions_to_print": rename("num_completions_to_log", "`num_completions_to_log` (written to completions.jsonl, not printed)"),
    "log_unique_prompts": inert(lambda v: True, "completions.jsonl shows each logged completion with its prompt", ""),
    "log_completions_hub_repo": refuse_if_given(_NO_HUB),
    "use_transformers_continuous_batching": refuse_if_given("the transformers engine batches a round itself; for continuous batching use the vLLM engine"),
    "transformers_continuous_batching_config": refuse_if_given("the transformers engine batches a round itself; for continuous batching use the vLLM engine"),
    "use_transformers_paged": refuse_if_given("paged attention is the vLLM engine's (`tandem rollout --engine vllm`)"),
    # --- TrainingArguments that GRPO configs set ---
    "output_dir": Option(SAME, "the run folder"),
    "overwrite_output_dir": Option(SAME, "start afresh in a folder that holds a run"),
    "per_device_train_batch_size": Option(SAME, "completions per micro-batch and process"),
    "gradient_accumulation_steps": Option(SAME, "micro-batches per optimizer step"),
    "max_steps": Option(SAME, "optimizer steps"),
    "num_train_epochs": Option(MAPPED, "`num_train_epochs`: the steps follow from it; no effect where max_steps >= 1 is given (transformers' rule)", _num_train_epochs),
    "lr_scheduler_type": Option(SAME, "transformers' schedule names"),
    "warmup_ratio": Option(SAME, "share of max_steps warming up"),
    "warmup_steps": Option(SAME, "warm-up steps; a value below 1 is a share of max_steps (transformers 5's)"),
    "weight_decay": Option(SAME, "AdamW weight decay"),
    "adam_beta1": Option(SAME, "AdamW beta1"),
    "adam_beta2": Option(SAME, "AdamW beta2"),
    "adam_epsilon": inert(lambda v: float(v) == 1e-8, "AdamW's epsilon is torch's default, 1e-8", "give adam_epsilon 1e-8"),
    "max_grad_norm": Option(SAME, "gradient clipping"),
    "optim": Option(SAME, "AdamW's kernel: adamw_torch_fused or adamw_torch; any other optimizer refused"),
    "seed": Option(SAME, "every seed of the run"),
    "bf16": Option(SAME, "bf16 mixed precision"),
    "fp16": refuse_if_given("tandem trains in fp32 or bf16: give bf16 true"),
    "logging_steps": inert(lambda v: True, "tandem logs every step to metrics.jsonl", ""),
    "logging_dir": inert(lambda v: True, "TensorBoard's events go to output_dir/tandem", ""),
    "logging_first_step": inert(lambda v: True, "tandem logs every step", ""),
    "run_name": inert(lambda v: True, "trackers name the run after its output_dir", ""),
    "report_to": Option(SAME, "tensorboard, wandb, trackio or none"),
    "save_steps": Option(SAME, "steps between checkpoints"),
    "save_strategy": Option(MAPPED, "steps accepted; no: save_steps 0", _save_strategy),
    "save_total_limit": Option(SAME, "newest checkpoints kept"),
    "save_only_model": refuse_if_given("a tandem checkpoint always holds what an exact resume needs"),
    "eval_strategy": Option(MAPPED, "steps: every eval_steps steps with an eval_dataset; no: no evaluation (eval_dataset none)", _eval_strategy),
    "eval_steps": Option(SAME, "steps between evaluations"),
    "per_device_eval_batch_size": inert(lambda v: True, "evaluation generates all its completions as one batch", ""),
    "gradient_checkpointing": Option(SAME, "activation checkpointing of each decoder layer; TRL's default is true, tandem's decides by the model's shape and the memory (true or false forces it)"),
    "activation_checkpointing": rename("gradient_checkpointing", "`gradient_checkpointing` (transformers 5's new name)"),
    "activation_checkpointing_kwargs": inert(lambda v: (json.loads(v) if isinstance(v, str) else v) in (None, {}, {"use_reentrant": False}),
                                             "tandem's checkpointing is non-reentrant", "only {use_reentrant: false} is accepted"),
    "gradient_checkpointing_kwargs": inert(lambda v: (json.loads(v) if isinstance(v, str) else v) in (None, {}, {"use_reentrant": False}),
                                           "tandem's checkpointing is non-reentrant", "only {use_reentrant: false} is accepted"),
    "ddp_timeout": Option(SAME, "seconds a collective may wait"),
    "dataloader_num_workers": inert(lambda v: True, "prompts are encoded once at start; no data loader workers", ""),
    "push_to_hub": refuse_if_given(_NO_HUB),
    "hub_model_id": refuse_if_given(_NO_HUB),
    "fsdp": Option(SAME, "FSDP2 sharding"),
    "fsdp_config": Option(SAME, "FSDP2 options"),
    "resume_from_checkpoint": Option(SAME, "a checkpoint folder, or latest"),
    "disable_tqdm": Option(SAME, "the progress bar off"),
    "use_liger_kernel": refuse_if_given("Liger's kernels are not used by tandem"),
    # --- ms-swift's GRPO arguments, where they name what TRL's do not ---
    "dynamic_sample": Option(SAME, "DAPO's dynamic sampling (ms-swift's)"),
    "max_resample_times": Option(SAME, "dynamic sampling's draws (ms-swift's)"),
    "overlong_filter": Option(MAPPED, "`mask_truncated_completions` (ms-swift's)", _overlong_filter),
    "async_generate": Option(SAME, "generation overlapping training"),
    "rlhf_type": inert(lambda v: v == "grpo", "tandem trains GRPO", "give grpo"),
    "model": rename("model_name_or_path", "`model_name_or_path` (ms-swift's)"),
    "dataset": Option(MAPPED, "`dataset_name`, and `dataset_sample` N from ms-swift's `name#N`; one dataset", _swift_dataset),
    "split_dataset_ratio": inert(lambda v: float(v) == 0, "no rows are held out of the training set",
                                 "give eval_dataset (a file of its own) for evaluation, and split_dataset_ratio 0"),  # fmt: skip
    "load_from_cache_file": inert(lambda v: True, "prompts are encoded once at start", ""),
    "dataset_num_proc": inert(lambda v: True, "prompts are encoded once at start, in one process", ""),
    "tuner_type": Option(MAPPED, "full: every weight; lora: `use_peft` (ms-swift's)", _tuner_type),
    "train_type": Option(MAPPED, "as tuner_type (ms-swift 3's name)", _tuner_type),
    "lora_rank": rename("lora_r", "`lora_r` (ms-swift's)"),
    "target_modules": rename("lora_target_modules", "`lora_target_modules` (ms-swift's)"),
    "torch_dtype": Option(MAPPED, "float32; bfloat16: weights loaded in bf16 (`model_init_kwargs` dtype) and `bf16`", _torch_dtype),
    "deepspeed": Option(MAPPED, "zero3: `fsdp full_shard`; zero2: `fsdp shard_grad_op`; else refused, naming fsdp", _deepspeed),
    "rollout_importance_sampling_mode": rename("off_policy_correction", "`off_policy_correction` (ms-swift's)"),
    "rollout_importance_sampling_threshold": rename("importance_sampling_cap", "`importance_sampling_cap` (ms-swift's)"),
}


# TRL 1.16's options (GRPOConfig's and the TrainingArguments above) whose default is None: given
# as null (as a dumped GRPOConfig gives them), they mean the default, tandem's.
TRL_NULL_DEFAULTS = frozenset({
    "cache_implementation", "chat_template_kwargs", "deepspeed", "delta", "epsilon_high", "eval_steps", "fsdp", "fsdp_config",
    "generation_kwargs", "gradient_checkpointing_kwargs", "hub_model_id", "log_completions_hub_repo", "max_tool_calling_iterations", "min_p",
    "model_init_kwargs", "num_completions_to_print", "num_generations_eval", "off_policy_mask_threshold", "pad_to_multiple_of",
    "resume_from_checkpoint", "reward_weights", "router_aux_loss_coef", "run_name", "save_total_limit", "transformers_continuous_batching_config",
    "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min", "vllm_max_model_length", "vllm_server_base_url",
    "vllm_structured_outputs_regex", "activation_checkpointing_kwargs", "generation_batch_size", "steps_per_generation",
})  # fmt: skip


def is_null(value) -> bool:
    """YAML's null, or none/null on the command line."""
    return value is None or (isinstance(value, str) and value.lower() in ("none", "null"))


@dataclass
class Resolved:
    values: dict  # tandem option -> its value as given (typed by YAML, or text from the command line)
    notes: list[str]  # what was mapped, for the printed list
    given_as: dict[str, str]  # tandem option -> the name the user gave it under (TRL's, ms-swift's or its own)


def resolve(layers: list[tuple[dict, str]], fields: set[str]) -> Resolved:
    """The options of `layers`, (values, where) pairs, a YAML file's then the command line's, as
    tandem's options. A later layer overrides an earlier one's option of the same name, or of
    another name that sets the same tandem option; then every name is resolved once, over all the
    layers, so an option read with another (vllm_server_host with vllm_server_port) sees it
    whichever layer gave it. A null where TRL's default is null means the default. An option given
    twice in one layer (under two names) or refused is a Refused error naming it as given."""
    merged: dict = {}
    where: dict[str, tuple[int, str]] = {}  # key -> (layer, where)
    for layer, (values, place) in enumerate(layers):
        for key, value in values.items():
            merged[key], where[key] = value, (layer, place)
    sets = {key: _sets(key, value, merged, fields) for key, value in merged.items()}
    # key -> the tandem options it sets that a later layer sets too, under another name: those
    # alone are overridden (a YAML generation_kwargs keeps its top_k under --temperature)
    overridden = {key: {name for other in merged if where[other][0] > where[key][0] and _resolver(other) is not _resolver(key)
                        for name in sets[key] & sets[other]} for key in merged}  # fmt: skip
    out: dict = {}
    given_as: dict[str, str] = {}
    notes: list[str] = []
    for key, value in merged.items():
        option = OPTIONS.get(key)
        if (overridden[key] and overridden[key] == sets[key]) or (is_null(value) and key in TRL_NULL_DEFAULTS and key not in fields):
            continue
        if option is None or option.resolve is None:
            if key not in fields:
                continue  # not an option: the caller's unknown-key error names it
            resolved, note = {key: value}, None
        else:
            try:
                resolved, note = option.resolve(value, merged)
            except Refused as exc:
                raise Refused(f"{key}={value!r} {where[key][1]}: {exc}") from None
        if overridden[key]:
            resolved = {name: v for name, v in resolved.items() if name not in overridden[key]}
            note = f"{', '.join(sorted(resolved))} set as tandem's options; {', '.join(sorted(overridden[key]))} given again later, which wins"
        for name, v in resolved.items():
            if name in out and given_as[name] != key and out[name] != v:
                raise Refused(f"{name} is given twice {where[key][1]}, as {given_as[name]}={merged[given_as[name]]!r} (which sets it to "
                              f"{out[name]!r}) and as {key}={value!r} (to {v!r}); keep one")
            out[name], given_as[name] = v, key
        if note:
            notes.append(f"{key}: {note}")
        elif key != next(iter(resolved), key):
            notes.append(f"{key} -> {', '.join(f'{n} {v!r}' for n, v in resolved.items())}")
    return Resolved(out, notes, given_as)


def _resolver(key: str):
    """What resolves `key`: options resolved by one function (vllm_server_host and _port) are one."""
    option = OPTIONS.get(key)
    return option.resolve if option is not None and option.resolve is not None else key


def _sets(key: str, value, given: dict, fields: set[str]) -> set[str]:
    """The tandem options `key` sets (none known for a value that is refused: it fails later, by name)."""
    option = OPTIONS.get(key)
    if option is None or option.resolve is None:
        return {key} & fields
    try:
        return set(option.resolve(value, given)[0])
    except (Refused, ValueError, TypeError):
        return set()


def training_argument_default(key: str):
    """transformers' TrainingArguments default of `key` as a dumped config writes it, or KeyError
    where `key` is not one of its options. Its import is paid only for such a key."""
    import dataclasses
    import enum

    from transformers import TrainingArguments

    declared = {f.name: f for f in dataclasses.fields(TrainingArguments)}[key]
    if declared.default is not dataclasses.MISSING:
        default = declared.default
    else:
        default = None if declared.default_factory is dataclasses.MISSING else declared.default_factory()
    return default.value if isinstance(default, enum.Enum) else default


# What a dumped TrainingArguments writes for these defaults (a placeholder, a parsed empty value,
# accelerate's defaults spelled out).
_DUMPED_DEFAULTS = {
    "hub_token": "<HUB_TOKEN>",
    "debug": [],
    "accelerator_config": {"split_batches": False, "dispatch_batches": None, "even_batches": True, "use_seedable_sampler": True,
                           "non_blocking": False, "gradient_accumulation_kwargs": None},
}  # fmt: skip


def unused_training_argument(key: str, value) -> str | None:
    """Why a transformers TrainingArguments option that tandem does not use cannot be honoured, or
    None where `value` is its default (as a dumped config writes it). KeyError where `key` is not
    one of its options."""
    default = training_argument_default(key)
    if value == default or (key in _DUMPED_DEFAULTS and value == _DUMPED_DEFAULTS[key]):
        return None
    return f"{key}={value!r}: a transformers TrainingArguments option that tandem does not use; remove it (its default, {default!r}, is accepted)"


def markdown() -> str:
    """The table of docs/configuration.md."""
    lines = ["| option | | in tandem |", "|---|---|---|"]
    lines += [f"| `{name}` | {o.kind} | {o.doc} |" for name, o in OPTIONS.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
