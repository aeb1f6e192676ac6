"""Metrics and completions written as JSON lines, flushed each step so they can be plotted live,
and to the experiment trackers (`report_to`, the transformers/TRL name) through accelerate's
tracker classes: the same metrics at the same steps from rank 0, and the logged completions as
a table where the tracker has one (W&B)."""

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Protocol

import torch

from tandem.algo import nanstd


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None plots as a gap
    return value


def _json_value(value):
    """What json cannot write itself, written as it can: numpy's and torch's numbers (a
    get_reward() returning np.float32 ended runs at the first completions.jsonl line), their
    arrays as lists, anything else as its text. These are logs for reading and plotting."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class LogWriteError(RuntimeError):
    """A log line could not be written (a full disk); the message names the file."""


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = open(path, "a")

    def write(self, record: dict) -> None:
        line = json.dumps({k: _plain(v) for k, v in record.items()}, default=_json_value) + "\n"
        try:
            self.fh.write(line)
            self.fh.flush()
        except OSError as exc:  # a line cut short is dropped at resume (truncate_log)
            raise LogWriteError(f"could not write {self.path.name} in {self.path.parent} ({type(exc).__name__}: {exc}); "
                                "free some space there, then resume with --resume_from_checkpoint latest") from None  # fmt: skip

    def close(self) -> None:
        try:
            self.fh.close()
        except OSError:  # the line a failed write left in the buffer fails again: reported already
            pass


def truncate_log(path: Path, step: int) -> str | None:
    """Drop lines logged after `step` by a run that died after its last checkpoint. A last line
    that is not JSON, a write cut short (a kill, a full disk, power loss, NFS), is dropped too:
    returns a line saying so, else None. Damage before the last line is an error naming it."""
    if not path.exists():
        return None
    lines, kept, torn = path.read_text().splitlines(), [], None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}, line {i + 1}, is not JSON ({line[:80]!r}): the log is damaged before its last line; "
                                 "remove the damaged lines to resume") from None  # fmt: skip
            torn = f"{path}: dropped its last line, cut short ({len(line)} characters: {line[:60]!r})"
            continue
        if record["step"] <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return torn


class IdleSteps:
    """Counts the optimizer steps in a row that trained nothing: skipped for a NaN or inf, or on
    a round where no reward function had an opinion on any completion (every reward None). A run
    of them as long as `patience` (or the whole run, at its end) is worth a loud message: such a
    run used to end with exit code 0 and nothing said."""

    def __init__(self, patience: int, skipped_before: int):
        self.patience, self.skipped = patience, skipped_before
        self.in_a_row = self.steps = self.idle = 0

    def after_step(self, record: dict) -> str | None:
        """The message once `patience` idle steps in a row are reached (again), else None."""
        skipped, self.skipped = record["skipped_steps"] > self.skipped, record["skipped_steps"]
        idle = skipped or math.isnan(record["reward"])
        self.steps += 1
        self.idle += idle
        self.in_a_row = self.in_a_row + 1 if idle else 0
        if self.in_a_row and self.in_a_row % self.patience == 0:
            return f"the last {self.in_a_row} steps trained nothing ({self._why(record)})"
        return None

    def at_end(self, record: dict) -> str | None:
        if self.steps and self.idle == self.steps:
            return f"this run trained nothing: none of its {self.steps} steps changed the weights with a reward ({self._why(record)})"
        return None

    @staticmethod
    def _why(record: dict) -> str:
        return (
            f"skipped_steps {record['skipped_steps']}: the loss or gradient norm was NaN or inf (check learning_rate, "
            "reward_weights and the rewards' scale); or every reward was None: no reward function had an opinion "
            "(check that the dataset has the columns they read)"
        )


class AgentFailures:
    """Counts the steps in a row on which more than half of the agents failed (agents/errors and
    agents/timeouts), and the first failure of them as this rank's agents said it. `patience` of
    them, or every step of a run that ends sooner, stop the run: with most agents failing (a 404
    or a 400 each time) such a run used to end with exit code 0, its agents' error only in
    completions.jsonl. A few failing agents are agent_failure's to handle."""

    def __init__(self, patience: int):
        self.patience = patience
        self.in_a_row = self.steps = self.failing = self.count = 0
        self.first: str | None = None
        self._round = -1

    def after_step(self, record: dict, rnd, last: bool) -> str | None:
        """The message once the run should stop, else None."""
        failed = record["agents/errors"] + record["agents/timeouts"]
        self.steps += 1
        if failed <= 0.5:
            self.in_a_row, self.first, self.count = 0, None, 0
            return None
        self.in_a_row, self.failing = self.in_a_row + 1, self.failing + 1
        if rnd.index != self._round:  # a round's steps share its agents: count them once
            self._round = rnd.index
            agents = [ro.turns["agent"] for ro in rnd.rollouts]
            whys = [a["why"] or "it ran past agent_timeout" for a in agents if a["error"] or a["timeout"]]
            self.first = self.first or (whys[0] if whys else None)
            self.count += whys.count(self.first)
        if self.in_a_row < self.patience and not (last and self.failing == self.steps):
            return None
        first = f"the first failure here, {self.count} times: {self.first}" if self.first else "their failures were on other processes"
        return (f"more than half of the agents failed on each of the last {self.in_a_row} steps ({failed:.0%} on the last); {first}. "
                "agent_failure is for a few failing agents: fix what makes most of them fail")  # fmt: skip


