"""Building a run: the one place that reads TrainConfig. It resolves the mode (colocated, server
sync, server async), the distribution (DDP or FSDP) and LoRA once, into small objects with one
job each (tandem.trainer.loop uses them and branches on none of these):

  dist          this process among the training processes, and every collective
  state         TrainState: step, version, round, data position (fresh, or the checkpoint's)
  learner       the policy, its optimizer, schedule and reference; log-probs and the update
  producer      the rounds of scored rollouts, generated in turn or ahead
  sync          the new weights live on the engine after each round
  checkpointer  saves the run at a round's end
  log           metrics.jsonl, completions.jsonl, eval.jsonl, trackers, the progress bar
  evaluator     evaluation on held-out prompts (with eval_dataset)

The order of the steps is the order of their effects: nothing is written into output_dir before
the resume-or-fresh decision, cheap checks (rewards, tokenizer, dataset) come before the model
loads, the weights draw from the seeded RNG in the same order in every run, and a resume's RNG
state is set last, after everything that draws at setup.
"""

import contextlib
import inspect
import json
import math
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs, set_seed
from transformers import AutoConfig
from safetensors.torch import load_model

from tandem import rewards as rewards_lib
from tandem.algo import Objective
from tandem.children import die_with
from tandem.data import GroupSampler
from tandem.loading import load_object
from tandem.engines.engine import TransformersEngine, eos_token_ids
from tandem.rollout.agents import AgentFunction, AgentOptions
from tandem.rollout.multiturn import MultiTurn, RolloutFunction, Rollouts, SingleTurn
from tandem.rollout.tools import INVALID_CALL, UNKNOWN_TOOL, environment_tools, load_tools
from tandem.server.sessions import Bounds, SessionServing, SessionStore
from tandem.trainer import checkpoint, lora, metrics, sharding
from tandem.trainer.batch import PrefixSharingLM
from tandem.trainer.config import ConfigError, TrainConfig, resume_changes
from tandem.trainer.dist import Dist
from tandem.trainer.eval import Evaluator
from tandem.trainer.learner import EntropyBonus, Learner, LossSettings, ReferenceSync
from tandem.trainer.partial import PartialProducer, SyncPartialProducer
from tandem.trainer.producer import AsyncProducer, SyncProducer
from tandem.trainer.servers import ServerOptions, Servers
from tandem.trainer.setup import (
    PolicyOptions, PromptOptions, available_memory, build_policy, load_prompts, load_tokenizer, model_load_kwargs, resolve_bf16, resolve_checkpointing,
)
from tandem.trainer.state import TrainState
from tandem.trainer.sync import WeightSync


@dataclass(frozen=True)
class Schedule:
    """The loop's plain values: how a round is cut into steps, and when to save and evaluate."""

    max_steps: int
    num_generations: int
    scale_rewards: str
    num_iterations: int
    steps_per_pass: int  # optimizer steps per pass over a round
    grad_accum: int  # micro-batches per optimizer step
    micro_batch: int  # completions per micro-batch
    max_completion_length: int
    mask_truncated: bool
    token_normalizer: str  # dapo's divisor of each step (tandem.algo.step_token_normalizers)
    seed: int
    save_steps: int
    eval_steps: int
    server: bool  # a rollout server generates: behaviour log-probs from other numerics
    asynchronous: bool  # rounds generated ahead of training, in the background
    dynamic_sample: bool
    output_dir: str
    sigterm_timeout: float  # seconds from a SIGTERM to the exit, whatever the run is doing
    tool_names: list[str] | None = None  # a multi-turn run's tools (metrics per tool); None: one turn
    agents: bool = False  # agent_func: agents/* metrics
    partial: bool = False  # max_tokens_per_round: tokens of older versions (in every mode), partial_rollouts/* metrics


