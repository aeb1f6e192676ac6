"""The one configuration of a training run: a dataclass, loaded from YAML, overridden from the
command line, validated before any model loads, saved with every checkpoint.

Names and meanings follow TRL's GRPOConfig wherever the concept exists there.
"""

import argparse
import dataclasses
import difflib
import json
import math
import os
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tandem.algo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, OFF_POLICY_CORRECTIONS, SCALE_REWARDS, TOKEN_NORMALIZERS
from tandem.data import PROMPT_TRUNCATION
from tandem.rewards import ON_TIMEOUT
from tandem.rollout.fleet import BALANCES
from tandem.rollout.types import SamplingParams
from tandem.server.options import API_KEY_ENV, read_api_key
from tandem.trainer import compat
from tandem.trainer.metrics import check_report_to

ROLLOUT_MODES = ("colocate", "server")
REDACTED = "<redacted>"  # a secret as saved and printed configs show it
NONFINITE_POLICIES = ("skip", "error")
WEIGHT_TRANSPORTS = ("auto", "http", "shm", "cuda_ipc")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
FSDP_OPTIONS = ("full_shard", "shard_grad_op", "auto_wrap")
FSDP_CONFIG_KEYS = ("transformer_layer_cls_to_wrap", "reshard_after_forward", "version")
REWARD_MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# What model_init_kwargs may name as the weights' dtype (TRL's): float32 when it names none; "auto"
# keeps the checkpoint's own (tandem.trainer.setup.model_load_kwargs).
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")
# transformers' get_scheduler names that need no options of their own (transformers.SchedulerType)
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt", "warmup_stable_decay")


def opt(default, help: str, section: str):
    """A config field with its --help text and the --help section it is listed under."""
    kind = "default_factory" if isinstance(default, list) else "default"
    value = (lambda d=default: list(d)) if isinstance(default, list) else default
    return field(**{kind: value}, metadata={"help": help, "section": section})