def peak_memory_gb() -> float:
    """This process's peak memory so far: allocated on its GPU, else resident on the host."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def combine(key: str, values: torch.Tensor) -> torch.Tensor:
    """Several values of one metric (micro-batches or ranks) into one: min of */min, max of */max, else mean."""
    if key.endswith("/min"):
        return values.min()
    if key.endswith("/max"):
        return values.max()
    return values.mean()


def round_metrics(rnd, reward_names: list[str], table, rewards, adv_stats, lengths, truncated, round_seconds: float, first: bool) -> dict:
    """The round's reward, length and time metrics, over every rank. table (N, F), rewards,
    lengths, truncated (N,). Generate and reward times go on the round's first step only, so
    their sum over steps is the true total."""
    tokens = float(lengths.sum())
    m = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": nanstd(rewards).nan_to_num(0.0).item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/truncated_ratio": truncated.mean().item(),
        "completion_tokens": tokens,
        "completion_tokens_per_second": tokens / max(round_seconds, 1e-9),
        "frac_reward_zero_std": adv_stats["frac_groups_zero_std"].item(),
        "time/wait_for_rollouts": rnd.wait_seconds if first else 0.0,
        "time/generate": rnd.generate_seconds if first else 0.0,
        "time/reward": rnd.reward_seconds if first else 0.0,
    }
    if rnd.occupancy is not None:  # this rank's engine calls
        m["engine/occupancy"] = rnd.occupancy
    for j, name in enumerate(reward_names):
        m[f"rewards/{name}/mean"] = torch.nanmean(table[:, j]).item()
        m[f"rewards/{name}/std"] = nanstd(table[:, j]).nan_to_num(0.0).item()
    return m


def reward_metrics_collective(dist, logged: dict) -> dict:
    """What reward functions gave log_metric over every rank, as TRL averages it: each rank's mean
    of its values, then the mean over the ranks that logged the name."""
    every = dist.objects_collective({name: sum(v) / len(v) for name, v in logged.items() if v}, "reward metrics")
    names = sorted({name for means in every for name in means})
    return {name: sum(m[name] for m in every if name in m) / sum(name in m for m in every) for name in names}


def turn_counts(rollouts, tool_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's multi-turn counts, to be summed over ranks (trajectories, turns, tool seconds,
    trajectories whose template rewrote them, agents' errors, timeouts, new rows and rows trained,
    then calls and failures per tool), and its most turns."""
    per_tool = torch.zeros((len(tool_names), 2))  # (tools, [calls, failures])
    turns = [ro.turns["turns"] for ro in rollouts]
    seconds = rewrites = errors = timeouts = new_rows = trained = 0.0
    for ro in rollouts:
        seconds += sum(c["seconds"] for c in ro.turns["tool_calls"])
        rewrites += ro.turns["template_rewrites"] > 0
        for c in ro.turns["tool_calls"]:
            per_tool[tool_names.index(c["name"])] += torch.tensor([1.0, 0.0 if c["ok"] else 1.0])
        agent = ro.turns.get("agent") or {}
        errors, timeouts, new_rows = errors + agent.get("error", 0), timeouts + agent.get("timeout", 0), new_rows + agent.get("new_rows", 0)
        trained += 1 + len(ro.earlier or [])
    head = torch.tensor([len(rollouts), sum(turns), seconds, rewrites, errors, timeouts, new_rows, trained])
    return torch.cat([head, per_tool.flatten()]), torch.tensor(float(max(turns)))


