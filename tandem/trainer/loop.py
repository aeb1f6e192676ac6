"""The GRPO training loop: one flat loop over rounds, each in labelled, timed phases.

  generate   the producer hands this round's scored completions (G per prompt)
  prepare    advantages over every rank's rewards; proximal, reference and behaviour log-probs
  update     num_iterations passes over the round, one optimizer step per grad_accum micro-batches
  publish    the round's weights become the engine's: the policy version moves by one
  log        metrics.jsonl, completions.jsonl, trackers, the progress bar
  evaluate, save   at the end of the rounds that cross eval_steps and save_steps

Everything it uses is built once, from the config, by tandem.trainer.build; the loop branches on
neither the mode nor the distribution. Functions named *_collective run collectives: every rank
calls them in the same order (TANDEM_TRACE_COLLECTIVES records the sequence; a test compares).
"""

import itertools
import signal
import sys
import time
from dataclasses import dataclass

import torch

from tandem import rewards as rewards_lib
from tandem.algo import Normalisation, group_advantages, step_token_normalizers
from tandem.rollout.types import Rollout
from tandem.trainer import metrics
from tandem.trainer.build import Run, build
from tandem.trainer.config import TrainConfig
from tandem.trainer.learner import NonFiniteStepError
from tandem.trainer.metrics import AgentFailures, IdleSteps, combine, completion_records, round_metrics
from tandem.trainer.producer import Round, completion_seed
from tandem.trainer.stops import FAILURES, AgentsFailing, Flag, OtherRankFailed, Preempted, after_failure, preempted, together_collective

__all__ = ["NonFiniteStepError", "Preempted", "train"]


@dataclass
class Prepared:
    """A round ready to train: everything its steps read, over every rank where it says so."""

    rollouts: list[Rollout]  # this rank's (N_rank,)
    rows: list[Rollout]  # what trains: each rollout's rows (Rollout.rows), in order (N_rows,)
    spans: list[range]  # of each rollout, its rows' indices in `rows`
    table: torch.Tensor  # (N, F) rewards of every rank, one column per function
    rewards: torch.Tensor  # (N,) weighted sums
    advantages: torch.Tensor  # (N,)
    local: torch.Tensor  # (N_rows,) this rank's advantages, of each row its rollout's
    adv_stats: dict  # detached statistics of group_advantages
    lengths: torch.Tensor  # (N,) completion lengths
    truncated: torch.Tensor  # (N,) 1 where a completion hit max_completion_length
    resampling: torch.Tensor  # (2,) dynamic sampling over every rank: groups dropped, completions generated for them
    old_logps: torch.Tensor | None  # (N_rows, C) proximal policy, when the policy moves within the round
    ref_logps: torch.Tensor | None  # (N_rows, C) reference policy, with a KL term
    behav_logps: torch.Tensor | None  # (N_rows, C) behaviour policy, from a rollout server
    staleness: dict  # versions behind, over every rank (async)
    orders: list[list[int]]  # per pass, the seeded order its micro-batches take the sequences in
    step_tokens: torch.Tensor  # (num_iterations, steps_per_pass) dapo's divisor of each step: its loss tokens over every rank, or their round's mean
    reward_metrics: dict  # what reward functions gave log_metric, over every rank

    def micro_batch(self, idx: list[int]) -> tuple[list[int], torch.Tensor]:
        """The rows of the rollouts `idx` and, of each, which of them it belongs to (the reduction's sequence)."""
        rows = [j for i in idx for j in self.spans[i]]
        return rows, torch.tensor([k for k, i in enumerate(idx) for _ in self.spans[i]], dtype=torch.long)


def train(config: TrainConfig) -> dict:
    run = build(config)
    try:
        result = run_loop(run)
    except BaseException:
        run.close(ok=False)
        raise
    run.close()
    return result