@dataclass
class Run:
    """What build() makes of a config, for the loop."""

    schedule: Schedule
    dist: Dist
    state: TrainState
    learner: Learner
    producer: SyncProducer
    sync: WeightSync
    checkpointer: checkpoint.Checkpointer
    log: metrics.RunLog
    evaluator: Evaluator | None
    tokenizer: object
    reward_fns: list
    skipped_prompts: int
    servers: Servers | None
    pushes: sharding.Pushes | None
    lock: checkpoint.RunFolderLock | None = None  # rank 0's hold on output_dir

    def close(self, ok: bool = True) -> None:
        """After a failure the process group is left alone: destroying it could wait on a rank
        that is stuck in a collective; the launcher ends the other ranks when this one exits."""
        if self.lock is not None:
            self.lock.release()
        self.producer.close(ok)
        rewards_lib.close_rewards(self.reward_fns)
        if self.servers is not None:
            self.servers.close()
            self.pushes.close()
        self.log.close()
        self.dist.close()
        if ok:
            # DDP's reducer holds the process group. Freed after the group is destroyed, it would
            # hold the last reference and destroy the group itself, joining gloo's threads with
            # the GIL held while one waits for the GIL: a hang at the end of a finished run (seen
            # with 2 processes; pytorch/pytorch#56297). So the model goes first, then the group.
            self.learner.model = self.learner.grad_sync = None
            self.dist.accelerator.free_memory()
            self.dist.accelerator.end_training()


@dataclass(frozen=True)
class Given:
    """What the Python API (tandem/api.py) hands over as objects instead of the config's specs:
    reward functions (NamedReward, loaded), datasets (data.GivenDataset), the model (a
    PreTrainedModel or PeftModel, trained in place) and its tokenizer."""

    reward_fns: list | None = None
    train_dataset: object = None
    eval_dataset: object = None
    listeners: tuple = ()  # metrics.Listener: callbacks
    model: object = None
    tokenizer: object = None
    objects: dict = field(default_factory=dict)  # loading.GIVEN spec -> the tool, environment_factory or rollout_func given


def build(config: TrainConfig, given: Given = Given()) -> Run:
    config.validate()
    config.bf16, bf16_warning = resolve_bf16(config.bf16)
    set_seed(config.seed)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun or accelerate launch: a killed launcher's workers trained on
        die_with(os.getppid(), "its launcher (torchrun or accelerate launch) is gone")
    dist = Dist(_accelerator(config))
    # Before anything reads or writes output_dir: one trainer at a time there
    lock = checkpoint.RunFolderLock(config.output_dir) if dist.is_main else None
    try:
        run = _build(config, dist, bf16_warning, given)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    run.lock = lock
    return run