def turn_metrics(totals: torch.Tensor, longest: float, tool_names: list[str], agents: bool = False) -> dict:
    """multi_turn/* and tools/* from turn_counts summed over ranks. Frequencies are per
    trajectory (TRL's tools/call_frequency); a failure is a call that did not return a usable result.
    With `agents` (agent_func): agents/errors and agents/timeouts, episodes ended so, and
    agents/new_rows, rows an agent started by rewriting its history, and agents/rows_per_trajectory,
    the rows trained (all of them, or with agent_train_rows: last one); all per trajectory."""
    n, turns, seconds, rewrites, errors, timeouts, new_rows, trained = totals[:8].tolist()
    per_tool = totals[8:].view(-1, 2)  # (tools, [calls, failures])
    calls, failures = per_tool.sum(0).tolist()
    m = {
        "multi_turn/turns/mean": turns / n,
        "multi_turn/turns/max": longest,
        "multi_turn/template_rewrites": rewrites / n,
        "tools/call_frequency": calls / n,
        "tools/failure_frequency": failures / max(calls, 1.0),
        "time/tools": seconds,
    }
    for name, (c, f) in zip(tool_names, per_tool.tolist()):
        m[f"tools/{name}/call_frequency"] = c / n
        m[f"tools/{name}/failure_frequency"] = f / max(c, 1.0)
    if agents:
        m.update({"agents/errors": errors / n, "agents/timeouts": timeouts / n, "agents/new_rows": new_rows / n, "agents/rows_per_trajectory": trained / n})
    return m


def completion_records(rnd, tokenizer, reward_names: list[str], rewards, advantages, step: int, limit: int) -> list[dict]:
    """The first `limit` completions of this rank's round, decoded, with their rewards, for completions.jsonl."""
    shown = rnd.rollouts[:limit]
    texts = tokenizer.batch_decode([r.completion_ids for r in shown], skip_special_tokens=False)
    return [
        {
            "step": step,
            "round": rnd.index,
            "prompt": tokenizer.decode(ro.prompt_ids, skip_special_tokens=False),
            "completion": texts[k],
            "completion_tokens": len(ro.completion_ids),
            "reward": rewards[k].item(),
            **{f"rewards/{name}": rnd.rewards[k, j].item() for j, name in enumerate(reward_names)},
            "advantage": advantages[k].item(),
            **(ro.logged or {}),  # what reward functions gave log_extra
            "finish_reason": ro.finish_reason,
            "policy_version": ro.version,
            **({"token_versions": ro.token_versions} if ro.token_versions else {}),  # partial rollouts: [version, tokens] runs
            **({"turns": ro.turns} if ro.turns else {}),  # multi-turn: its messages, tool calls and each turn's version
        }
        for k, ro in enumerate(shown)
    ]


# ---------------------------------------------------------------- trackers

# report_to name -> the package it needs
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_report_to(report_to: list[str]) -> str | None:
    """Why report_to cannot work (naming the fix), or None."""
    unknown = [r for r in report_to if r not in (*TRACKERS, "none")]
    if unknown:
        return f"{unknown} unknown; give any of {sorted(TRACKERS)}, or none"
    if "none" in report_to and len(report_to) > 1:
        return "none cannot be combined with a tracker"
    missing = [TRACKERS[r] for r in report_to if r in TRACKERS and importlib.util.find_spec(TRACKERS[r]) is None]
    if missing:
        return f"needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: pip install {' '.join(missing)}"
    return None


def log_with(report_to: list[str]) -> list[str] | None:
    """accelerate's log_with argument."""
    chosen = [r for r in report_to if r != "none"]
    return chosen or None


def hyperparameters(config: dict) -> dict:
    """The run's config as trackers take it: scalars, lists and mappings written out."""
    return {k: ", ".join(map(str, v)) if isinstance(v, list) else json.dumps(v) if isinstance(v, dict) else v for k, v in config.items()}