def run_loop(run: Run) -> dict:
    """setup is done (build); this is the loop: rounds until max_steps, with evaluation and
    checkpoints at the rounds that cross eval_steps and save_steps; a SIGTERM or a failed server
    stops it between rounds, with a checkpoint where one helps."""
    s, state = run.schedule, run.state
    run.log.start(state.step)
    idle = IdleSteps(patience=10, skipped_before=state.skipped_steps)
    agents = AgentFailures(patience=10) if s.agents else None
    last: dict = {}
    saved_at = state.step
    sigterm = Flag(signal.SIGTERM, s.sigterm_timeout, s.output_dir)
    try:
        while state.step < s.max_steps:
            sigterm_set, stop_asked = run.dist.sum_collective(torch.tensor([float(sigterm.is_set()), float(run.log.stop_asked)]), "SIGTERM and stop flags").tolist()
            if sigterm_set:
                raise Preempted(preempted(run, saved_at))
            if stop_asked:  # a listener (a callback's should_training_stop) on any rank: the run ends here, saved
                break
            before = state.step
            last = train_round(run, idle, agents) or last
            if run.evaluator is not None and (state.step >= s.max_steps or _crossed(before, state.step, s.eval_steps)):
                results = run.evaluator.run_collective(state.version)
                if results is not None:
                    run.log.evaluation(state.step, results, run.evaluator.prompts)
            if _crossed(before, state.step, s.save_steps):
                _save_collective(run)  # at the end of the round that crossed a multiple of save_steps
                saved_at = state.step
    except FAILURES as exc:
        advice = after_failure(run, exc, saved_at)
        if not run.dist.is_main:  # process 0 says what failed, what was kept and what to do; the others one line each
            raise OtherRankFailed(f"process {run.dist.rank} stopped with the run: {str(exc).splitlines()[0]}") from None
        raise type(exc)(f"{exc}\n{advice}") from None
    finally:
        sigterm.restore()
        run.log.close_bar()
    if saved_at != state.step:
        _save_collective(run)
    if last and run.dist.is_main and (nothing := idle.at_end(last)):
        print(f"tandem: WARNING: {nothing}", file=sys.stderr, flush=True)
    return last


def _save_collective(run: Run) -> None:
    run.checkpointer.save_collective(run.state)
    run.log.saved(run.state.step)


def train_round(run: Run, idle: IdleSteps, agents: AgentFailures | None) -> dict:
    """One round: generate, prepare, then its optimizer steps, each logged; the round's weights
    are published after its last step."""
    s, state, learner = run.schedule, run.state, run.learner
    round_start = time.perf_counter()
    # --- generate (and score) ---
    # A colocated engine runs here, in the trainer's thread: under the same autocast as the
    # training forward (bf16), so the behaviour log-probs come from the same numerics.
    with run.dist.accelerator.autocast():
        rnd = together_collective(run.dist, "round", run.producer.next_round)
    # --- prepare ---
    batch = prepare_collective(run, rnd)
    # --- update ---
    record: dict = {}
    for it, order in enumerate(batch.orders):
        for opt_step in range(s.steps_per_pass):
            t_train = time.perf_counter()
            run.log.step_begin()
            micro = _micro_batches(s, order, opt_step)
            norm = Normalisation(max_completion_length=s.max_completion_length, grad_accum=len(micro),
                                 step_tokens=float(batch.step_tokens[it, opt_step]), world_size=run.dist.world)  # fmt: skip
            stats: dict[str, list] = {}
            loss_sum = torch.zeros(())
            for m, idx in enumerate(micro):
                rows, sequences = batch.micro_batch(idx)
                loss, mstats = learner.micro_step_collective(batch.rows, rows, sequences, batch.local, batch.old_logps, batch.ref_logps, batch.behav_logps,
                                                             norm, sync=m == len(micro) - 1)  # fmt: skip
                loss_sum += loss
                for k, v in mstats.items():
                    stats.setdefault(k, []).append(v)
            grad_norm, skipped = learner.optimizer_step_collective(loss_sum, state.step + 1)
            state.after_step(skipped)
            first = it == 0 and opt_step == 0
            final = (it == s.num_iterations - 1 and opt_step == s.steps_per_pass - 1) or state.step >= s.max_steps
            # --- publish ---
            # The step is taken whatever happens to the push. A failed push (or round ahead) is
            # raised on every rank together, after the step's metrics are logged, so the
            # checkpoint saved then leaves no gap in them.
            publish_error, publish_seconds = None, 0.0
            if final:
                state.after_round(rnd.index, rnd.sampler_state)
                try:
                    publish_seconds = run.sync.publish_collective(state.version, rnd.index, state.step)
                except FAILURES as exc:
                    publish_error, publish_seconds = exc, float("nan")
            # --- log ---
            record = step_record_collective(run, rnd, batch, loss_sum, grad_norm, stats, time.perf_counter() - round_start, first)
            record["time/train"] = time.perf_counter() - t_train - publish_seconds
            record["time/weight_sync"] = publish_seconds
            if run.servers is not None and run.dist.is_main:
                record.update(run.servers.metrics() | ({} if final else {"weights/push_mb": 0.0}))
            run.log.step(record)
            _check_idle(run, idle.after_step(record))
            if first:
                run.log.sample(lambda n: completion_records(rnd, run.tokenizer, [f.name for f in run.reward_fns], batch.rewards,
                                                            batch.advantages, state.step, n), state.step)  # fmt: skip
            if publish_error is not None:
                raise publish_error
            if agents is not None and (failing := agents.after_step(record, rnd, state.step >= s.max_steps)):
                raise AgentsFailing(f"step {state.step}: {failing}")
            if state.step >= s.max_steps:
                return record
    return record


