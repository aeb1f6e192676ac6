"""The GRPO training loop: setup, then one flat loop of labelled, timed phases.

  generate   the producer samples this round's completions (G per prompt) and scores them
  advantage  rewards of the whole world are gathered; group-relative advantages
  update     num_iterations passes over the round in steps_per_generation micro-batches,
             one optimizer step every gradient_accumulation_steps micro-batches
  sync       the rollout engine receives the new weights; the policy version moves by one
  log        metrics.jsonl, completions.jsonl, the progress bar, checkpoints
"""

import json
import math
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs, set_seed
from safetensors import SafetensorError
from tqdm.auto import tqdm

from tandem import rewards as rewards_lib
from tandem.algo import Normalisation, group_advantages, importance_weights, policy_loss
from tandem.data import GroupSampler
from tandem.rollout.client import RolloutServerError
from tandem.rollout.engine import TransformersEngine, eos_token_ids
from tandem.rollout.types import Rollout
from tandem.trainer import checkpoint, lora, metrics, sharding
from tandem.trainer.batch import PrefixSharingLM, collate, completion_logprobs
from tandem.trainer.config import TrainConfig, resume_changes
from tandem.trainer.eval import evaluate
from tandem.trainer.metrics import JsonlWriter, combine, completion_records, round_metrics, truncate_log
from tandem.trainer.producer import AsyncProducer, Round, RoundTimeout, SyncProducer, completion_seed
from tandem.trainer.servers import Servers
from tandem.trainer.setup import build_policy, load_prompts, load_tokenizer, resolve_bf16


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether the steps before..after reached a multiple of `every` (never when every is 0)."""
    return bool(every) and before // every != after // every


@dataclass
class _Scores:
    """A round's rewards and advantages over every rank, and this rank's share."""

    table: torch.Tensor  # (N, F), one column per reward function
    rewards: torch.Tensor  # (N,), weighted sum
    advantages: torch.Tensor  # (N,)
    local: torch.Tensor  # (N_rank,), this rank's advantages
    stats: dict  # detached statistics of group_advantages
    lengths: torch.Tensor  # (N,) completion lengths
    truncated: torch.Tensor  # (N,) 1 where the completion hit max_completion_length
    resampling: torch.Tensor  # (2,) dynamic sampling over every rank: groups dropped, completions generated for them


class Trainer:
    """setup -> train -> cleanup, the loop written out in `train`."""

    def __init__(self, config: TrainConfig):
        config.validate()
        config.bf16, bf16_warning = resolve_bf16(config.bf16)
        self.config = config
        set_seed(config.seed)
        # Every collective gets a finite timeout: a rank that died can never hang the others forever.
        pg_timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))
        # accelerate keeps one process-wide state and refuses another mixed precision once it is set:
        # a second run in this process (a notebook, a sweep, the tests) starts from a clean one. The
        # process group (PartialState) is kept.
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(
            mixed_precision="bf16" if config.bf16 else "no",
            kwargs_handlers=[pg_timeout],
            log_with=metrics.log_with(config.report_to),
            project_dir=config.output_dir,
            # accelerate only sets up a multi-process CPU run (gloo) under torchrun when told it is on CPU
            cpu=not torch.cuda.is_available(),
        )
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        sharding.from_accelerate_config(config)
        self.sharding = sharding.plan(config)  # None: DDP
        if self.sharding is not None and self.world == 1:
            sharding.init_single_process(self.accelerator.device)
        self.out = Path(config.output_dir)
        # Resume or a fresh run, decided before anything is written into output_dir. Resuming: the
        # weights come from the checkpoint, everything else from its state files.
        self.resume_dir = checkpoint.resolve(config.resume_from_checkpoint, config.output_dir) if config.resume_from_checkpoint else None
        state = json.loads((self.resume_dir / "trainer_state.json").read_text()) if self.resume_dir else None
        changes = []
        if state:
            checkpoint.check_resume(self.resume_dir, state, self.world, self.sharding is not None)
            changes = resume_changes(yaml.safe_load((self.resume_dir / "config.yaml").read_text()), config)
        else:
            checkpoint.check_writable(self.out)
            checkpoint.check_fresh(self.out, config.overwrite_output_dir, self.is_main)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            resolved = yaml.safe_dump(config.to_dict(), sort_keys=False)
            (self.out / "config.yaml").write_text(resolved)
            print(f"tandem: resolved config ({self.world} process(es))\n{resolved}", flush=True)
            if changes:
                print(f"tandem: resuming {self.resume_dir} with changed options: {'; '.join(changes)}", flush=True)
            for warning in config.warnings() + ([bf16_warning] if bf16_warning else []):
                print(f"tandem: warning: {warning}", file=sys.stderr, flush=True)
        if metrics.log_with(config.report_to):
            self.accelerator.init_trackers("tandem", config=metrics.hyperparameters(config.to_dict()), init_kwargs={"wandb": {"dir": str(self.out)}})

        # Cheap checks first: reward functions and the dataset fail before the model loads.
        self.reward_fns = config.load_rewards()
        self.reward_names = [fn.name for fn in self.reward_fns]
        self.tokenizer, max_len = load_tokenizer(config.model_name_or_path)
        self.table, self.skipped_prompts = load_prompts(config, self.tokenizer, max_len=max_len)
        self.eval_table = load_prompts(config, self.tokenizer, config.eval_dataset, max_len)[0] if config.eval_dataset else None
        if self.skipped_prompts and self.is_main:
            print(f"tandem: skipped {self.skipped_prompts} prompts longer than max_prompt_length={config.max_prompt_length}")

        shard = None if self.sharding is None else lambda m: sharding.shard(m, self.sharding, config.bf16, self.accelerator.device)
        model, self.ref_model, optimizer, self.scheduler = build_policy(config, self.resume_dir, self.accelerator.device, shard)
        # The trainer's forward goes through PrefixSharingLM; the engine, pushes and checkpoints use the LM inside.
        if self.sharding is None:
            self.model, self.optimizer = self.accelerator.prepare(PrefixSharingLM(model), optimizer)
        else:  # sharded already; prepare would wrap it in DDP
            self.model, self.optimizer = PrefixSharingLM(model), self.accelerator.prepare(optimizer)
        self.global_step = state["global_step"] if state else 0
        self.version = state["policy_version"] if state else 0  # rounds trained = the policy version of our weights
        self.skipped_steps = state.get("skipped_steps", 0) if state else 0  # steps not taken for a NaN or inf
        self.idle = metrics.IdleSteps(patience=10, skipped_before=self.skipped_steps)
        # The run's identity on its rollout servers (one server serves one run): a resume is the same run.
        self.run_id = state.get("run_id") if state and state.get("run_id") else uuid.uuid4().hex
        if state and self.sharding is not None:  # the weights and optimizer state of this rank's shards
            sharding.load_checkpoint(model, self.optimizer.optimizer, self.resume_dir)
        elif state:
            self.optimizer.load_state_dict(torch.load(self.resume_dir / "optimizer.pt", weights_only=True))
        if state:
            self.scheduler.load_state_dict(torch.load(self.resume_dir / "scheduler.pt", weights_only=True))

        self.servers, self.pushes = None, None
        if config.rollout_mode == "server":
            self.servers = Servers(config, len(self.tokenizer), self.world, self.is_main)
            self.pushes = sharding.Pushes(self.out, self.servers.client.bucket_bytes, self.is_main)
            policy = self._policy_weights()  # on every rank: sharded weights are gathered together
            if self.is_main:
                self.servers.start(policy, lora.base_weights(self._lm()) if config.use_peft else None, self.version, self.run_id)
            self.engine = self.servers.engine
            self.engine.version = self.version
            self.accelerator.wait_for_everyone()
        else:
            eos_ids = eos_token_ids(self.tokenizer, model.generation_config, config.model_name_or_path)
            all_done = None if self.sharding is None else lambda done: sharding.all_done(done, self.accelerator.device)
            self.engine = TransformersEngine(self._lm(), eos_ids, self.tokenizer.pad_token_id, self.version, all_done)
        G = config.num_generations
        self.sampler = GroupSampler(
            len(self.table.prompt_ids), config.completions_per_round() // G, config.seed, self.rank, self.world, config.shuffle_dataset
        )
        args = (self.table, self.sampler, self.engine, self.tokenizer, self.reward_fns, config.sampling_params(), G, config.seed)
        resample = {"max_resample_times": config.max_resample_times if config.dynamic_sample else None}
        if config.async_generate:
            last_round = math.ceil(config.max_steps / config.steps_per_round()) - 1
            self.producer = AsyncProducer(*args, max_staleness=config.max_staleness, round_timeout=config.round_timeout(), last_round=last_round, **resample)
        else:
            self.producer = SyncProducer(*args, **resample)
        ready = []
        if state:
            self.sampler.load_state_dict(state["sampler"])
            rounds_file = self.resume_dir / f"rounds_{self.rank}.json"
            ready = [Round.from_dict(d) for d in json.loads(rounds_file.read_text())] if rounds_file.exists() else []
            rng_file = self.resume_dir / f"rng_state_{self.rank}.pt"
            if rng_file.exists():
                checkpoint.set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy's state needs pickle
            if self.is_main:
                for log in ("metrics.jsonl", "completions.jsonl", "eval.jsonl"):
                    torn = truncate_log(self.out / log, self.global_step)
                    if torn:
                        print(f"tandem: warning: {torn}", file=sys.stderr, flush=True)
                print(f"tandem: resumed from {self.resume_dir} at step {self.global_step}, policy version {self.version}", flush=True)
        self._sampler_state = state["sampler"] if state else self.sampler.state_dict()  # after the last trained round
        self.producer.start(state["round"] if state else 0, ready)
        self.producer.set_live_version(self.version)
        self.metrics_log = JsonlWriter(self.out / "metrics.jsonl") if self.is_main else None
        self.completions_log = JsonlWriter(self.out / "completions.jsonl") if self.is_main else None
        self.eval_log = JsonlWriter(self.out / "eval.jsonl") if self.is_main and self.eval_table is not None else None

    def _policy_weights(self):
        """What a sync pushes: every weight, or with LoRA the adapters; called on every rank. Sharded,
        the weights are gathered and staged on disk a bucket at a time (rank 0 gets them, the other
        ranks None). The last push's staging stays: it is the client's copy for a restarted server."""
        if self.sharding is None:
            return lora.adapter_weights(self._lm()) if self.config.use_peft else list(self._lm().named_parameters())
        return self.pushes.stage(self._lm().named_parameters(), self.version)

    def _lm(self) -> torch.nn.Module:
        """The causal LM being trained, outside DDP and the prefix-sharing wrapper."""
        return self.accelerator.unwrap_model(self.model).lm

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        cfg = self.config
        bar = tqdm(total=cfg.max_steps, initial=self.global_step, desc="tandem", disable=cfg.disable_tqdm or not self.is_main, dynamic_ncols=True)
        last: dict = {}
        saved_at = self.global_step
        sigterm = _Flag(signal.SIGTERM)
        try:
            while self.global_step < cfg.max_steps:
                if self._any_rank_flagged_collective(sigterm.is_set()):
                    if saved_at != self.global_step:
                        self.save()
                        saved_at = self.global_step
                    raise Preempted(
                        f"stopped by SIGTERM after step {self.global_step} (the round in flight finished); "
                        + (f"checkpoint-{saved_at} holds it: resume with --resume_from_checkpoint latest --output_dir {cfg.output_dir}"
                           if saved_at else "no step was trained: start the run again")
                    )  # fmt: skip
                before = self.global_step
                last = self._train_round(bar) or last
                if self.eval_table is not None and (self.global_step >= cfg.max_steps or _crossed(before, self.global_step, cfg.eval_steps)):
                    self._evaluate()
                if _crossed(before, self.global_step, cfg.save_steps):
                    self.save()  # at the end of the round that crossed a multiple of save_steps
                    saved_at = self.global_step
        except (RolloutServerError, RoundTimeout) as exc:
            raise type(exc)(f"{exc}\n{self._after_failure(exc, saved_at)}") from None
        finally:
            sigterm.restore()
            bar.close()
        if saved_at != self.global_step:
            self.save()
        if last and self.is_main and (nothing := self.idle.at_end(last)):
            print(f"tandem: WARNING: {nothing}", file=sys.stderr, flush=True)
        return last

    def _any_rank_flagged_collective(self, flagged: bool) -> bool:
        """Whether any rank's flag is up (a SIGTERM reached it): a collective at the top of every
        round, so that every rank stops at the same round, together."""
        if self.world == 1:
            return flagged
        return bool(self.accelerator.reduce(torch.tensor([float(flagged)], device=self.accelerator.device), reduction="sum").item())

    def _check_idle(self, message: str | None) -> None:
        """Steps in a row that trained nothing: a loud warning, or with on_nonfinite error the
        end of the run (every rank decides alike: the record is reduced over them)."""
        if message is None:
            return
        if self.config.on_nonfinite == "error":
            raise NonFiniteStepError(f"step {self.global_step}: {message}; stopping (on_nonfinite: error)")
        if self.is_main:
            print(f"tandem: WARNING: step {self.global_step}: {message}", file=sys.stderr, flush=True)

    def _evaluate(self) -> None:
        """eval/* on the held-out prompts, by rank 0 (every rank with a sharded colocated engine)
        with the weights live now (between rounds)."""
        cfg = self.config
        # A sharded colocated engine generates on every rank together (each forward is a collective).
        if self.is_main or (self.sharding is not None and self.servers is None):
            with self.accelerator.autocast():
                results = evaluate(self.engine, self.tokenizer, self.eval_table, self.reward_fns, cfg.sampling_params(), cfg.eval_num_generations,
                                   cfg.eval_greedy, cfg.seed, cfg.eval_pass_threshold, min_version=self.version)  # fmt: skip
        if self.is_main:
            self.eval_log.write({"step": self.global_step, **results})
            self.accelerator.log(results, step=self.global_step)
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in results.items() if k == "eval/reward" or k.startswith("eval/pass@"))
            print(f"tandem: step {self.global_step} eval on {len(self.eval_table.prompt_ids)} prompts: {shown}", flush=True)
        self.accelerator.wait_for_everyone()

    def _after_failure(self, exc: Exception, saved_at: int) -> str:
        """What a run stopped by a server or by a round that never came keeps, and what to do. We
        are between rounds: one process saves what it trained since its last checkpoint (with
        several, the others may be anywhere, so the last periodic checkpoint stands)."""
        if getattr(exc, "unreachable", False):
            fix = "restart the rollout server"
        elif isinstance(exc, RoundTimeout):
            fix = "find what held the round up"
        else:
            fix = "fix what the message above names"
        kept = "the last checkpoint is"
        if self.world == 1 and self.global_step > saved_at:
            self.save()
            saved_at, kept = self.global_step, "checkpoint saved"
        if saved_at == 0:
            return f"tandem: no step was trained; {fix}, then start the run again"
        return f"tandem: {kept} at step {saved_at}; {fix}, then resume with --resume_from_checkpoint latest --output_dir {self.config.output_dir}"

    def _train_round(self, bar) -> dict:
        """One round: generate, advantage, update (one or more optimizer steps), sync, log."""
        cfg = self.config
        steps = cfg.steps_per_generation // cfg.gradient_accumulation_steps  # optimizer steps per pass
        # The proximal policy is the weights at the round's start. With one optimizer step per round
        # those are the weights of every forward in the round, so its log-probs are the current
        # ones, detached; only when the policy moves within the round are they recomputed first.
        need_proximal = cfg.steps_per_round() > 1
        # Behaviour log-probs from a rollout server come from other numerics than this forward
        # (another process, dtype or kernel) and, in async mode, from older weights: correct for
        # both, as TRL corrects vLLM's even when generation is synchronous. A colocated engine
        # samples from the trainer's own forward, so its rollouts are on-policy.
        off_policy = cfg.rollout_mode == "server"
        round_start = time.perf_counter()

        # --- generate (and score) ---
        # A colocated engine runs here, in the trainer's thread: under the same autocast as the
        # training forward (bf16), so the behaviour log-probs come from the same numerics.
        with self.accelerator.autocast():
            rnd = self.producer.next_round()
        rollouts = rnd.rollouts  # (N_rank,)

        # --- advantage: group statistics over the rewards of every rank ---
        scores = self._advantages(rnd)
        C = max(1, max(len(r.completion_ids) for r in rollouts))
        old_logps = _pad_rows(self._logprobs_no_grad(self.model, rollouts), C) if need_proximal else None  # (N_rank, C)
        ref_logps = _pad_rows(self._reference_logprobs(rollouts), C) if cfg.beta != 0.0 else None
        behav_logps = _pad_rows([torch.tensor(r.behav_logprobs) for r in rollouts], C) if off_policy else None  # (N_rank, C)
        staleness = self._staleness(rollouts) if cfg.async_generate else {}

        # --- update ---
        orders = [self._order(len(rollouts), rnd.index, it) for it in range(cfg.num_iterations)]  # micro-batch order per pass
        step_tokens = self._step_tokens(rollouts, orders)  # (num_iterations, steps)
        record: dict = {}
        for it, order in enumerate(orders):
            for opt_step in range(steps):
                t_train = time.perf_counter()
                batches = self._micro_batches(order, opt_step)
                norm = Normalisation(
                    max_completion_length=cfg.max_completion_length,
                    grad_accum=len(batches),
                    step_tokens=float(step_tokens[it, opt_step]),
                    world_size=self.world,
                )
                stats: dict[str, list] = {}
                loss_sum = torch.zeros(())
                for m, idx in enumerate(batches):
                    loss, mstats = self._micro_step(rollouts, idx, scores.local, old_logps, ref_logps, behav_logps, norm, sync=m == len(batches) - 1)
                    loss_sum += loss
                    for k, v in mstats.items():
                        stats.setdefault(k, []).append(v)
                grad_norm = self._optimizer_step(loss_sum)
                self.global_step += 1
                first = it == 0 and opt_step == 0
                final = (it == cfg.num_iterations - 1 and opt_step == steps - 1) or self.global_step >= cfg.max_steps
                if final:
                    self._sampler_state = rnd.sampler_state  # this round is trained: a checkpoint continues after it
                # --- sync weights ---
                # The step is taken whatever happens to the push. Alone, a failed push is raised
                # after the step's metrics are logged, so the emergency checkpoint leaves no gap in
                # them. With several processes it is raised at once: the others may be waiting in
                # the sync's barrier, and logging would start a different collective (a deadlock).
                sync_error, sync_seconds = None, 0.0
                if final:
                    try:
                        sync_seconds = self._sync_weights(rnd.index)
                    except RolloutServerError as exc:
                        if self.world > 1:
                            raise
                        sync_error, sync_seconds = exc, float("nan")
                # --- log ---
                record = self._step_record(rnd, scores, loss_sum, grad_norm, stats, time.perf_counter() - round_start, first)
                record.update(staleness)
                record["time/train"] = time.perf_counter() - t_train - sync_seconds
                record["time/weight_sync"] = sync_seconds
                self._log(record, bar)
                self._check_idle(self.idle.after_step(record))
                if first:
                    self._log_completions(rnd, scores.rewards, scores.advantages)
                if sync_error is not None:
                    raise sync_error
                if self.global_step >= cfg.max_steps:
                    return record
        return record

    def _advantages(self, rnd: Round) -> "_Scores":
        """Rewards gathered from every rank, group-relative advantages, and this rank's share."""
        rollouts, n = rnd.rollouts, len(rnd.rollouts)
        rewards = rewards_lib.combine(rnd.rewards, [r.weight for r in self.reward_fns])  # (N_rank,)
        all_rewards = self._gather(rewards)  # (N,)
        advantages, stats = group_advantages(all_rewards, self.config.num_generations, self.config.scale_rewards)  # (N,)
        return _Scores(
            table=self._gather(rnd.rewards),  # (N, F)
            rewards=all_rewards,
            advantages=advantages,
            local=advantages[self.rank * n : (self.rank + 1) * n],  # (N_rank,)
            stats=stats,
            lengths=self._gather(torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float)),  # (N,)
            truncated=self._gather(torch.tensor([r.truncated for r in rollouts], dtype=torch.float)),  # (N,)
            resampling=self._gather(torch.tensor([rnd.dropped_groups, rnd.resampled_completions])).view(-1, 2).sum(0),  # (2,)
        )

    def _micro_batches(self, order: list[int], opt_step: int) -> list[list[int]]:
        """Indices of the gradient_accumulation_steps micro-batches of one optimizer step."""
        size, GA = self.config.per_device_train_batch_size, self.config.gradient_accumulation_steps
        return [order[(opt_step * GA + m) * size : (opt_step * GA + m + 1) * size] for m in range(GA)]

    def _step_record(self, rnd: Round, scores: "_Scores", loss_sum, grad_norm, stats: dict, round_seconds: float, first: bool) -> dict:
        """One metrics.jsonl line: the step's loss and statistics over every rank, and the round's."""
        record = {
            "step": self.global_step,
            "timestamp": time.time(),
            "round": rnd.index,
            "policy_version": self.version,
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "skipped_steps": self.skipped_steps,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "memory/peak_gb/max": torch.tensor(metrics.peak_memory_gb()),  # the process that peaked highest
            **{k: combine(k, torch.stack(v)) for k, v in stats.items()},
        }
        record = self._reduce_across_ranks(record)
        record.setdefault("kl", None)  # no reference model when beta = 0
        record.update(round_metrics(rnd, self.reward_names, scores.table, scores.rewards, scores.stats, scores.lengths, scores.truncated, round_seconds, first))
        record["prompts_skipped"] = self.skipped_prompts
        if self.config.dynamic_sample:  # on the round's first step, like its generate time
            dropped, resampled = scores.resampling.tolist() if first else (0, 0)
            record.update({"dynamic_sample/dropped_groups": dropped, "dynamic_sample/resampled_completions": resampled})
        return record

    # ------------------------------------------------------------------ phases

    def _micro_step(self, rollouts, idx, advantages, old_logps, ref_logps, behav_logps, norm: Normalisation, sync: bool):
        """Forward and backward of one micro-batch; gradients are all-reduced on the last one only."""
        cfg = self.config
        lockstep = self.sharding is not None
        mb = collate([rollouts[i] for i in idx], self.tokenizer.pad_token_id, self.accelerator.device, cfg.mask_truncated_completions, lockstep=lockstep)
        C = mb.completion_ids.shape[1]
        # Toggle DDP's gradient sync instead of entering no_sync(): the same effect without a context
        # manager around the forward (nanoGPT does the same with require_backward_grad_sync).
        if hasattr(self.model, "require_backward_grad_sync"):
            self.model.require_backward_grad_sync = sync
        elif lockstep:
            self._lm().set_requires_gradient_sync(sync)
        logps, entropy = completion_logprobs(self.model, mb, cfg.temperature, with_entropy=True)  # (n, C)
        rows = lambda t: t[idx, :C].to(logps.device) if t is not None else None  # noqa: E731 - (N_rank, C') -> (n, C)
        old = rows(old_logps) if old_logps is not None else logps.detach()
        ref = rows(ref_logps)
        is_weights, is_metrics = None, {}
        if behav_logps is not None:
            is_weights, is_metrics = importance_weights(
                old, rows(behav_logps), mb.completion_mask, cfg.off_policy_correction,
                clip_max=cfg.importance_sampling_cap, clip_min=cfg.importance_sampling_clip_min,
            )  # fmt: skip
        loss, stats = policy_loss(
            logps,
            old,
            advantages[idx].to(logps.device),
            mb.completion_mask,
            loss_type=cfg.loss_type,
            norm=norm,
            epsilon_low=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            delta=cfg.delta,
            importance_sampling_level=cfg.importance_sampling_level,
            beta=cfg.beta,
            ref_logprobs=ref,
            is_weights=is_weights,
        )
        stats.update(is_metrics)
        self.accelerator.backward(loss)
        mask = mb.completion_mask
        stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
        return loss.detach(), stats

    def _optimizer_step(self, loss: torch.Tensor) -> torch.Tensor:
        """Clip and step. A step whose loss or gradient norm is NaN or inf on any rank never
        updates the weights: it is skipped (counted in skipped_steps) or raised, per on_nonfinite.
        The scheduler moves on either way, so the learning rate stays a function of the step."""
        cfg = self.config
        if cfg.max_grad_norm > 0:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        grad_norm = sharding.full_value(grad_norm)  # sharded gradients have a sharded norm
        bad = (~torch.isfinite(loss.float()) | ~torch.isfinite(grad_norm.float())).float()
        if self.world > 1:  # the losses differ between ranks: decide together, or one rank would step alone
            bad = self.accelerator.reduce(bad.to(self.accelerator.device), reduction="sum").cpu()
        if bad.item() > 0:
            if cfg.on_nonfinite == "error":
                raise NonFiniteStepError(
                    f"step {self.global_step + 1}: loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g} on this "
                    "process, not finite on at least one process; the weights were not updated. Check the reward "
                    "scale and learning_rate, or set on_nonfinite: skip to skip such steps"
                )
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _sync_weights(self, trained_round: int) -> float:
        """The engine gets the new weights and the version moves by one. Colocated, the engine
        already runs on the trainer's parameters; in server mode rank 0 pushes them to every
        server and the other ranks only advance their version gate.

        Async: round trained_round + max_staleness must be generated, on every rank, with the
        version live now; so the push waits for it (it runs in parallel with the training just
        done, so this wait is usually zero)."""
        t = time.perf_counter()
        self.version += 1
        if self.config.async_generate and self.global_step < self.config.max_steps:
            self.producer.wait_generated(trained_round + self.config.max_staleness)
            if self.world > 1:
                self.accelerator.wait_for_everyone()
        if self.servers is not None:
            policy = self._policy_weights()  # on every rank: sharded weights are gathered together
            if self.is_main:
                self.servers.push(policy, self.version)
        self.engine.version = self.version
        self.producer.set_live_version(self.version)
        return time.perf_counter() - t

    def _reference_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs of the reference model: with LoRA, the policy with its adapters disabled."""
        if self.ref_model is not None:
            return self._logprobs_no_grad(self.ref_model, rollouts)
        with self._lm().disable_adapter():
            return self._logprobs_no_grad(self.model, rollouts)

    @torch.no_grad()
    def _logprobs_no_grad(self, model, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs without gradient (proximal or reference policy), under the training forward's
        autocast: the reference model is not prepared by accelerate, and a reference in fp32
        against a bf16 policy would make KL(current || ref) non-zero at step 0."""
        out = []
        size = self.config.per_device_train_batch_size
        for lo in range(0, len(rollouts), size):
            chunk = rollouts[lo : lo + size]
            mb = collate(chunk, self.tokenizer.pad_token_id, self.accelerator.device, False, lockstep=self.sharding is not None)
            with self.accelerator.autocast():
                logps, _ = completion_logprobs(model, mb, self.config.temperature)  # (n, C)
            out += [logps[i, : len(r.completion_ids)].cpu() for i, r in enumerate(chunk)]
        return out

    def _staleness(self, rollouts: list[Rollout]) -> dict:
        """How many versions behind the trainer each rollout's weights are, over every rank."""
        staleness = self._gather(torch.tensor([float(self.engine.version - r.version) for r in rollouts]))  # (N,)
        return {"staleness/mean": staleness.mean().item(), "staleness/max": staleness.max().item()}

    def _order(self, n: int, round_index: int, iteration: int) -> list[int]:
        """Seeded shuffle of a round's sequences before they are cut into micro-batches."""
        g = torch.Generator().manual_seed(completion_seed(self.config.seed, round_index, -1, iteration) & 0xFFFF_FFFF)
        return torch.randperm(n, generator=g).tolist()

    def _step_tokens(self, rollouts: list[Rollout], orders: list[list[int]]) -> torch.Tensor:
        """Completion tokens in each optimizer step of the round, summed over ranks (for dapo)."""
        cfg = self.config
        steps = cfg.steps_per_generation // cfg.gradient_accumulation_steps
        counts = torch.zeros((cfg.num_iterations, steps))
        for it, order in enumerate(orders):
            for s in range(steps):
                idx = [i for batch in self._micro_batches(order, s) for i in batch]  # the step's sequences, as trained
                keep = [r for r in (rollouts[i] for i in idx) if r.in_loss(cfg.mask_truncated_completions)]
                counts[it, s] = sum(len(r.completion_ids) for r in keep)
        if self.world > 1:
            counts = self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").cpu()
        return counts

    # ------------------------------------------------------------------ distribution helpers

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def _reduce_across_ranks(self, record: dict) -> dict:
        """Tensor metrics to plain numbers over every rank: min of */min, max of */max, else mean."""
        keys = [k for k, v in record.items() if isinstance(v, torch.Tensor)]
        values = torch.stack([record[k].detach().float().cpu().reshape(()) for k in keys])  # (K,)
        if self.world > 1:
            every = self._gather(values.unsqueeze(0))  # (world, K)
            values = torch.stack([combine(k, every[:, j]) for j, k in enumerate(keys)])
        return {**record, **dict(zip(keys, values.tolist()))}

    # ------------------------------------------------------------------ logging and saving

    def _log(self, record: dict, bar) -> None:
        if not self.is_main:
            return
        self.metrics_log.write(record)
        self.accelerator.log(metrics.scalars(record), step=record["step"])
        bar.update(1)
        bar.set_postfix(reward=f"{record['reward']:.3f}", tok_s=f"{record['completion_tokens_per_second']:.0f}", loss=f"{record['loss']:.4f}")

    def _log_completions(self, rnd, all_rewards, advantages_all) -> None:
        if self.is_main and self.config.num_completions_to_log:
            lines = completion_records(rnd, self.tokenizer, self.reward_names, all_rewards, advantages_all, self.global_step, self.config.num_completions_to_log)
            for line in lines:
                self.completions_log.write(line)
            metrics.log_completions(self.accelerator, lines, self.global_step)

    def save(self) -> Path | None:
        """A checkpoint every rank contributes to (its RNG state and the rounds it generated
        ahead); rank 0 writes the rest and moves `latest`. Called between rounds only. A write
        that fails (a full disk) leaves no staging folder and `latest` where it was."""
        try:
            return self._save()
        except (OSError, SafetensorError) as exc:
            checkpoint.abandon(self.out, self.global_step)
            raise checkpoint.CheckpointError(
                f"could not write checkpoint-{self.global_step} in {self.out} ({type(exc).__name__}: {exc}); "
                f"{checkpoint.where_to_resume(self.out)}. Free some space there, then resume with --resume_from_checkpoint latest"
            ) from None

    def _save(self) -> Path | None:
        step, acc = self.global_step, self.accelerator
        acc.wait_for_everyone()
        if self.is_main:
            checkpoint.start(self.out, step)
        acc.wait_for_everyone()
        tmp = checkpoint.staging_dir(self.out, step)
        # Rounds generated ahead (async) are saved, not regenerated: they were made with weights
        # this checkpoint does not hold. Every rank keeps the same number so the sampler agrees.
        ahead = self.producer.pending()
        keep = len(ahead)
        if self.world > 1:
            keep = int(self._gather(torch.tensor([keep])).min())
        ahead = ahead[:keep]
        torch.save(checkpoint.rng_state(), tmp / f"rng_state_{self.rank}.pt")
        (tmp / f"rounds_{self.rank}.json").write_text(json.dumps([r.to_dict() for r in ahead]))
        if self.sharding is not None:  # every rank writes its shards; rank 0 the model's config
            sharding.save_checkpoint(self._lm(), self.optimizer.optimizer, tmp)
        acc.wait_for_everyone()
        path = None
        if self.is_main:
            if self.sharding is None:
                self._lm().save_pretrained(tmp)
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            else:  # the weights are in sharded/: the model's config says what they fill
                self._lm().config.save_pretrained(tmp)
                self._lm().generation_config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "config.yaml").write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
            state = {
                "global_step": step,
                "skipped_steps": self.skipped_steps,
                "policy_version": self.version,
                "round": self.producer.round_index,  # the next round to train
                "rounds_ahead": keep,
                "world_size": self.world,
                "sharded": self.sharding is not None,
                "run_id": self.run_id,
                "sampler": ahead[-1].sampler_state if ahead else self._sampler_state,
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            path = checkpoint.finish(self.out, step, self.config.save_total_limit)
        acc.wait_for_everyone()
        return path

    def close(self, ok: bool = True) -> None:
        """After a failure the process group is left alone: destroying it could wait on a rank
        that is stuck in a collective; the launcher ends the other ranks when this one exits."""
        self.producer.close(ok)
        rewards_lib.close_rewards(self.reward_fns)
        if self.servers is not None:
            self.servers.close()
            self.pushes.close()
        for w in (self.metrics_log, self.completions_log, self.eval_log):
            if w is not None:
                w.close()
        if ok:
            self.accelerator.end_training()


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm was NaN or inf and on_nonfinite is 'error'."""


class Preempted(RuntimeError):
    """The run stopped on SIGTERM (a scheduler preempting the job), with a checkpoint of what it trained."""


class _Flag:
    """A signal that raises a flag instead of ending the process, from construction until
    restore() (in the main thread only: Python runs handlers there)."""

    def __init__(self, signum: int):
        self.signum, self._event, self._old = signum, threading.Event(), None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signum, lambda *_: self._event.set())

    def is_set(self) -> bool:
        return self._event.is_set()

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(self.signum, self._old)


def train(config: TrainConfig) -> dict:
    trainer = Trainer(config)
    try:
        result = trainer.train()
    except BaseException:
        trainer.close(ok=False)
        raise
    trainer.close()
    return result