def _build(config: TrainConfig, dist: Dist, bf16_warning: str | None, given: Given) -> Run:
    sharding.from_accelerate_config(config)
    plan = sharding.plan(config.fsdp, config.fsdp_options())  # None: DDP
    if plan is not None and dist.world == 1:
        sharding.init_single_process(dist.device)
    out = Path(config.output_dir)
    resume_dir, saved = _resume_or_fresh(config, dist, plan is not None, bf16_warning)

    # Cheap checks first: reward functions and the dataset fail before the model loads.
    reward_fns = given.reward_fns if given.reward_fns is not None else config.load_rewards()
    tokenizer, max_len = load_tokenizer(config.model_name_or_path, config.trust_remote_code, given.tokenizer, given.model)
    # A sharded colocated engine's every forward is a collective: its decoding, and a round's
    # turns, go on until every process's are done.
    lockstep = plan is not None and config.rollout_mode == "colocate"
    turns_done = (lambda done: dist.all_collective(done, "trajectories done (sharded turns)")) if lockstep else None
    rollouts, template_kwargs, tool_names = _turns(config, tokenizer, turns_done, max_len, given.objects)
    prompts = PromptOptions(config.dataset_split, config.dataset_config, config.max_prompt_length, config.prompt_truncation, config.max_completion_length,
                            template_kwargs)  # fmt: skip
    table, skipped = load_prompts(given.train_dataset or config.dataset_name, tokenizer, prompts, max_len, (config.dataset_sample, config.seed))
    if isinstance(rollouts, MultiTurn) and not all(table.conversational):
        raise ConfigError(f"tools and environment_factory need chat prompts (lists of messages) to render turns with the chat template; "
                          f"{config.dataset_name} has plain-text prompts")  # fmt: skip
    # the Python API's eval_dataset may be a dict of them, each evaluated under its name
    eval_sources = given.eval_dataset if isinstance(given.eval_dataset, dict) else {"": given.eval_dataset or config.eval_dataset}
    eval_tables = {name: load_prompts(source, tokenizer, prompts, max_len)[0] for name, source in eval_sources.items() if source}
    if skipped and dist.is_main:
        print(f"tandem: skipped {skipped} prompts longer than max_prompt_length={config.max_prompt_length}")
    if config.max_steps < 1:  # from num_train_epochs, now that the prompts are counted
        config.max_steps = config.steps_for_epochs(len(table.prompt_ids), dist.world)
        if dist.is_main:
            print(f"tandem: num_train_epochs={config.num_train_epochs:g} over {len(table.prompt_ids)} prompts: max_steps={config.max_steps}")

    if config.gradient_checkpointing is None:
        _decide_checkpointing(config, dist, max(len(p) for p in table.prompt_ids), given.model)
    learner = _learner(config, dist, plan, resume_dir, tokenizer.pad_token_id, given.model)
    if dist.is_main:
        print(_precision_line(config, learner.lm), flush=True)
    state = TrainState.from_checkpoint(saved) if saved else TrainState()
    # A failure past here ends what this build started, or it would outlive the failed run in
    # this process (a notebook, the tests): the servers' hold, renewed by a thread, and the
    # producer's thread. The Run owns them once it is made.
    with contextlib.ExitStack() as undo:
        servers = pushes = None
        if config.rollout_mode == "server":
            servers, pushes, push = _servers(config, dist, learner, state, len(tokenizer), plan is not None)
            undo.callback(pushes.close)
            undo.callback(servers.close)
            engine = servers.engine
        else:
            eos_ids = eos_token_ids(tokenizer, learner.lm.generation_config, config.model_name_or_path)
            all_done = (lambda done: dist.all_collective(done, "sequences done (sharded decoding)")) if lockstep else None
            engine, push = TransformersEngine(learner.lm, eos_ids, tokenizer.pad_token_id, state.version, all_done, tokenizer=tokenizer), None
        engine.version = state.version
        producer = _producer(config, dist, table, tokenizer, reward_fns, engine, rollouts)
        undo.callback(producer.close, False)
        if not saved:
            state.sampler = producer.sampler.state_dict()
        checkpointer = checkpoint.Checkpointer(out, dist, learner, producer, tokenizer, config.to_dict(), config.save_total_limit, plan is not None)
        ready, carried = checkpointer.restore_rank(resume_dir) if resume_dir else ([], None)
        if resume_dir:
            producer.sampler.load_state_dict(saved["sampler"])
            _resume_logs(out, dist, resume_dir, state)
        producer.start(state.round, ready, carried)
        producer.set_live_version(state.version)
        last_step = config.max_steps
        sync = WeightSync(engine, producer, dist, push, config.max_staleness if config.async_generate else None, last_step)
        log = metrics.RunLog(out, dist.accelerator, dist.is_main, bool(eval_tables), config.num_completions_to_log, last_step, not config.disable_tqdm,
                             given.listeners)  # fmt: skip
        evaluator = None
        if eval_tables:
            evaluator = Evaluator(engine, tokenizer, eval_tables, reward_fns, config.sampling_params(), config.eval_num_generations, config.eval_greedy,
                                  config.seed, config.eval_pass_threshold, dist, every_rank=plan is not None and servers is None, rollouts=rollouts)  # fmt: skip
        undo.pop_all()
    return Run(_schedule(config, tool_names), dist, state, learner, producer, sync, checkpointer, log, evaluator, tokenizer, reward_fns, skipped, servers, pushes)


def _accelerator(config: TrainConfig) -> Accelerator:
    # accelerate keeps one process-wide state and refuses another mixed precision once it is set:
    # a second run in this process (a notebook, a sweep, the tests) starts from a clean one. The
    # process group (PartialState) is kept.
    AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision="bf16" if config.bf16 else "no",
        # Every collective gets a finite timeout: a rank that died can never hang the others forever.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))],
        log_with=metrics.log_with(config.report_to),
        project_dir=config.output_dir,
        # accelerate only sets up a multi-process CPU run (gloo) under torchrun when told it is on CPU
        cpu=not torch.cuda.is_available(),
    )