def prepare_collective(run: Run, rnd: Round) -> Prepared:
    """Advantages from every rank's rewards (gathered), the log-probs the loss needs besides the
    current ones, and each step's token count over every rank (for dapo's normaliser). What
    trains is the rollouts' rows: several of an agent's trajectory, one of every other rollout."""
    s, learner, dist = run.schedule, run.learner, run.dist
    rollouts, n = rnd.rollouts, len(rnd.rollouts)
    rewards = rewards_lib.combine(rnd.rewards, [r.weight for r in run.reward_fns])  # (N_rank,)
    all_rewards = dist.gather_collective(rewards, "rewards")  # (N,)
    advantages, adv_stats = group_advantages(all_rewards, s.num_generations, s.scale_rewards)  # (N,)
    table = dist.gather_collective(rnd.rewards, "reward table")  # (N, F)
    lengths = dist.gather_collective(torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float), "lengths")  # (N,)
    truncated = dist.gather_collective(torch.tensor([r.truncated for r in rollouts], dtype=torch.float), "truncation")  # (N,)
    resampling = dist.gather_collective(torch.tensor([rnd.dropped_groups, rnd.resampled_completions]), "resampling").view(-1, 2).sum(0)  # (2,)
    per = [r.rows() for r in rollouts]
    rows, starts = [row for p in per for row in p], [0, *itertools.accumulate(len(p) for p in per)]
    spans = [range(a, b) for a, b in zip(starts, starts[1:])]
    C = max(1, max(len(r.completion_ids) for r in rows))
    # The proximal policy is the weights at the round's start. With one optimizer step per round
    # those are the weights of every forward in the round, so its log-probs are the current
    # ones, detached; only when the policy moves within the round are they recomputed first.
    moves = s.num_iterations * s.steps_per_pass > 1
    old_logps = _pad_rows(learner.proximal_logprobs(rollouts), C) if moves else None  # (N_rows, C)
    ref_logps = _pad_rows(learner.reference_logprobs(rollouts), C) if learner.loss.beta != 0.0 else None  # (N_rows, C)
    # Behaviour log-probs from a rollout server come from other numerics than this forward
    # (another process, dtype or kernel) and, in async mode, from older weights: correct for
    # both, as TRL corrects vLLM's even when generation is synchronous. A colocated engine
    # samples from the trainer's own forward, so its rollouts are on-policy, except with partial
    # rollouts, whose tokens are of older versions in every mode.
    behav_logps = _pad_rows([torch.tensor(r.behav_logprobs) for r in rows], C) if s.server or s.partial else None  # (N_rows, C)
    staleness = {}
    if s.asynchronous or s.partial:
        # Of each completion's oldest token; with partial rollouts also how many versions its tokens span.
        ages = torch.tensor([[float(run.sync.engine.version - r.version), float(r.newest_version - r.version)] for r in rollouts])  # (N_rank, 2)
        ages = dist.gather_collective(ages, "staleness")  # (N, 2)
        staleness = {"staleness/mean": ages[:, 0].mean().item(), "staleness/max": ages[:, 0].max().item()}
        if s.partial:
            staleness.update({"partial_rollouts/version_spread": ages[:, 1].mean().item(),
                              "partial_rollouts/crossed_update": (ages[:, 1] > 0).float().mean().item()})  # fmt: skip
    orders = [_order(s.seed, n, rnd.index, it) for it in range(s.num_iterations)]
    step_tokens = step_token_normalizers(dist.sum_collective(loss_tokens(s, orders, rows, spans), "step tokens"), s.token_normalizer)
    local = advantages[dist.rank * n : (dist.rank + 1) * n][torch.tensor([i for i, span in enumerate(spans) for _ in span], dtype=torch.long)]  # (N_rows,)
    return Prepared(rollouts, rows, spans, table, all_rewards, advantages, local, adv_stats, lengths, truncated, resampling, old_logps,
                    ref_logps, behav_logps, staleness, orders, step_tokens, metrics.reward_metrics_collective(dist, rnd.reward_metrics))  # fmt: skip