def scalars(record: dict) -> dict:
    """The numeric metrics of a metrics.jsonl record (trackers plot numbers)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def log_completions(accelerator, lines: list[dict], step: int) -> None:
    """The completions.jsonl lines of a step as a W&B table, and as a Markdown table in
    TensorBoard's text tab (the other trackers have neither)."""
    names = [t.name for t in accelerator.trackers]
    if not lines or not {"wandb", "tensorboard"} & set(names):
        return
    columns = list(lines[0])
    rows = [[v if isinstance(v, (int, float, str)) or v is None else str(v) for v in (line.get(c) for c in columns)] for line in lines]
    if "wandb" in names:
        accelerator.get_tracker("wandb").log_table("completions", columns=columns, data=rows, step=step)
    if "tensorboard" in names:
        markdown = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(map(_markdown_cell, r)) + " |" for r in rows])
        accelerator.get_tracker("tensorboard").tracker.add_text("completions", markdown, step)


def _markdown_cell(v) -> str:
    """A value as one Markdown table cell: text escaped (newlines, control characters, pipes)."""
    if isinstance(v, str):
        return repr(v)[1:-1].replace("|", "\\|")
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class Listener(Protocol):
    """What follows a run's records as they are logged, on every rank (the Python API's callbacks)."""

    def step_begin(self) -> None:
        """An optimizer step is about to begin."""
        ...

    def step(self, record: dict) -> bool:
        """A step's metrics.jsonl line; True asks the run to stop at the end of the round."""
        ...

    def saved(self, step: int) -> None:
        """The checkpoint of `step` is written."""
        ...

    def evaluation(self, step: int, results: dict) -> None:
        """The eval/* results of `step`, on the main process (they are computed there)."""
        ...


class RunLog:
    """Where a run's numbers go, from rank 0: metrics.jsonl (a line per step), completions.jsonl,
    eval.jsonl, the experiment trackers at the same steps, and the progress bar with the live
    reward. The other ranks hold an inert one, but for `listeners`, which every rank tells."""

    def __init__(self, out: Path, accelerator, is_main: bool, with_eval: bool, completions_per_step: int, max_steps: int, show_bar: bool,
                 listeners: tuple = ()):  # fmt: skip
        self.listeners, self.stop_asked = listeners, False  # a listener asked the run to stop
        self.accelerator, self.is_main, self.completions_per_step = accelerator, is_main, completions_per_step
        self.max_steps, self.show_bar, self.bar = max_steps, show_bar and is_main, None
        self.metrics = JsonlWriter(out / "metrics.jsonl") if is_main else None
        self.completions = JsonlWriter(out / "completions.jsonl") if is_main else None
        self.evals = JsonlWriter(out / "eval.jsonl") if is_main and with_eval else None

    def start(self, step: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.max_steps, initial=step, desc="tandem", disable=not self.show_bar, dynamic_ncols=True)

    def step_begin(self) -> None:
        for listener in self.listeners:
            listener.step_begin()

    def saved(self, step: int) -> None:
        for listener in self.listeners:
            listener.saved(step)

    def step(self, record: dict) -> None:
        for listener in self.listeners:
            self.stop_asked |= bool(listener.step(record))
        if not self.is_main:
            return
        self.metrics.write(record)
        self.accelerator.log(scalars(record), step=record["step"])
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{record['reward']:.3f}", tok_s=f"{record['completion_tokens_per_second']:.0f}", loss=f"{record['loss']:.4f}")

    def sample(self, lines_of, step: int) -> None:
        """completions.jsonl's lines of the step: `lines_of(limit)` makes them (rank 0 only)."""
        if self.is_main and self.completions_per_step:
            lines = lines_of(self.completions_per_step)
            for line in lines:
                self.completions.write(line)
            log_completions(self.accelerator, lines, step)

    def evaluation(self, step: int, results: dict, prompts: int) -> None:
        if not self.is_main:
            return
        for listener in self.listeners:
            listener.evaluation(step, results)
        self.evals.write({"step": step, **results})
        self.accelerator.log(results, step=step)
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in results.items() if k.endswith("/reward") or "/pass@" in k)
        print(f"tandem: step {step} eval on {prompts} prompts: {shown}", flush=True)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        for writer in (self.metrics, self.completions, self.evals):
            if writer is not None:
                writer.close()