def _resume_or_fresh(config: TrainConfig, dist: Dist, sharded: bool, bf16_warning: str | None) -> tuple[Path | None, dict | None]:
    """Resume or a fresh run, decided before anything is written into output_dir; then rank 0
    writes the resolved config, says what changed, and the trackers start. Resuming: the weights
    come from the checkpoint, everything else from its state files."""
    out = Path(config.output_dir)
    resume_dir = checkpoint.resolve(config.resume_from_checkpoint, out) if config.resume_from_checkpoint else None
    saved = saved_state(resume_dir) if resume_dir else None
    changes, previous = [], {}
    if saved:
        checkpoint.check_resume(resume_dir, saved, dist.world, sharded)
        previous = yaml.safe_load((resume_dir / "config.yaml").read_text())
    # A resumed run keeps its run's gradient_checkpointing, whatever memory it finds now (the
    # gradients round otherwise); a new run's default is decided once its prompts are read (build).
    if config.gradient_checkpointing is None and isinstance(previous.get("gradient_checkpointing"), bool):
        config.gradient_checkpointing = previous["gradient_checkpointing"]
    if saved:
        changes = resume_changes(previous, config)
    else:
        checkpoint.check_writable(out)
        checkpoint.check_fresh(out, config.overwrite_output_dir, dist.is_main)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        resolved = yaml.safe_dump(config.to_dict(), sort_keys=False)
        (out / "config.yaml").write_text(resolved)
        defaults = ", ms-swift's defaults" if config.defaults == "swift" else ""
        print(f"tandem: resolved config ({dist.world} process(es){defaults})\n{resolved}", flush=True)
        if config.notes:
            print("tandem: from TRL's and ms-swift's names:\n  " + "\n  ".join(config.notes), flush=True)
        if changes:
            print(f"tandem: resuming {resume_dir} with changed options: {'; '.join(changes)}", flush=True)

        for warning in config.warnings() + ([bf16_warning] if bf16_warning else []):
            print(f"tandem: warning: {warning}", file=sys.stderr, flush=True)
    if metrics.log_with(config.report_to):
        try:
            dist.accelerator.init_trackers("tandem", config=metrics.hyperparameters(config.to_dict()), init_kwargs={"wandb": {"dir": str(out)}})
        except Exception as exc:
            if type(exc).__name__ == "UsageError" and "API key" in str(exc):  # wandb's, without an account configured
                raise ConfigError("report_to wandb: no W&B API key is configured: run `wandb login` (or set WANDB_API_KEY), or set "
                                  "WANDB_MODE=offline to keep the W&B run in output_dir/wandb without an account") from None  # fmt: skip
            raise
    return resume_dir, saved