def loss_tokens(s, orders: list[list[int]], rows: list[Rollout], spans: list[range]) -> torch.Tensor:
    """(num_iterations, steps_per_pass) this rank's loss tokens of each step: of every row of its
    rollouts (`spans`: each rollout's rows), as the steps take them in `orders`."""
    counts = torch.zeros((len(orders), s.steps_per_pass))
    for it, order in enumerate(orders):
        for step in range(s.steps_per_pass):
            idx = [j for mb in _micro_batches(s, order, step) for i in mb for j in spans[i]]  # the step's rows, as trained
            counts[it, step] = sum(rows[j].model_tokens for j in idx if rows[j].in_loss(s.mask_truncated))
    return counts


def step_record_collective(run: Run, rnd: Round, batch: Prepared, loss_sum, grad_norm, stats: dict, round_seconds: float, first: bool) -> dict:
    """One metrics.jsonl line: the step's loss and statistics over every rank (gathered: min of
    */min, max of */max, else the mean), and the round's."""
    state, dist = run.state, run.dist
    record = {
        "step": state.step,
        "timestamp": time.time(),
        "round": rnd.index,
        "policy_version": state.version,
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "skipped_steps": state.skipped_steps,
        "learning_rate": run.learner.step_lr,
        "memory/peak_gb/max": torch.tensor(metrics.peak_memory_gb()),  # the process that peaked highest
        **{k: combine(k, torch.stack(v)) for k, v in stats.items()},
    }
    keys = [k for k, v in record.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([record[k].detach().float().cpu().reshape(()) for k in keys])  # (K,)
    if dist.world > 1:
        every = dist.gather_collective(values.unsqueeze(0), "step statistics")  # (world, K)
        values = torch.stack([combine(k, every[:, j]) for j, k in enumerate(keys)])
    record = {**record, **dict(zip(keys, values.tolist()))}
    record.setdefault("kl", None)  # no reference model when beta = 0
    names = [f.name for f in run.reward_fns]
    record.update(round_metrics(rnd, names, batch.table, batch.rewards, batch.adv_stats, batch.lengths, batch.truncated, round_seconds, first))
    record.update({k: v for k, v in batch.reward_metrics.items() if k not in record})  # log_metric's, beside (never over) tandem's own
    record["prompts_skipped"] = run.skipped_prompts
    if run.schedule.dynamic_sample:  # on the round's first step, like its generate time
        dropped, resampled = batch.resampling.tolist() if first else (0, 0)
        record.update({"dynamic_sample/dropped_groups": dropped, "dynamic_sample/resampled_completions": resampled})
    record.update(batch.staleness)
    if run.schedule.tool_names is not None:  # a multi-turn run
        totals, longest = metrics.turn_counts(rnd.rollouts, run.schedule.tool_names)
        longest = dist.gather_collective(longest.view(1), "most turns").max().item()
        record.update(metrics.turn_metrics(dist.sum_collective(totals, "turn counts"), longest, run.schedule.tool_names, run.schedule.agents))
    return record


def _check_idle(run: Run, message: str | None) -> None:
    """Steps in a row that trained nothing: a loud warning, or with on_nonfinite error the end
    of the run (every rank decides alike: the record is reduced over them)."""
    if message is None:
        return
    if run.learner.on_nonfinite == "error":
        raise NonFiniteStepError(f"step {run.state.step}: {message}; stopping (on_nonfinite: error)")
    if run.dist.is_main:
        print(f"tandem: WARNING: step {run.state.step}: {message}", file=sys.stderr, flush=True)


def _order(seed: int, n: int, round_index: int, iteration: int) -> list[int]:
    """Seeded shuffle of a round's sequences before they are cut into micro-batches."""
    g = torch.Generator().manual_seed(completion_seed(seed, round_index, -1, iteration) & 0xFFFF_FFFF)
    return torch.randperm(n, generator=g).tolist()


def _micro_batches(s, order: list[int], opt_step: int) -> list[list[int]]:
    """Indices of the grad_accum micro-batches of one optimizer step."""
    return [order[(opt_step * s.grad_accum + m) * s.micro_batch : (opt_step * s.grad_accum + m + 1) * s.micro_batch] for m in range(s.grad_accum)]


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether the steps before..after reached a multiple of `every` (never when every is 0)."""
    return bool(every) and before // every != after // every