@dataclass
class TrainConfig:
    # --- model and data ---
    model_name_or_path: str = opt("", "Model folder in HF format or hub name (e.g. one made by `tandem init-model`).", "model and data")
    dataset_name: str = opt("", "Prompts: a .jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub dataset name. Needs a 'prompt' column; other columns reach reward functions.", "model and data")
    dataset_split: str = opt("train", "Split to use when dataset_name is a hub dataset or a DatasetDict folder.", "model and data")
    dataset_config: str | None = opt(None, "Configuration name for a hub dataset.", "model and data")
    max_prompt_length: int | None = opt(512, "Longest prompt in tokens; see prompt_truncation. 'none' for no limit.", "model and data")
    prompt_truncation: str = opt("error", "What to do with a longer prompt: 'error' stops at load, 'left' keeps its last tokens, 'skip' drops it (counted in the log).", "model and data")
    shuffle_dataset: bool = opt(True, "Shuffle prompts each epoch (seeded).", "model and data")
    dataset_sample: int = opt(0, "Train on this many rows of the dataset, drawn with the seed (rows repeat where it exceeds them): ms-swift's 'dataset#N'. 0: every row.", "model and data")
    defaults: str = opt("tandem", "The defaults of options not given: tandem (TRL's GRPOConfig's, where tandem has the option) or swift (ms-swift's GRPO: LoRA rank 8 on all-linear unless tuner_type full, learning rate 1e-4 (1e-5 full), beta 0.04, loss_type grpo, temperature 0.9, weight_decay 0.1, cosine schedule).", "model and data")
    output_dir: str = opt("runs/tandem", "Run folder: metrics.jsonl, completions.jsonl, config.yaml, checkpoints.", "model and data")
    seed: int = opt(42, "Seed for init, data order and every sampled completion.", "model and data")
    model_init_kwargs: dict | None = opt(None, "Keyword arguments for the policy's and reference's from_pretrained (e.g. {\"attn_implementation\": \"sdpa\"}), as TRL's: the weights load in float32 unless it gives a dtype (bfloat16, float16, or auto for the checkpoint's own); bf16 mixed precision is the bf16 option.", "model and data")
    trust_remote_code: bool = opt(False, "Let the model's and tokenizer's own code run (transformers' trust_remote_code).", "model and data")
    chat_template_kwargs: dict | None = opt(None, "Extra arguments of the chat template, for every prompt (e.g. {\"enable_thinking\": false} for Qwen3).", "model and data")
    disable_dropout: bool = opt(False, "Turn off every dropout of the policy and the reference model: Dropout modules (the LoRA adapters' lora_dropout too) and attention layers' dropout probability (Qwen2's and Llama's attention_dropout, which TRL's leaves on). Otherwise dropout acts in the training forward, not in generation or the log-probs without gradient.", "model and data")
    cast_lm_head_to_fp32: bool = opt(False, "Compute the output layer (logits) in fp32 when training in bf16, for log-probs closer to the engine's; not with a head tied to the embedding.", "model and data")

    # --- generation ---
    rollout_mode: str = opt("colocate", "Where completions are generated: 'colocate' runs the engine on the trainer's own model; 'server' asks `tandem rollout` servers.", "generation")
    rollout_server_urls: list[str] = opt(["http://127.0.0.1:8000"], "Rollout servers (server mode), each http://HOST:PORT, several apart or in one string separated by commas: requests are spread over them, weights pushed to all.", "generation")
    rollout_balance: str = opt("speed", "With several rollout_server_urls, how each call's prompts are shared among the servers up: 'speed' by each one's measured time (a decode step's seconds fitted as a + b * rows per server; the rows go where the slowest predicted step is shortest, so a slow server gets fewer rows, or none where its steps alone are slower than the others' with its rows added, and is tried again later), 'even' in equal parts. A sequence whose prefix a server holds (a later turn, a carried-over partial rollout, its group's prompt) goes back to it where its share allows. Tokens are the same either way (each completion has its own seed).", "generation")
    rollout_replica_timeout: float = opt(30.0, "With several rollout_server_urls: a server that leaves a health check unanswered this many seconds (or refuses connections) is taken out; its part of the round is generated by the others from the same seeds, pushes skip it, and it is put back, with the last weights, once it answers.", "generation")
    rollout_server_timeout: float = opt(240.0, "Seconds to wait for a server to be healthy at start, and to retry a failing call, before stopping with an error.", "generation")
    rollout_connect_timeout: float = opt(5.0, "Seconds to wait for a TCP connection to a server.", "generation")
    rollout_request_timeout: float = opt(600.0, "Seconds to wait for the answer to one request (a whole round's generation).", "generation")
    rollout_api_key: str | None = opt(None, f"Key the servers were started with (--api-key); sent as a Bearer token. Kept out of every saved and printed config (shown as {REDACTED}); rather than on the command line, where other users see it, give it in the environment variable {API_KEY_ENV} or a file (rollout_api_key_file).", "generation")
    rollout_api_key_file: str | None = opt(None, "A file holding the servers' key (its first line), instead of rollout_api_key.", "generation")
    async_generate: bool = opt(False, "Generate the next rounds in the background while training on the current one (server mode).", "generation")
    max_staleness: int = opt(1, "With async_generate or max_tokens_per_round: round r may be generated with any policy version >= r - max_staleness (0 is synchronous).", "generation")
    max_tokens_per_round: int | None = opt(None, "Partial rollouts, in every mode (colocated too): at each policy version, every sequence in flight decodes at most this many more tokens; an unfinished one carries over to the next version from its exact tokens, beside the next rounds' sequences, so a long completion no longer holds the engine alone. Each token's version is recorded and none trains more than max_staleness versions behind; a run stays bitwise reproducible. Pays with max_staleness >= 2 and a long tail of lengths: a round's sequences still unfinished at its last version (longer than max_staleness x max_tokens_per_round) are finished there alone. None: every round is generated whole (see docs/partial-rollouts.md).", "generation")
    off_policy_correction: str = opt("sequence_mask", "Importance weight proximal/behaviour on each token's loss, applied whenever a rollout server generates (its numerics differ from the trainer's, and async rollouts lag) or partial rollouts carry tokens of older versions: none, token_truncate, token_mask, sequence_truncate, sequence_mask (TRL's vllm_importance_sampling_mode; other colocated runs need none).", "generation")
    importance_sampling_cap: float = opt(3.0, "Upper bound of the importance weight: truncate modes clip to it, mask modes drop what exceeds it (TRL's vllm_importance_sampling_clip_max).", "generation")
    importance_sampling_clip_min: float | None = opt(None, "Lower bound of the importance weight, in (0, 1]: truncate modes raise weights to it, mask modes drop what falls below it; none for no lower bound (TRL's vllm_importance_sampling_clip_min).", "generation")
    verify_weight_sync: bool = opt(False, "After each push, compare the servers' weight fingerprints with the trainer's and stop on a mismatch (hashes every weight: slow for big models).", "generation")
    weight_transport: str = opt("auto", "How weights reach the servers: 'cuda_ipc' (the trainer's GPU memory, mapped by a server on that GPU; never tested on CPU-only machines), 'shm' (shared memory, same host), 'http' (safetensors over HTTP), 'auto' (cuda_ipc for a server on the trainer's GPU, else shm for one on this host, else http).", "generation")
    delta_weight_updates: bool = opt(False, "Push a server that holds the previous version only what changed: the XOR of the new and old weights in the server's dtype, zstd-compressed, over HTTP, checked against the whole's fingerprint before it goes live (a server at another version gets the whole). Pays in bf16 across a network (docs/server-and-engines.md has the figures); the trainer keeps its last push in the servers' dtype, each server keeps the weights it was sent (no copy where its engine holds them as sent). LoRA adapters and sharded (FSDP) pushes go whole.", "generation")
    num_generations: int = opt(8, "Completions per prompt (G); advantages are relative within these groups.", "generation")
    max_completion_length: int = opt(512, "Most tokens generated per completion.", "generation")
    temperature: float = opt(1.0, "Sampling temperature; log-probs in the loss use the same temperature.", "generation")
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.", "generation")
    top_k: int = opt(0, "Keep only the k most likely tokens; 0 disables.", "generation")
    min_p: float = opt(0.0, "Drop tokens less likely than min_p times the most likely one; 0 disables.", "generation")
    repetition_penalty: float = opt(1.0, "Penalise tokens already in the sequence (>1 discourages repeats); 1 disables.", "generation")

    # --- rewards ---
    reward_funcs: list[str] = opt([], "Reward functions: built-in names (exact_match, accuracy, number_format, think_format, length_penalty), 'path/file.py:fn', 'package.module:fn' (plain or async def), or a reward model: 'model:NAME' (HF folder or hub name) or a folder holding a sequence-classification model.", "rewards")
    reward_weights: list[float] | None = opt(None, "One weight per reward function (default all 1.0).", "rewards")
    reward_timeout: float | None = opt(600.0, "Seconds one call of a reward function may take (on one batch); none: no bound.", "rewards")
    reward_on_timeout: str = opt("error", "A call past reward_timeout: 'error' stops the run naming the function; 'none' scores that batch as no opinion (None) and warns.", "rewards")
    reward_num_workers: int = opt(0, "Worker processes that score plain (not async) reward functions, each batch split between them: for CPU-heavy functions. 0: a thread of this process.", "rewards")
    reward_model_device: str = opt("auto", "Device of reward models: 'auto' (this process's GPU, else the CPU), or e.g. 'cpu', 'cuda:1'.", "rewards")
    reward_model_dtype: str = opt("auto", "Dtype of reward models: 'auto' (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 or float16.", "rewards")
    reward_model_batch_size: int = opt(32, "Completions a reward model scores per forward pass.", "rewards")
    external_plugins: list[str] = opt([], "ms-swift plugin files, imported at start: the reward classes they register (orms['name'] = Class, from swift.rewards) become reward_funcs names.", "rewards")
    cosine_min_len_value_wrong: float = opt(-0.5, "ms-swift's cosine reward: a wrong answer's reward at length 0 (arXiv:2502.03373).", "rewards")
    cosine_max_len_value_wrong: float = opt(0.0, "ms-swift's cosine reward: a wrong answer's reward at cosine_max_len.", "rewards")
    cosine_min_len_value_correct: float = opt(1.0, "ms-swift's cosine reward: a correct answer's reward at length 0.", "rewards")
    cosine_max_len_value_correct: float = opt(0.5, "ms-swift's cosine reward: a correct answer's reward at cosine_max_len.", "rewards")
    cosine_max_len: int | None = opt(None, "ms-swift's cosine reward: the length its curve spans; none: max_completion_length.", "rewards")
    repetition_n_grams: int = opt(3, "ms-swift's repetition reward: the n of the word n-grams counted.", "rewards")
    repetition_max_penalty: float = opt(-1.0, "ms-swift's repetition reward: its value where every n-gram repeats.", "rewards")
    soft_max_length: int | None = opt(None, "ms-swift's soft_overlong reward: the length where it reaches -1; none: max_completion_length.", "rewards")
    soft_cache_length: int | None = opt(None, "ms-swift's soft_overlong reward: the tokens before soft_max_length over which it falls from 0 to -1.", "rewards")
    dynamic_sample: bool = opt(False, "DAPO's dynamic sampling: groups whose rewards all agree (zero std, no learning signal) are replaced by groups of new prompts.", "rewards")
    max_resample_times: int = opt(3, "With dynamic_sample: at most this many draws of new prompts per round; a round still short keeps some agreeing groups.", "rewards")

    # --- tools and multi-turn ---
    tools: list[str] = opt([], "Tools the model may call: built-in names (calculator), 'path/file.py:fn' or 'package.module:fn' (plain or async def, with type hints and a docstring). Their JSON schemas go to the chat template; calls in the model's text are run and their results appended as tool messages, turn after turn. Needs chat prompts.", "tools and multi-turn")
    environment_factory: str | None = opt(None, "'path/file.py:Class' or 'module:Class': one instance per trajectory; reset(**row) may return text appended to the prompt, its public methods are tools, an optional step(text) gives the next observation (a user message; None ends the trajectory), an optional get_reward() is the reward function 'environment'.", "tools and multi-turn")
    rollout_func: str | None = opt(None, "'path/file.py:fn' or 'module:fn', an async def fn(prompt, generate, tokenizer) -> {completion_ids, loss_mask[, messages]}: a user's own agent, which awaits generate(token_ids) for the engine's tokens; its loss_mask 1 tokens must be exactly those (see docs/multi-turn.md).", "tools and multi-turn")
    agent_func: str | None = opt(None, "'path/file.py:fn' or 'module:fn', an async def fn(row, client): an agent written against OpenAI's API (the Agents SDK, LangChain, your own loop) run unchanged with `client`, an openai.AsyncOpenAI bound to a session of this trajectory; every token it is answered is the engine's, trained exactly. It may return a reward (reward function 'environment'). See docs/agents.md.", "tools and multi-turn")
    agent_timeout: float = opt(300.0, "With agent_func: seconds one agent's episode may take; an agent still running is ended and counted (agents/timeouts).", "tools and multi-turn")
    max_turns: int = opt(32, "With agent_func: most requests per session; the next is refused and the episode ends there.", "tools and multi-turn")
    agent_workers: int = opt(0, "With agent_func: worker processes that run the agents, one episode at a time each: an agent that ends its process (os._exit, a crash), blocks its event loop or holds a thread for ever takes only its worker with it; its episode fails (agents/errors, agents/timeouts) and a fresh worker takes its place. 0: agents run on the trainer's event loop (docs/agents.md says what they can still do there). The agent must be importable by its spec, its rows picklable.", "tools and multi-turn")
    agent_failure: str = opt("drop", "With agent_func, an agent that raises or times out: 'drop' its trajectory (no reward, no loss, as an engine's error) or 'zero' (reward 0 for what it generated).", "tools and multi-turn")
    agent_train_rows: str = opt("all", "With agent_func: which rows of a session train. An agent that rewrites its history (a framework that re-renders it, a template that drops earlier reasoning) starts a new row at that request; 'all' trains every row with the trajectory's reward and advantage (together one sequence of the loss), 'last' only the conversation at the end.", "tools and multi-turn")
    max_tool_calling_iterations: int | None = opt(None, "Most turns that call tools per trajectory; none: until a turn calls none or max_completion_length is filled (TRL's).", "tools and multi-turn")
    tool_parser: str = opt("hermes", "How tool calls are found in the model's text: 'hermes', <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen2.5, Qwen3).", "tools and multi-turn")
    tool_timeout: float = opt(30.0, "Seconds one tool call may take; a call past it gives the model an error message as its result.", "tools and multi-turn")
    tool_workers: int = opt(0, "Worker processes that run the plain (not async) tools of `tools`: a tool that ends its process (os._exit, a crash), floods its output (discarded there) or hangs takes only its worker with it; the call fails and a fresh worker takes its place. 0: tools run in threads of the trainer's process, where they can end or stall the run (docs/multi-turn.md). An environment's methods always run in the trainer's process.", "tools and multi-turn")
    max_tool_response_tokens: int | None = opt(None, "Cut a tool's result to this many tokens; none: no cut (max_completion_length still bounds the trajectory).", "tools and multi-turn")

    # --- batch and schedule ---
    max_steps: int = opt(100, "Optimizer steps to train; -1 (or 0) with num_train_epochs: as many as those epochs take (TRL's).", "batch and schedule")
    num_train_epochs: float | None = opt(None, "Passes over the dataset's prompts, as TRL counts them: each epoch is as many whole rounds as the prompts fill, times the optimizer steps of a round. max_steps >= 1 overrides it (transformers' rule).", "batch and schedule")
    per_device_train_batch_size: int = opt(8, "Completions per micro-batch on each process (TRL's meaning: completions, not prompts).", "batch and schedule")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step.", "batch and schedule")
    steps_per_generation: int | None = opt(None, "Micro-batches each generation round is split into (default: gradient_accumulation_steps). A round holds per_device_train_batch_size * steps_per_generation completions per process, which must be whole groups.", "batch and schedule")
    generation_batch_size: int | None = opt(None, "Completions per round over every process, instead of steps_per_generation (TRL's): steps_per_generation = generation_batch_size / (per_device_train_batch_size * processes).", "batch and schedule")
    num_iterations: int = opt(1, "Passes over each generation round (mu in the GRPO paper).", "batch and schedule")
    optim: str = opt("adamw_torch_fused", "torch's AdamW kernel (transformers' names and default): 'adamw_torch_fused' updates each weight in one pass, with no temporary copies; 'adamw_torch' runs the update as separate operations, a temporary the size of the largest weight at a time. The two differ by float rounding.", "batch and schedule")
    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW.", "batch and schedule")
    lr_scheduler_type: str = opt("linear", "transformers schedule name: linear, cosine, constant, constant_with_warmup, ...", "batch and schedule")
    warmup_steps: float = opt(0, "Steps warming the learning rate up from 0 (transformers' and TRL's): a whole number of steps, or a value below 1 as a share of max_steps.", "batch and schedule")
    warmup_ratio: float = opt(0.0, "Share of max_steps warming the learning rate up, rounded up to whole steps (transformers 4's; warmup_steps below 1 says the same).", "batch and schedule")
    weight_decay: float = opt(0.0, "AdamW weight decay.", "batch and schedule")
    adam_beta1: float = opt(0.9, "AdamW beta1.", "batch and schedule")
    adam_beta2: float = opt(0.999, "AdamW beta2.", "batch and schedule")
    gradient_checkpointing: bool | None = opt(None, "Activation checkpointing: each decoder layer keeps only its input for the backward and runs again there, about a third more training compute for the memory of one layer's activations instead of every layer's. Default (none): on when a micro-batch's activations without it would take more than an eighth of the memory this process can have (estimated at start from the model's shape, per_device_train_batch_size and the longest prompt + max_completion_length; printed with the reason); true or false forces it (TRL's default is true). Results are the same either way.", "batch and schedule")
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this; 0 disables.", "batch and schedule")
    on_nonfinite: str = opt("skip", "A step whose loss or gradient norm is NaN or inf never updates the weights: 'skip' drops it and counts it in the metric skipped_steps; 'error' stops the run naming the step.", "batch and schedule")
    bf16: bool | None = opt(None, "Train in bf16 mixed precision (through accelerate). Default (none): on with a CUDA GPU that computes bf16, as TRL; off on CPU, where most CPUs emulate bf16 (10-500x slower than fp32) and where tandem's exactness guarantees are stated in fp32.", "batch and schedule")
    sigterm_timeout: float = opt(20.0, "Seconds a run may take after a SIGTERM (a scheduler preempting it) to finish its round and save its checkpoint; past them, or at a second SIGTERM, it exits at once, its last checkpoint intact and the round in flight dropped. Exit code 143 either way. Keep it under the scheduler's grace period (30 s by default on Kubernetes, Slurm and torchrun).", "batch and schedule")
    ddp_timeout: float = opt(1800.0, "Seconds any collective between training processes may wait before the run fails.", "batch and schedule")

    # --- sharding (FSDP) ---
    fsdp: str = opt("", "Shard parameters, gradients and optimizer state across the training processes with torch's FSDP2 (transformers' --fsdp): 'full_shard' gathers each decoder layer for its forward and again for its backward; 'shard_grad_op' keeps it gathered in between (faster, more memory); 'auto_wrap' may follow (each decoder layer is a unit anyway). Empty: DDP, a full copy per process.", "sharding (FSDP)")
    fsdp_config: dict | None = opt(None, "FSDP options, as a mapping in the YAML file or JSON on the command line (transformers' fsdp_config; an fsdp_ prefix is dropped): transformer_layer_cls_to_wrap (class names of the units; default the model's decoder layer), reshard_after_forward (true|false, overrides fsdp), version (2).", "sharding (FSDP)")

    # --- LoRA (PEFT) ---
    use_peft: bool = opt(False, "Train LoRA adapters (PEFT) instead of every weight; syncs push only the adapters, checkpoints hold them in PEFT's format (`tandem merge` writes the full model).", "LoRA")
    lora_r: int = opt(16, "LoRA rank.", "LoRA")
    lora_alpha: int = opt(32, "LoRA alpha: the adapters' output is scaled by lora_alpha / lora_r.", "LoRA")
    lora_dropout: float = opt(0.05, "Dropout on the adapters' input while training (none while generating).", "LoRA")
    lora_target_modules: list[str] | None = opt(None, "Linear modules to adapt, by name (q_proj v_proj ...), or all-linear; none uses PEFT's default for the architecture.", "LoRA")
    lora_modules_to_save: list[str] | None = opt(None, "Modules trained in full beside the adapters (e.g. lm_head); pushed whole at each sync.", "LoRA")

    # --- loss ---
    loss_type: str = opt("dapo", f"How per-token losses are reduced: {', '.join(sorted(LOSS_TYPES))} (TRL's definitions).", "loss")
    beta: float = opt(0.0, "KL coefficient to the reference model (k3 estimator); 0 loads no reference model.", "loss")
    epsilon: float = opt(0.2, "Lower clip range of the ratio: 1 - epsilon.", "loss")
    epsilon_high: float | None = opt(None, "Upper clip range: 1 + epsilon_high (default: epsilon; DAPO uses 0.28).", "loss")
    delta: float | None = opt(None, "Upper clamp of the unclipped ratio (two-sided clipping); must exceed 1 + epsilon_high.", "loss")
    importance_sampling_level: str = opt("token", "'token' ratio per token, or 'sequence' (GSPO) one ratio per completion.", "loss")
    scale_rewards: str = opt("group", "Divide advantages by the std of the 'group', the 'batch', or 'none' (Dr. GRPO).", "loss")
    token_normalizer: str = opt("step", "What dapo, cispo and vespo divide an optimizer step's token sum by: 'step', the loss tokens of that step over every process (DAPO's token mean of the batch trained); 'round_mean', the round's loss tokens over its steps, alike for each (TRL 1.16's: a TRL config keeps TRL's numbers). The two differ only when steps_per_generation > gradient_accumulation_steps.", "loss")
    mask_truncated_completions: bool = opt(False, "Leave completions that hit max_completion_length out of the loss.", "loss")
    use_bias_correction_kl: bool = opt(True, "Weight the per-token KL by the ratio current/proximal (with its gradient), as TRL 1.16 does by default: the KL of samples from the proximal policy, made the current one's. Only with beta > 0.", "loss")
    sapo_temperature_pos: float = opt(1.0, "loss_type sapo: the gate's temperature for positive advantages.", "loss")
    sapo_temperature_neg: float = opt(1.05, "loss_type sapo: the gate's temperature for negative advantages.", "loss")
    vespo_k_pos: float = opt(2.0, "loss_type vespo: k of the gamma weight for non-negative advantages.", "loss")
    vespo_lambda_pos: float = opt(3.0, "loss_type vespo: lambda of the gamma weight for non-negative advantages.", "loss")
    vespo_k_neg: float = opt(3.0, "loss_type vespo: k of the gamma weight for negative advantages.", "loss")
    vespo_lambda_neg: float = opt(2.0, "loss_type vespo: lambda of the gamma weight for negative advantages.", "loss")
    off_policy_mask_threshold: float | None = opt(None, "Drop from the policy gradient a sequence with a negative advantage whose mean KL(sampling policy || current) per token exceeds this (DeepSeek-V3.2's off-policy sequence masking); none: off.", "loss")
    top_entropy_quantile: float = opt(1.0, "Train only the tokens in this top quantile of entropy over the step's tokens (0.2: the fifth most uncertain); 1 trains every token.", "loss")
    entropy_coef: float = opt(0.0, "Entropy bonus: the loss minus this times the mean entropy of the trained tokens; with use_adaptive_entropy, its starting value.", "loss")
    use_adaptive_entropy: bool = opt(False, "Move entropy_coef by entropy_coef_delta after each step, up while the step's entropy is at or below entropy_target, down above it; the bonus applies only while the entropy is at or below the target.", "loss")
    entropy_coef_min: float = opt(0.0, "use_adaptive_entropy: the lowest entropy_coef.", "loss")
    entropy_coef_max: float = opt(1.0, "use_adaptive_entropy: the highest entropy_coef.", "loss")
    entropy_coef_delta: float = opt(0.005, "use_adaptive_entropy: the change of entropy_coef per step.", "loss")
    entropy_target: float = opt(0.2, "use_adaptive_entropy: the mean entropy per token aimed at.", "loss")
    sync_ref_model: bool = opt(False, "Move the reference model toward the policy every ref_model_sync_steps steps: ref = alpha * policy + (1 - alpha) * ref (TR-DPO); needs beta > 0, not with LoRA.", "loss")
    ref_model_mixup_alpha: float = opt(0.6, "sync_ref_model: the policy's share alpha in the new reference.", "loss")
    ref_model_sync_steps: int = opt(512, "sync_ref_model: steps between two moves of the reference.", "loss")

    # --- evaluation ---
    eval_dataset: str | None = opt(None, "Held-out prompts (same formats as dataset_name), evaluated by the run's engine with the current weights; eval/* metrics go to eval.jsonl and the trackers.", "evaluation")
    eval_steps: int = opt(0, "Evaluate every this many steps; 0 evaluates once, at the end of training.", "evaluation")
    eval_num_generations: int = opt(4, "Completions per eval prompt, from fixed seeds (k of pass@k).", "evaluation")
    eval_greedy: bool = opt(False, "One greedy completion per eval prompt instead of eval_num_generations samples.", "evaluation")
    eval_pass_threshold: float = opt(1.0, "A completion passes (for pass@k) when its weighted reward is at least this.", "evaluation")

    # --- logging and checkpoints ---
    save_steps: int = opt(500, "Save a checkpoint every this many steps (at the end of the round that reaches it, and at the end of training); 0 saves only at the end.", "logging and checkpoints")
    save_total_limit: int | None = opt(None, "Keep only the newest this many checkpoints; none keeps all.", "logging and checkpoints")
    resume_from_checkpoint: str | None = opt(None, "Continue a run exactly: a checkpoint folder, or 'latest' for the newest complete one in output_dir. The options its saved state depends on (model, data, seed, group size, batch shape, loss type) must keep the checkpoint's values; the rest may change and is listed.", "logging and checkpoints")
    overwrite_output_dir: bool = opt(False, "Start afresh in an output_dir that holds a run: its logs and checkpoints are deleted first. Without it such a run is refused, so two runs never mix (resume it instead).", "logging and checkpoints")
    num_completions_to_log: int = opt(4, "Completions written to completions.jsonl each step.", "logging and checkpoints")
    disable_tqdm: bool = opt(False, "Hide the progress bar.", "logging and checkpoints")
    report_to: list[str] = opt(["none"], "Experiment trackers that get every metric of metrics.jsonl at the same steps: tensorboard (in output_dir/tandem), wandb, trackio, or none; the logged completions go to W&B and TensorBoard as tables.", "logging and checkpoints")

    def __post_init__(self):
        self.notes: list[str] = []  # what TRL's and ms-swift's names given were mapped to (config_from_args); not an option
        self.given_as: dict[str, str] = {}  # option -> the name the user gave it under, for messages (config_from_args); not an option
        if isinstance(self.warmup_steps, float) and self.warmup_steps >= 1 and self.warmup_steps.is_integer():
            self.warmup_steps = int(self.warmup_steps)  # a count of steps stays one, printed and saved as such
        if self.generation_batch_size is not None:
            self._steps_from_generation_batch_size()
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.cosine_max_len = self.cosine_max_len or self.max_completion_length
        self.soft_max_length = self.soft_max_length or self.max_completion_length
        urls = [self.rollout_server_urls] if isinstance(self.rollout_server_urls, str) else self.rollout_server_urls
        # one comma-separated string too, as URLs are written in environment variables
        self.rollout_server_urls = [u.strip() for url in urls for u in str(url).split(",") if u.strip()]

    def _steps_from_generation_batch_size(self) -> None:
        """TRL's generation_batch_size counts a round's completions over every process (WORLD_SIZE,
        as torchrun sets it): steps_per_generation follows from it. Both may be given if they agree."""
        per_micro_batch = self.per_device_train_batch_size * int(os.environ.get("WORLD_SIZE", "1"))
        steps, rest = divmod(self.generation_batch_size, per_micro_batch)
        if rest or steps < 1:
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size}: must be a multiple of per_device_train_batch_size * processes = {per_micro_batch}"
            )
        if self.steps_per_generation is not None and self.steps_per_generation != steps:
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size} means steps_per_generation={steps} on {per_micro_batch // self.per_device_train_batch_size} "
                f"process(es), but steps_per_generation={self.steps_per_generation} is given; give one of the two"
            )
        self.steps_per_generation = steps

    def load_rewards(self, given: list | None = None) -> list:
        """The reward functions of reward_funcs, or `given` (the Python API's: callables and TRL's
        strings), loaded; ms-swift's names as its rewards (tandem.rewards.swift). A spec that does
        not load is a config error naming it."""
        from tandem import rewards
        from tandem.rewards import swift

        model_options = {"device": self.reward_model_device, "dtype": self.reward_model_dtype, "batch_size": self.reward_model_batch_size}
        try:
            entries = swift.resolve(self.reward_funcs if given is None else given, self.external_plugins, self, self.defaults == "swift")
            if given is not None:
                entries = [rewards.trl_spec(e) if isinstance(e, str) else e for e in entries]
            return rewards.load_rewards(entries, self.reward_weights, self.reward_timeout, self.reward_on_timeout, model_options, self.reward_num_workers)
        except (ValueError, OSError, ImportError) as exc:
            raise ConfigError(str(exc)) from exc

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    def completions_per_round(self) -> int:
        """Completions one process generates per round."""
        return self.per_device_train_batch_size * self.steps_per_generation

    def steps_per_round(self) -> int:
        """Optimizer steps trained on one generation round."""
        return self.num_iterations * self.steps_per_generation // self.gradient_accumulation_steps

    def steps_for_epochs(self, prompts: int, processes: int) -> int:
        """max_steps of num_train_epochs over `prompts`, as TRL's Trainer counts them: the whole
        rounds an epoch's prompts fill (a last part round left out), times a round's steps, at
        least one step an epoch; then epochs times that, rounded up."""
        per_round = self.completions_per_round() * processes // self.num_generations  # prompts of a round over every process
        return math.ceil(self.num_train_epochs * max(prompts // per_round * self.steps_per_round(), 1))

    def round_timeout(self) -> float | None:
        """The longest an async round may take to be generated and scored by its timeouts: each
        generate call (1, and up to max_resample_times more with dynamic_sample) retried for
        rollout_server_timeout after an answer that may take rollout_request_timeout, and each
        reward function's reward_timeout per scoring; a minute of slack. None (no bound) when
        reward_timeout is none, as in sync mode."""
        if self.reward_timeout is None:
            return None
        calls = 1 + (self.max_resample_times if self.dynamic_sample else 0)
        turns = 1 + self.tool_turns() if self.multi_turn() else 1
        turns += 1 if self.max_tokens_per_round else 0  # partial rollouts: a version's call, before its due round's finishing ones
        generate = turns * (self.rollout_server_timeout + self.rollout_request_timeout) + (turns - 1) * self.tool_timeout
        if self.agent_func:  # an episode is cut at agent_timeout, whatever its turns
            generate = self.agent_timeout
        return calls * (generate + len(self.reward_funcs) * self.reward_timeout) + 60.0

    def multi_turn(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None or self.rollout_func is not None or self.agent_func is not None

    def tool_turns(self) -> int:
        """Most turns after the first: max_tool_calling_iterations, or as many as max_completion_length allows."""
        return self.max_completion_length if self.max_tool_calling_iterations is None else self.max_tool_calling_iterations

    def validate(self) -> None:
        """Every check that needs no model: run before anything loads."""

        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"{self.named(name)}={getattr(self, name)!r}: {fix}")

        self._validate_run(need)
        self._validate_batch(need)
        self._validate_loss_and_rewards(need)
        self._validate_fsdp(need)
        self._validate_tools(need)
        try:
            self.sampling_params().validate()
        except ValueError as exc:
            raise ConfigError(str(exc).replace("max_tokens", "max_completion_length")) from None

    def named(self, name: str) -> str:
        """An option as the user wrote it: under TRL's or ms-swift's name where given so."""
        given = self.given_as.get(name, name)
        return name if given == name else f"{given} (tandem's {name})"

    def warmup(self) -> int:
        """Warm-up steps: warmup_steps (below 1, a share of max_steps, as transformers 5 reads it),
        else warmup_ratio of max_steps, rounded up (transformers 4's)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil((self.warmup_steps or self.warmup_ratio) * self.max_steps)

    def _validate_partial(self, need) -> None:
        if self.max_tokens_per_round is None:
            return
        need(self.max_tokens_per_round >= 1, "max_tokens_per_round", "must be >= 1, or none to generate whole rounds")
        need(not (self.rollout_func or self.agent_func), "max_tokens_per_round",
             "carries trajectories across versions and into checkpoints, which a rollout_func's or an agent's own state cannot "
             "follow: with those, drop max_tokens_per_round (tools and environment_factory work with it)")  # fmt: skip

    def _validate_tools(self, need) -> None:
        from tandem.rollout.tools import TOOL_PARSERS

        need(self.tool_parser in TOOL_PARSERS, "tool_parser", f"must be one of {', '.join(TOOL_PARSERS)}")
        need(self.tool_timeout > 0, "tool_timeout", "must be > 0 seconds")
        need(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0, "max_tool_calling_iterations", "must be >= 0, or none")
        need(self.max_tool_response_tokens is None or self.max_tool_response_tokens >= 1, "max_tool_response_tokens", "must be >= 1, or none")
        need(self.tool_workers >= 0, "tool_workers", "must be >= 0 (0: tools run in the trainer's process)")
        need(self.rollout_func is None or not (self.tools or self.environment_factory), "rollout_func",
             "runs the whole trajectory itself: give it without tools and environment_factory (it may call tools of its own)")  # fmt: skip
        need(not (self.rollout_func and self.fsdp and self.rollout_mode == "colocate"), "fsdp",
             "a rollout_func with a sharded colocated engine is not built (its generate calls cannot be kept in lockstep across "
             "processes): use rollout_mode server, or DDP")  # fmt: skip
        need("environment" not in self.reward_funcs or self.environment_factory is not None or self.agent_func is not None, "reward_funcs",
             "the reward 'environment' is an environment's get_reward() or an agent_func's return value: give one of them too")  # fmt: skip
        need(self.agent_func is None or not (self.tools or self.environment_factory or self.rollout_func), "agent_func",
             "runs the whole episode itself through its client: give it without tools, environment_factory and rollout_func")  # fmt: skip
        need(not (self.agent_func and self.fsdp and self.rollout_mode == "colocate"), "fsdp",
             "an agent_func with a sharded colocated engine is not built (its requests cannot be kept in lockstep across "
             "processes): use rollout_mode server, or DDP")  # fmt: skip
        need(self.agent_timeout > 0, "agent_timeout", "must be > 0 seconds")
        need(self.max_turns >= 1, "max_turns", "must be >= 1")
        need(self.agent_failure in ("drop", "zero"), "agent_failure", "must be 'drop' or 'zero'")
        need(self.agent_train_rows in ("all", "last"), "agent_train_rows", "must be 'all' or 'last'")
        need(self.agent_workers >= 0, "agent_workers", "must be >= 0 (0: agents run in the trainer's process)")

    def _validate_run(self, need) -> None:
        """Every number finite; the model, data, seed, and how generation is done."""
        for f in dataclasses.fields(self):  # no NaN or inf anywhere: inf learning rates, timeouts and norms trained nothing or never ended
            value = getattr(self, f.name)
            values = value if isinstance(value, list) else [value]
            need(all(math.isfinite(v) for v in values if isinstance(v, float)), f.name, "must be a finite number")
        need(bool(self.model_name_or_path), "model_name_or_path", "give a model folder or hub name (e.g. one made by `tandem init-model runs/model`)")
        need(0 <= self.seed < 2**32, "seed", "must be in [0, 2**32)")
        need(bool(self.dataset_name), "dataset_name", "give a prompt file (.jsonl/.json/.parquet/.csv) or a dataset name")
        need(self.rollout_mode in ROLLOUT_MODES, "rollout_mode", f"must be one of {ROLLOUT_MODES}")
        need(not (self.rollout_mode == "server" and not self.rollout_server_urls), "rollout_server_urls", "give at least one server URL in server mode")
        for url in self.rollout_server_urls if self.rollout_mode == "server" else ():
            problem = url_problem(url)
            need(problem is None, "rollout_server_urls", f"{url!r} {problem}: give each as http://HOST:PORT (several apart, or separated by commas)")
        need(self.rollout_server_timeout > 0, "rollout_server_timeout", "must be > 0 seconds")
        need(self.rollout_balance in BALANCES, "rollout_balance", f"must be one of {tuple(BALANCES)}")
        need(self.rollout_replica_timeout > 0, "rollout_replica_timeout", "must be > 0 seconds")
        need(self.rollout_connect_timeout > 0 and self.rollout_request_timeout > 0, "rollout_request_timeout", "timeouts must be > 0 seconds")
        need(not self.async_generate or self.rollout_mode == "server", "async_generate", "needs rollout_mode: server (a colocated engine would share the weights being trained, so it cannot overlap)")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        self._validate_partial(need)
        need(self.off_policy_correction in OFF_POLICY_CORRECTIONS, "off_policy_correction", f"must be one of {OFF_POLICY_CORRECTIONS}")
        need(self.importance_sampling_cap >= 1, "importance_sampling_cap", "must be >= 1 (a weight of 1 means on-policy)")
        need(
            self.importance_sampling_clip_min is None or 0 < self.importance_sampling_clip_min <= 1,
            "importance_sampling_clip_min",
            "must be in (0, 1] (a weight of 1 means on-policy), or none for no lower bound",
        )
        need(self.on_nonfinite in NONFINITE_POLICIES, "on_nonfinite", f"must be one of {NONFINITE_POLICIES}")
        need(self.ddp_timeout > 0, "ddp_timeout", "must be > 0 seconds")
        need(self.sigterm_timeout > 0, "sigterm_timeout", "must be > 0 seconds")
        need(self.weight_transport in WEIGHT_TRANSPORTS, "weight_transport", f"must be one of {WEIGHT_TRANSPORTS}")
        need(not (self.rollout_api_key and self.rollout_api_key_file), "rollout_api_key_file", "and rollout_api_key both given; keep one")
        need(self.rollout_api_key != REDACTED, "rollout_api_key", f"is the {REDACTED} of a saved config; give the key itself, or {API_KEY_ENV}")
        init = self.model_init_kwargs or {}
        need(all(init.get(k, "float32") in MODEL_DTYPES for k in ("dtype", "torch_dtype")), "model_init_kwargs",
             f"its dtype must be one of {MODEL_DTYPES} (default float32, as TRL's)")  # fmt: skip

    def _validate_batch(self, need) -> None:
        """Groups, micro-batches, rounds and the optimizer."""
        need(self.num_generations >= 2, "num_generations", "must be >= 2: advantages compare completions within a group")
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
        need(self.steps_per_generation >= 1, "steps_per_generation", "must be >= 1")
        need(
            self.steps_per_generation % self.gradient_accumulation_steps == 0,
            "steps_per_generation",
            f"must be a multiple of gradient_accumulation_steps={self.gradient_accumulation_steps} so an optimizer step never spans two rounds",
        )
        need(
            self.completions_per_round() % self.num_generations == 0,
            "per_device_train_batch_size",
            f"per_device_train_batch_size * steps_per_generation = {self.completions_per_round()} completions per round "
            f"must be a multiple of num_generations={self.num_generations} (whole groups); e.g. use "
            f"{self.num_generations * max(1, round(self.per_device_train_batch_size / self.num_generations))}",
        )
        need(self.num_iterations >= 1, "num_iterations", "must be >= 1")
        need(self.max_steps >= 1 or self.num_train_epochs is not None, "max_steps", "must be >= 1, or -1 with num_train_epochs (steps from epochs)")
        need(self.num_train_epochs is None or self.num_train_epochs > 0, "num_train_epochs", "must be > 0")
        need(self.max_completion_length >= 1, "max_completion_length", "must be >= 1")
        need(self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length", "must be >= 1 or none")
        need(self.prompt_truncation in PROMPT_TRUNCATION, "prompt_truncation", f"must be one of {PROMPT_TRUNCATION}")
        need(self.token_normalizer in TOKEN_NORMALIZERS, "token_normalizer", f"must be one of {tuple(TOKEN_NORMALIZERS)}")
        need(self.optim in OPTIMIZERS, "optim", f"must be one of {OPTIMIZERS}")
        need(self.learning_rate > 0, "learning_rate", "must be > 0")
        need(self.lr_scheduler_type in SCHEDULERS, "lr_scheduler_type", f"unknown; valid names: {', '.join(SCHEDULERS)}")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        need(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        need(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        need(self.warmup_steps >= 0 and (self.warmup_steps < 1 or float(self.warmup_steps).is_integer()), "warmup_steps",
             "must be a whole number of steps, or a share of max_steps in [0, 1)")  # fmt: skip
        need(not (self.warmup_steps and self.warmup_ratio), "warmup_steps", f"and warmup_ratio={self.warmup_ratio} both given; keep one")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")

    def _validate_loss_and_rewards(self, need) -> None:
        """The loss, rewards, logging, evaluation and LoRA."""
        self._validate_loss_variants(need)
        need(self.loss_type in LOSS_TYPES, "loss_type", f"unknown; valid names: {', '.join(sorted(LOSS_TYPES))}")
        need(self.epsilon > 0, "epsilon", "must be > 0 (the ratio is clipped to [1 - epsilon, 1 + epsilon_high])")
        need(self.epsilon < 1, "epsilon", "must be < 1, or the lower clip bound 1 - epsilon is not positive")
        need(self.epsilon_high > 0, "epsilon_high", "must be > 0")
        need(self.delta is None or self.delta > 1 + self.epsilon_high, "delta", f"must be > 1 + epsilon_high = {1 + self.epsilon_high}")
        need(self.beta >= 0, "beta", "must be >= 0 (0 disables the KL term and loads no reference model)")
        need(self.scale_rewards in SCALE_REWARDS, "scale_rewards", f"must be one of {SCALE_REWARDS}")
        need(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level", f"must be one of {IMPORTANCE_SAMPLING_LEVELS}")
        need(bool(self.reward_funcs), "reward_funcs", "give at least one: --reward_funcs environment, the environment's get_reward()"
             if self.environment_factory else "give at least one, e.g. --reward_funcs exact_match")  # fmt: skip
        self._validate_swift(need)
        need(
            self.reward_weights is None or len(self.reward_weights) == len(self.reward_funcs),
            "reward_weights",
            f"give one weight per reward function ({len(self.reward_funcs)})",
        )
        need(self.reward_timeout is None or self.reward_timeout > 0, "reward_timeout", "must be > 0 seconds, or none for no bound")
        need(self.reward_on_timeout in ON_TIMEOUT, "reward_on_timeout", f"must be one of {ON_TIMEOUT}")
        need(self.reward_model_dtype in REWARD_MODEL_DTYPES, "reward_model_dtype", f"must be one of {REWARD_MODEL_DTYPES}")
        need(self.reward_model_batch_size >= 1, "reward_model_batch_size", "must be >= 1")
        need(self.max_resample_times >= 0, "max_resample_times", "must be >= 0")
        need(self.reward_num_workers >= 0, "reward_num_workers", "must be >= 0 (0 scores in a thread of the training process)")
        need(self.save_steps >= 0, "save_steps", "must be >= 0")
        need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit", "must be >= 1 or none")
        need(self.num_completions_to_log >= 0, "num_completions_to_log", "must be >= 0")
        need(check_report_to(self.report_to) is None, "report_to", check_report_to(self.report_to) or "")
        need(self.eval_steps >= 0, "eval_steps", "must be >= 0 (0 evaluates at the end only)")
        need(self.eval_num_generations >= 1, "eval_num_generations", "must be >= 1")
        need(self.lora_r >= 1, "lora_r", "must be >= 1")
        need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        need(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        need(
            self.lora_target_modules is None or self.lora_target_modules == ["all-linear"] or "all-linear" not in self.lora_target_modules,
            "lora_target_modules",
            "give all-linear alone, or module names",
        )

    def _validate_swift(self, need) -> None:
        """ms-swift's options: its defaults, dataset sample, plugins and reward arguments."""
        need(self.defaults in ("tandem", "swift"), "defaults", "give tandem or swift")
        need(self.dataset_sample >= 0, "dataset_sample", "must be >= 0 (0: every row)")
        missing = [p for p in self.external_plugins if not Path(p).is_file()]
        need(not missing, "external_plugins", f"{missing} are not files; give the path of each plugin .py file")
        need(self.repetition_n_grams >= 1, "repetition_n_grams", "must be >= 1")
        if "soft_overlong" in self.reward_funcs:
            need(self.soft_cache_length is not None and 0 < self.soft_cache_length < self.soft_max_length, "soft_cache_length",
                 f"the soft_overlong reward needs 0 < soft_cache_length < soft_max_length ({self.soft_max_length}), e.g. --soft_cache_length {self.soft_max_length // 4 or 1}")  # fmt: skip

    def _validate_loss_variants(self, need) -> None:
        """The options of TRL 1.16's loss variants and corrections, with TRL's rules."""
        need(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo_temperature_pos", "sapo temperatures must be > 0")
        need(min(self.vespo_k_pos, self.vespo_k_neg) >= 0, "vespo_k_pos", "vespo's k must be >= 0")
        need(min(self.vespo_lambda_pos, self.vespo_lambda_neg) > 0, "vespo_lambda_pos", "vespo's lambda must be > 0")
        need(
            self.loss_type != "vespo" or self.rollout_mode != "server" or self.off_policy_correction in ("none", "token_truncate", "token_mask"),
            "off_policy_correction",
            "loss_type vespo folds the off-policy weights into its own sequence weight (server mode): give token_truncate, token_mask or none",
        )
        need(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0, "off_policy_mask_threshold", "must be >= 0, or none")
        need(0 < self.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in (0, 1] (1 trains every token)")
        need(self.entropy_coef >= 0, "entropy_coef", "must be >= 0")
        need(0 <= self.entropy_coef_min <= self.entropy_coef_max, "entropy_coef_min", f"must be in [0, entropy_coef_max={self.entropy_coef_max}]")
        need(self.entropy_coef_delta >= 0 and self.entropy_target >= 0, "entropy_coef_delta", "entropy_coef_delta and entropy_target must be >= 0")
        need(0 < self.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha", "must be in (0, 1]")
        need(self.ref_model_sync_steps >= 1, "ref_model_sync_steps", "must be >= 1")
        need(not self.sync_ref_model or self.beta > 0, "sync_ref_model", "needs beta > 0: without a KL term there is no reference model to move")
        need(not (self.sync_ref_model and self.use_peft), "sync_ref_model",
             "is not supported with use_peft (as in TRL): the reference is the base model, and a mix of base and adapters is not a LoRA adapter")  # fmt: skip
        need(self.generation_batch_size is None or self.generation_batch_size >= 1, "generation_batch_size", "must be >= 1")
        need(not (self.cast_lm_head_to_fp32 and self.use_peft and "lm_head" in (self.lora_target_modules or [])), "cast_lm_head_to_fp32",
             "is not supported with an adapter on lm_head (as in TRL): leave lm_head out of lora_target_modules")  # fmt: skip

    def fsdp_options(self) -> dict:
        """fsdp_config with transformers' optional fsdp_ prefix dropped from its keys."""
        return {k.removeprefix("fsdp_"): v for k, v in (self.fsdp_config or {}).items()}

    def _validate_fsdp(self, need) -> None:
        words = self.fsdp.split()
        need(all(w in FSDP_OPTIONS for w in words), "fsdp", f"give {FSDP_OPTIONS[0]} or {FSDP_OPTIONS[1]}, optionally with auto_wrap (or nothing for DDP)")
        need(not ("full_shard" in words and "shard_grad_op" in words), "fsdp", "give full_shard or shard_grad_op, not both")
        options = self.fsdp_options()
        unknown = [k for k in options if k not in FSDP_CONFIG_KEYS]
        need(not unknown, "fsdp_config", f"unknown keys {unknown}; known: {', '.join(FSDP_CONFIG_KEYS)}")
        need(options.get("version", 2) == 2, "fsdp_config", "version must be 2 (tandem shards with FSDP2)")
        need(isinstance(options.get("reshard_after_forward", True), bool), "fsdp_config", "reshard_after_forward must be true or false")
        layers = options.get("transformer_layer_cls_to_wrap", [])
        need(isinstance(layers, str) or (isinstance(layers, list) and all(isinstance(c, str) for c in layers)), "fsdp_config",
             "transformer_layer_cls_to_wrap must be a class name or a list of them")  # fmt: skip
        need(not self.fsdp_config or bool(words), "fsdp_config", "has no effect without fsdp: add --fsdp full_shard")
        if words:
            need(not self.use_peft, "fsdp", "LoRA (use_peft) is not supported with fsdp yet: the adapters are small, so train them with DDP (drop fsdp)")
            need(not (self.dynamic_sample and self.rollout_mode == "colocate"), "fsdp",
                 "with dynamic_sample, ranks generate different numbers of batches, which a sharded colocated engine cannot (each forward is a collective): use rollout_mode server")  # fmt: skip
            need(not (self.max_tokens_per_round and self.rollout_mode == "colocate"), "fsdp",
                 "with max_tokens_per_round, ranks make different engine calls, which a sharded colocated engine cannot (each forward is a collective): use rollout_mode server")  # fmt: skip

    def warnings(self) -> list[str]:
        """Settings that work but are probably not what was meant: among them, options set to
        other than their default that have no effect in this run, each with the option it needs."""
        defaults = TrainConfig(model_name_or_path=self.model_name_or_path)
        idle = {
            "max_staleness": (not self.async_generate and self.max_tokens_per_round is None, "async_generate true or max_tokens_per_round"),
            "eval_steps": (self.eval_dataset is None, "an eval_dataset"),
            "eval_num_generations": (self.eval_dataset is None, "an eval_dataset"),
            "max_resample_times": (not self.dynamic_sample, "dynamic_sample true"),
            "verify_weight_sync": (self.rollout_mode != "server", "rollout_mode server"),
            "rollout_server_urls": (self.rollout_mode != "server", "rollout_mode server"),
            **{k: (len(self.rollout_server_urls) < 2 or self.rollout_mode != "server", "rollout_mode server and several rollout_server_urls")
               for k in ("rollout_balance", "rollout_replica_timeout")},
            "off_policy_correction": (self.rollout_mode != "server" and self.max_tokens_per_round is None,
                                      "rollout_mode server or max_tokens_per_round (a colocated engine samples on-policy)"),
            **{f"lora_{k}": (not self.use_peft, "use_peft true") for k in ("r", "alpha", "dropout", "target_modules", "modules_to_save")},
            **{f"sapo_temperature_{k}": (self.loss_type != "sapo", "loss_type sapo") for k in ("pos", "neg")},
            **{f"vespo_{k}": (self.loss_type != "vespo", "loss_type vespo") for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
            **{f"entropy_{k}": (not self.use_adaptive_entropy, "use_adaptive_entropy true") for k in ("coef_min", "coef_max", "coef_delta", "target")},
            **{f"ref_model_{k}": (not self.sync_ref_model, "sync_ref_model true") for k in ("mixup_alpha", "sync_steps")},
            "cast_lm_head_to_fp32": (not self.bf16, "bf16 true (in fp32 the head computes in fp32 already)"),
            "token_normalizer": (self.loss_type not in ("dapo", "cispo", "vespo") or self.steps_per_generation == self.gradient_accumulation_steps,
                                 "loss_type dapo, cispo or vespo and steps_per_generation > gradient_accumulation_steps"),
            **{k: (not (self.tools or self.environment_factory), "tools or environment_factory")
               for k in ("max_tool_calling_iterations", "tool_timeout", "max_tool_response_tokens")},
            "tool_parser": (not (self.tools or self.environment_factory or self.agent_func), "tools, environment_factory or agent_func"),
            **{k: (not self.agent_func, "agent_func") for k in ("agent_timeout", "max_turns", "agent_failure", "agent_workers", "agent_train_rows")},
            "tool_workers": (not self.tools, "tools"),
        }
        out = [f"{name}={getattr(self, name)!r} has no effect without {needs}" for name, (unused, needs) in idle.items()
               if unused and getattr(self, name) != getattr(defaults, name)]  # fmt: skip
        if self.max_tokens_per_round is not None and self.max_staleness < 2:
            out.append(f"max_tokens_per_round with max_staleness {self.max_staleness} carries no sequence across versions (only the "
                       "round being generated is in flight), so it only splits that round's engine calls: set max_staleness >= 2")  # fmt: skip
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            out.append("loss_type luspo is meant with importance_sampling_level sequence, as in its paper (TRL warns the same)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            out.append("loss_type vespo computes its sequence weight itself: importance_sampling_level should be token (TRL warns the same)")
        if self.importance_sampling_level == "sequence" and self.loss_type not in ("grpo", "luspo", "sapo", "vespo"):
            # As TRL warns: a token-sum reduction weights each sequence by its length (GSPO, arXiv:2507.18071, eq. 5).
            out.append(
                f"importance_sampling_level 'sequence' with loss_type {self.loss_type!r} sums per-token terms, so each "
                "sequence weighs as much as its length: that is not GSPO's per-sequence objective; use loss_type grpo for it"
            )
        return out

    def to_dict(self) -> dict:
        """The config as saved (config.yaml, every checkpoint), printed and sent to trackers: the
        servers' key redacted."""
        out = dataclasses.asdict(self)
        if out["rollout_api_key"] is not None:
            out["rollout_api_key"] = REDACTED
        return out

    def api_key(self) -> str | None:
        """The servers' key: rollout_api_key, else the first line of rollout_api_key_file, else
        the environment's TANDEM_API_KEY, else None."""
        try:
            return read_api_key(self.rollout_api_key, self.rollout_api_key_file, "rollout_api_key_file")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def url_problem(url: str) -> str | None:
    """What is wrong with a rollout server's URL, or None: a scheme of http or https, a host, a
    port that is a number."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"has {'no scheme' if not parts.scheme or '://' not in url else f'the scheme {parts.scheme!r}'}"
    if not parts.hostname:
        return "has no host"
    try:
        parts.port
    except ValueError:
        return f"has a port that is not a number from 0 to 65535 ({parts.netloc.rpartition(':')[2]!r})"
    return None


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


# What a checkpoint's state depends on: its rounds ahead hold groups of num_generations completions
# of max_completion_length tokens, cut into its micro-batches; its sampler walks its data with its
# seed; its weights (or adapters) are those of its model. A resume must keep these; the rest (the
# learning rate, max_steps, logging, servers) may change, and the resume lists what did.
RESUME_FIXED = (
    "model_name_or_path", "dataset_name", "dataset_sample", "dataset_split", "dataset_config", "shuffle_dataset", "seed", "num_generations",
    "max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "loss_type", "async_generate", "max_staleness", "max_tokens_per_round", "lora_r", "lora_alpha", "lora_target_modules", "lora_modules_to_save", "sync_ref_model",
)  # fmt: skip (use_peft and fsdp have checks of their own, which say how to resume)
NOT_COMPARED = ("resume_from_checkpoint", "overwrite_output_dir", "output_dir")  # where the run goes, not what it is


def resume_changes(saved: dict, config: "TrainConfig") -> list[str]:
    """The options a resume changes, as 'name: old -> new'; a ConfigError naming each fixed one
    (RESUME_FIXED) that differs from the checkpoint's `saved` config."""
    now = config.to_dict()
    changed = {k: (saved[k], now[k]) for k in now if k in saved and k not in NOT_COMPARED and saved[k] != now[k]}
    if not (saved.get("use_peft") and now["use_peft"]):  # no adapters on one side: its lora_* mean nothing (use_peft's own check says how to resume)
        changed = {k: v for k, v in changed.items() if not k.startswith("lora_")}
    fixed = [f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items() if k in RESUME_FIXED]
    if fixed:
        raise ConfigError(f"resume_from_checkpoint: the checkpoint's run differs in {'; '.join(fixed)}. Resume with its values, or start a new run from its model")
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()]


# ---------------------------------------------------------------- loading and the command line


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _resolve_names(layers: list[tuple[dict, str]]) -> compat.Resolved:
    """TRL's and ms-swift's names resolved into tandem's options over every layer at once
    (tandem.trainer.compat); a refused one is a config error naming it."""
    try:
        resolved = compat.resolve(layers, set(_fields()))
    except compat.Refused as exc:
        raise ConfigError(str(exc)) from None
    if resolved.values.get("defaults") == "swift":
        swift = compat.swift_defaults(resolved.values, int(os.environ.get("WORLD_SIZE", "1")))
        resolved.values |= swift
        resolved.notes.append(f"defaults swift: ms-swift's {', '.join(f'{k} {v!r}' for k, v in swift.items())}")
    return resolved


def _base_type(tp):
    """(scalar type, is_list, is_optional) of a field annotation."""
    optional = False
    args = typing.get_args(tp)
    if type(None) in args:
        optional = True
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True, optional
    return tp, False, optional


def _parse_scalar(kind, text: str, name: str, optional: bool):
    if optional and text.lower() in ("none", "null"):
        return None
    if kind is dict:
        return _parse_mapping(text, name)
    if kind is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{name}={text!r}: expected true or false")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected {kind.__name__}") from None


def _parse_mapping(text: str, name: str) -> dict:
    """A mapping option on the command line: JSON, or a JSON or YAML file holding one."""
    try:
        value = yaml.safe_load(Path(text).read_text()) if Path(text).is_file() else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{name}={text!r}: expected a JSON object or a JSON/YAML file holding one ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={text!r}: expected a JSON object or a JSON/YAML file holding one")
    return value


def _check_scalar(kind, value, name):
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        return _parse_scalar(float, value, name, False)  # YAML reads 1e-5 as a string
    if kind is dict and isinstance(value, str):
        return _parse_mapping(value, name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _typed(resolved: compat.Resolved) -> dict:
    """Each resolved option's value in its field's type: text (the command line's) parsed, YAML's
    values checked. A null means None where the option takes none, the default where TRL's
    default is null, and is refused elsewhere. Messages name each option as the user wrote it."""
    values = {}
    for name, raw in resolved.values.items():
        shown = resolved.given_as.get(name, name)
        kind, is_list, optional = _base_type(_fields()[name].type)
        texts = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) and all(isinstance(r, str) for r in raw) else None
        null = raw is None or (texts is not None and len(texts) == 1 and compat.is_null(texts[0]) and (optional or shown in compat.TRL_NULL_DEFAULTS))
        if null:
            if optional:
                values[name] = None
            elif shown not in compat.TRL_NULL_DEFAULTS:  # there, TRL's default: tandem's default
                raise ConfigError(f"{shown}: null is not allowed; remove it to use the default")
        elif texts is not None and (is_list or isinstance(raw, str)):
            parsed = [_parse_scalar(kind, t, shown, False) for t in texts]
            values[name] = parsed if is_list else parsed[0]
        elif is_list:
            values[name] = [_check_scalar(kind, v, shown) for v in (raw if isinstance(raw, list) else [raw])]
        else:
            values[name] = _check_scalar(kind, raw, shown)
    return values


def read_file(path: str | Path) -> tuple[dict, list[str]]:
    """A config file's options as written, TRL's and ms-swift's names not yet resolved, and a note
    on the transformers TrainingArguments options it sets to their defaults (a dumped GRPOConfig
    holds them all), which are dropped. An unknown key, or such an option at another value, is an
    error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).strip()}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    return known_options(data, f"in {path}")


def known_options(data: dict, where: str) -> tuple[dict, list[str]]:
    """`data` without the transformers TrainingArguments options tandem does not use, at their
    defaults, and a note on them; an unknown key, or such an option at another value, is an
    error naming it and `where` it was given."""
    known = [*_fields(), *compat.OPTIONS]
    unused, data = [], dict(data)
    for key in [k for k in data if k not in known]:
        try:
            refusal = compat.unused_training_argument(key, data[key])
        except KeyError:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see `tandem train --help` for the options"
            raise ConfigError(f"unknown key {key!r} {where}{hint}") from None
        if refusal:
            raise ConfigError(f"{refusal} ({where})")
        unused.append(data.pop(key))
    notes = [f"{len(unused)} transformers TrainingArguments options tandem does not use, at their defaults: no effect"] if unused else []
    return data, notes


def config_values(options: dict, where: str) -> tuple[dict, compat.Resolved]:
    """Options given as keywords (the Python API's GRPOConfig), TRL's and ms-swift's names
    resolved as a YAML file's are: (TrainConfig's values, the resolution with its notes)."""
    data, notes = known_options(options, where)
    resolved = _resolve_names([(data, where)])
    resolved.notes[:0] = notes
    return _typed(resolved), resolved


def load_yaml(path: str | Path) -> dict:
    """A config file's options, TRL's and ms-swift's names resolved into tandem's, typed."""
    return _typed(_resolve_names([(read_file(path)[0], f"in {path}")]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One --option per config field, grouped as in the dataclass, with its help text."""
    parser.add_argument("--config", help="YAML file of options; options given on the command line override it.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        section = f.metadata["section"]
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        kind, is_list, optional = _base_type(f.type)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        metavar = {bool: "true|false", int: "INT", float: "FLOAT", str: "STR", dict: "JSON|FILE"}[kind]
        groups[section].add_argument(
            f"--{f.name}",
            nargs="+" if is_list else None,
            metavar=metavar,
            default=argparse.SUPPRESS,
            help=f"{f.metadata['help']} (default: {default})",
        )
    trl = parser.add_argument_group("TRL's and ms-swift's names (docs/configuration.md#trl-and-ms-swift-options)")
    for name, option in compat.OPTIONS.items():
        if name not in _fields():
            trl.add_argument(f"--{name}", nargs="+", metavar="VALUE", default=argparse.SUPPRESS, help=f"{option.kind}: {option.doc}".replace("%", "%%"))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the YAML file, then the command line, their names resolved together; validated."""
    layers, notes = [], []
    if getattr(args, "config", None):
        values, notes = read_file(args.config)
        # Each of the file's own values is checked, also one the command line overrides: a typo
        # there would fail the next run that drops the override
        try:
            own = {k: v for k, v in values.items() if k in _fields() and getattr(compat.OPTIONS.get(k), "resolve", None) is None}
            _typed(compat.Resolved(own, [], {}))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in {args.config})") from None
        layers.append((values, f"in {args.config}"))
    given = {k: v for k, v in vars(args).items() if k in _fields()}
    given |= {k: v[0] if len(v) == 1 else v for k, v in vars(args).items() if k in compat.OPTIONS and k not in _fields()}
    layers.append((given, "on the command line"))
    resolved = _resolve_names(layers)
    config = TrainConfig(**_typed(resolved))
    config.notes, config.given_as = notes + resolved.notes, resolved.given_as
    config.validate()
    return config