def _decide_checkpointing(config: TrainConfig, dist: Dist, longest_prompt: int, model=None) -> None:
    """gradient_checkpointing's default, from the model's shape (the given `model`'s, else the
    named one's), a micro-batch of the longest prompt and max_completion_length, and the memory
    there is; said, and written into config.yaml (a resume keeps it)."""
    model_config = model.config if model is not None else AutoConfig.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
    tokens = config.per_device_train_batch_size * (longest_prompt + config.max_completion_length)
    config.gradient_checkpointing, why = resolve_checkpointing(model_config, tokens, available_memory(dist.device))
    if dist.is_main:
        print(f"tandem: {why}", flush=True)
        (Path(config.output_dir) / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def _learner(config: TrainConfig, dist: Dist, plan, resume_dir: Path | None, pad_id: int, given=None) -> Learner:
    """The policy (the `given` model, else the named one; the checkpoint's weights when resuming),
    prepared: DDP wraps a whole copy, FSDP has sharded it already; the gradient-sync switch of
    either; the optimizer's and schedule's state."""
    options = PolicyOptions(
        model=config.model_name_or_path,
        given=given,
        load_kwargs=model_load_kwargs(config.model_init_kwargs, config.trust_remote_code),
        disable_dropout=config.disable_dropout,
        head_in_fp32=config.cast_lm_head_to_fp32 and bool(config.bf16),
        checkpointing=config.gradient_checkpointing,
        reference=config.beta != 0.0 and not config.use_peft,
        lora=lora.LoraOptions(config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules, config.lora_modules_to_save,
                              config.model_name_or_path) if config.use_peft else None,  # fmt: skip
        fused=config.optim == "adamw_torch_fused",
        learning_rate=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        weight_decay=config.weight_decay,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup(),
        max_steps=config.max_steps,
        sparse_embedding=plan is None and dist.world == 1,
    )
    shard = None if plan is None else lambda m: sharding.shard(m, plan, config.bf16, dist.device)
    model, ref_model, optimizer, scheduler = build_policy(options, resume_dir, dist.device, shard)
    # The trainer's forward goes through PrefixSharingLM; the engine, pushes and checkpoints use the LM inside.
    if plan is None:
        wrapped, optimizer = dist.accelerator.prepare(PrefixSharingLM(model), optimizer)
    else:  # sharded already; prepare would wrap it in DDP
        wrapped, optimizer = PrefixSharingLM(model), dist.accelerator.prepare(optimizer)
    # Toggle the gradient sync instead of entering no_sync(): the same effect without a context
    # manager around the forward (nanoGPT does the same with require_backward_grad_sync).
    if plan is not None:
        grad_sync = model.set_requires_gradient_sync
    elif hasattr(wrapped, "require_backward_grad_sync"):  # DDP
        grad_sync = lambda on: setattr(wrapped, "require_backward_grad_sync", on)  # noqa: E731
    else:  # one process: nothing to sync
        grad_sync = lambda on: None  # noqa: E731
    ref_sync = ReferenceSync(config.ref_model_mixup_alpha, config.ref_model_sync_steps if config.sync_ref_model else 0)
    moving_ref = ref_model.lm if ref_sync.every else None  # its weights are in the checkpoint
    if resume_dir is not None and plan is not None:  # the weights and optimizer state of this rank's shards
        sharding.load_checkpoint(model, optimizer.optimizer, resume_dir, moving_ref)
    elif resume_dir is not None:
        optimizer.load_state_dict(torch.load(resume_dir / "optimizer.pt", weights_only=True))
        if moving_ref is not None:
            load_model(moving_ref, str(resume_dir / checkpoint.REFERENCE))
    if resume_dir is not None:
        scheduler.load_state_dict(torch.load(resume_dir / "scheduler.pt", weights_only=True))
    objective = Objective(config.epsilon, config.epsilon_high, config.delta, config.sapo_temperature_pos, config.sapo_temperature_neg,
                          config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg)  # fmt: skip
    loss = LossSettings(
        config.loss_type, objective, config.importance_sampling_level, config.beta, config.use_bias_correction_kl and config.beta != 0.0,
        config.temperature, config.mask_truncated_completions, config.off_policy_correction, config.importance_sampling_cap,
        config.importance_sampling_clip_min, config.off_policy_mask_threshold, config.top_entropy_quantile,
    )  # fmt: skip
    entropy = EntropyBonus(config.entropy_coef, config.use_adaptive_entropy, config.entropy_coef_min, config.entropy_coef_max,
                           config.entropy_coef_delta, config.entropy_target)  # fmt: skip
    if resume_dir is not None and "entropy_bonus" in saved_state(resume_dir):
        entropy.load_state_dict(saved_state(resume_dir)["entropy_bonus"])
    return Learner(wrapped, optimizer, scheduler, ref_model, dist, pad_id, loss, config.per_device_train_batch_size, config.max_grad_norm,
                   config.on_nonfinite, lockstep=plan is not None, grad_sync=grad_sync, entropy=entropy, ref_sync=ref_sync)  # fmt: skip


def _precision_line(config: TrainConfig, lm: torch.nn.Module) -> str:
    """What the policy trains in: its weights' dtype, where that came from, and mixed precision."""
    init = config.model_init_kwargs or {}
    given = init.get("dtype", init.get("torch_dtype"))
    dtype = str(next(lm.parameters()).dtype).removeprefix("torch.")
    source = f"model_init_kwargs dtype {given}" if given else 'the default, as TRL\'s; model_init_kwargs {"dtype": ...} changes it'
    return f"tandem: the policy trains {dtype} weights ({source}); bf16 mixed precision {'on' if config.bf16 else 'off'}"


def saved_state(resume_dir: Path) -> dict:
    return json.loads((resume_dir / "trainer_state.json").read_text())


def _servers(config: TrainConfig, dist: Dist, learner: Learner, state: TrainState, vocab_size: int, sharded: bool):
    """Server mode: the servers, held for this run and holding its weights and version, and the
    push that makes each new version live on them (a collective: sharded weights are gathered
    on every rank, and staged on disk by rank 0, the one that pushes)."""
    name = f"in {Path(config.output_dir).resolve()} on {socket.gethostname()} (pid {os.getpid()})"
    options = ServerOptions(config.rollout_server_urls, config.api_key(), config.rollout_connect_timeout, config.rollout_request_timeout,
                            config.rollout_server_timeout, config.weight_transport, config.delta_weight_updates,
                            config.rollout_balance, config.rollout_replica_timeout, config.use_peft, config.verify_weight_sync,
                            config.model_name_or_path, name)  # fmt: skip
    servers = Servers(options, vocab_size, dist.world, dist.is_main, share_cores=config.async_generate)
    pushes = sharding.Pushes(Path(config.output_dir), servers.client.bucket_bytes, dist.is_main)

    def policy_collective(version: int):
        """What a push sends: every weight, or with LoRA the adapters. Sharded, the weights are
        gathered and staged on disk a bucket at a time (rank 0 gets them, the other ranks None);
        the last push's staging stays: it is the client's copy for a restarted server."""
        if sharded:
            dist.enter("gather weights")
            return pushes.stage(learner.lm.named_parameters(), version)
        return lora.adapter_weights(learner.lm) if config.use_peft else list(learner.lm.named_parameters())

    def push_collective(version: int) -> None:
        policy = policy_collective(version)
        if dist.is_main:
            servers.push(policy, version)

    try:
        policy = policy_collective(state.version)
        if dist.is_main:
            servers.start(policy, lora.base_weights(learner.lm) if config.use_peft else None, state.version, state.run_id)
        dist.barrier_collective("servers hold the run's weights")
    except BaseException:
        servers.close()  # let go of what start() claimed, and stop renewing it
        pushes.close()
        raise
    return servers, pushes, push_collective


def _turns(config: TrainConfig, tokenizer, all_done, max_len: int | None, given: dict) -> tuple[Rollouts, dict, list[str] | None]:
    """How prompts become trajectories, the chat template's arguments (the tools' schemas
    included), and the names multi-turn metrics count tool calls under (None: one turn).
    `all_done`: a sharded colocated engine's lockstep across processes (MultiTurn's); `max_len`:
    the model's context, which bounds an agent's prompts; `given`: the objects the Python API
    was given by loading.GIVEN spec."""
    template_kwargs = dict(config.chat_template_kwargs or {})
    if not config.multi_turn():
        return SingleTurn(config.max_completion_length), template_kwargs, None
    if config.agent_func:
        return _agents(config, tokenizer, template_kwargs, max_len), template_kwargs, []
    if config.rollout_func:
        try:
            fn = load_object(config.rollout_func, "rollout_func", given=given)
        except (ValueError, OSError, ImportError) as exc:
            raise ConfigError(str(exc)) from exc
        if not inspect.iscoroutinefunction(fn):
            raise ConfigError(f"rollout_func {config.rollout_func!r} must be an async def fn(prompt, generate, tokenizer): it awaits generate(token_ids)")
        return RolloutFunction(fn, config.rollout_func, tokenizer, config.max_completion_length), template_kwargs, []
    try:
        tools = load_tools(config.tools, given)
        factory = load_object(config.environment_factory, "environment_factory", "class", given) if config.environment_factory else None
        env_tools = environment_tools(factory()) if factory else []  # the schemas of an environment's methods, from one instance
        every_tool = tools + env_tools
    except (ValueError, OSError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc
    if every_tool:
        template_kwargs["tools"] = [t.schema for t in every_tool]
    rollouts = MultiTurn(tokenizer, template_kwargs, config.model_name_or_path, tools, factory, env_tools, config.tool_parser, config.tool_turns(),
                         config.max_completion_length, config.tool_timeout, config.max_tool_response_tokens, all_done,
                         tool_workers=config.tool_workers)  # fmt: skip
    return rollouts, template_kwargs, [t.name for t in every_tool] + [INVALID_CALL, UNKNOWN_TOOL]


def _agents(config: TrainConfig, tokenizer, template_kwargs: dict, max_len: int | None) -> AgentFunction:
    """agent_func: the user's agent, and the endpoint its sessions run on (in this process)."""
    try:
        fn = load_object(config.agent_func, "agent_func")
        serving = SessionServing(SessionStore(), tokenizer, config.model_name_or_path, config.sampling_params(), template_kwargs, config.tool_parser, max_len)
        bounds = Bounds(config.max_turns, config.max_completion_length, config.max_prompt_length, max_len)
        options = AgentOptions(config.agent_timeout, bounds, config.agent_failure, config.agent_workers, config.agent_train_rows)
        return AgentFunction(fn, config.agent_func, tokenizer, serving, options)
    except (ValueError, OSError, ImportError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc


def _producer(config: TrainConfig, dist: Dist, table, tokenizer, reward_fns, engine, rollouts: Rollouts) -> SyncProducer:
    """The rounds, from this rank's share of the prompt stream: generated when the loop asks
    (sync), or ahead of it in a background thread (async)."""
    G = config.num_generations
    sampler = GroupSampler(len(table.prompt_ids), config.completions_per_round() // G, config.seed, dist.rank, dist.world, config.shuffle_dataset)
    args = (table, sampler, engine, tokenizer, reward_fns, config.sampling_params(), G, config.seed)
    resample = {"max_resample_times": config.max_resample_times if config.dynamic_sample else None, "rollouts": rollouts,
                "steps": (config.steps_per_round(), config.max_steps)}  # fmt: skip
    last_round = math.ceil(config.max_steps / config.steps_per_round()) - 1
    ahead = {"max_staleness": config.max_staleness, "round_timeout": config.round_timeout(), "last_round": last_round}
    if config.max_tokens_per_round is not None:
        partial = PartialProducer if config.async_generate else SyncPartialProducer
        return partial(*args, **ahead, max_tokens_per_round=config.max_tokens_per_round, **resample)
    if not config.async_generate:
        return SyncProducer(*args, **resample)
    return AsyncProducer(*args, **ahead, **resample)


def _resume_logs(out: Path, dist: Dist, resume_dir: Path, state: TrainState) -> None:
    """Lines the dead run logged after its checkpoint are dropped, and a last one cut short."""
    if not dist.is_main:
        return
    for log in ("metrics.jsonl", "completions.jsonl", "eval.jsonl"):
        torn = metrics.truncate_log(out / log, state.step)
        if torn:
            print(f"tandem: warning: {torn}", file=sys.stderr, flush=True)
    print(f"tandem: resumed from {resume_dir} at step {state.step}, policy version {state.version}", flush=True)


def _schedule(config: TrainConfig, tool_names: list[str] | None) -> Schedule:
    return Schedule(
        max_steps=config.max_steps,
        num_generations=config.num_generations,
        scale_rewards=config.scale_rewards,
        num_iterations=config.num_iterations,
        steps_per_pass=config.steps_per_generation // config.gradient_accumulation_steps,
        grad_accum=config.gradient_accumulation_steps,
        micro_batch=config.per_device_train_batch_size,
        max_completion_length=config.max_completion_length,
        mask_truncated=config.mask_truncated_completions,
        token_normalizer=config.token_normalizer,
        seed=config.seed,
        save_steps=config.save_steps,
        eval_steps=config.eval_steps,
        server=config.rollout_mode == "server",
        asynchronous=config.async_generate,
        dynamic_sample=config.dynamic_sample,
        output_dir=config.output_dir,
        sigterm_timeout=config.sigterm_timeout,
        tool_names=tool_names,
        agents=config.agent_func is not None,
        partial=config.max_tokens_per_round is not None,
    )
