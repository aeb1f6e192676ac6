"""Evaluation on held-out prompts: during training (eval_dataset, every eval_steps, by the run's
own engine with the weights live at that step) and on its own (`tandem eval`).

Each prompt gets eval_num_generations completions (or one greedy completion) from fixed seeds,
so two evaluations differ only by the weights. A completion passes when its weighted reward is
at least eval_pass_threshold; pass@k is the unbiased estimator of Chen et al. (2021) from n
completions of which c pass: 1 - C(n - c, k) / C(n, k), averaged over prompts.
"""

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from tandem import rewards as rewards_lib
from tandem.rollout.multiturn import Rollouts, SingleTurn
from tandem.rollout.types import SamplingParams
from tandem.trainer.producer import PromptTable, completion_seed, score_rollouts, table_prompts, to_rollout
from tandem.trainer.stops import together_collective

EVAL_ROUND = -2  # the seeds' round index: no training round has it


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k completions drawn from n, c of which pass, passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(engine, tokenizer, table: PromptTable, reward_fns, params: SamplingParams, num_generations: int, greedy: bool,
             seed: int, pass_threshold: float, min_version: int = 0, rollouts: Rollouts | None = None, prefix: str = "eval") -> dict:  # fmt: skip
    """eval/* metrics (under `prefix`: eval_NAME/* for one of several datasets) of `engine` on every
    prompt of `table`: num_generations completions each with `params`, or with `greedy` one from
    greedy decoding (top_k 1 draws the likeliest token)."""
    t = time.perf_counter()
    G = 1 if greedy else num_generations
    params = replace(params, top_k=1) if greedy else params
    prompts = table_prompts(table, [i for i in range(len(table.prompt_ids)) for _ in range(G)])
    seeds = [completion_seed(seed, EVAL_ROUND, i, g) for i in range(len(table.prompt_ids)) for g in range(G)]
    outs = (rollouts or SingleTurn()).generate(engine, prompts, params, seeds, min_version)
    rollouts = [to_rollout(o, prompts[k], k // G, k // G) for k, o in enumerate(outs)]
    scores = score_rollouts(table, tokenizer, reward_fns, params.max_tokens, rollouts)[0]  # (N, F)
    reward = rewards_lib.combine(scores, [r.weight for r in reward_fns])  # (N,)
    passed = (reward >= pass_threshold).reshape(-1, G).sum(1).tolist()  # per prompt
    out = {"reward": reward.nanmean().item()}  # a completion no function had an opinion on is left out (and fails)
    for j, fn in enumerate(reward_fns):
        out[f"rewards/{fn.name}/mean"] = scores[:, j].nanmean().item()
    for k in sorted({1, G}):
        out[f"pass@{k}"] = sum(pass_at_k(G, c, k) for c in passed) / len(passed)
    lengths = torch.tensor([len(o.token_ids) for o in outs], dtype=torch.float32)  # every token after the prompt
    out["completions/mean_length"] = lengths.mean().item()
    out["completions/truncated_ratio"] = sum(o.finish_reason == "length" for o in outs) / len(outs)
    out["prompts"] = len(table.prompt_ids)
    out["seconds"] = time.perf_counter() - t
    return {f"{prefix}/{k}": v for k, v in out.items()}


def format_table(results: dict) -> str:
    """The eval/* metrics as two aligned columns."""
    names = {k: k.removeprefix("eval/") for k in results}
    width = max(map(len, names.values()))
    return "\n".join(f"{names[k]:<{width}}  {v:.4f}" if isinstance(v, float) else f"{names[k]:<{width}}  {v}" for k, v in results.items())


def write_json(results: dict, path: Path, about: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in results.items()}  # JSON has no NaN
    path.write_text(json.dumps({**about, **plain}, indent=1) + "\n")


def run_eval(model: str, dataset: str, reward_funcs: list[str], reward_weights: list[float] | None, num_generations: int, greedy: bool,
             max_completion_length: int, temperature: float, max_prompt_length: int | None, pass_threshold: float, seed: int) -> dict:  # fmt: skip
    """`tandem eval`: a model folder, a run's checkpoint (LoRA and sharded ones included) or a hub name, on
    the prompts of `dataset`, with the transformers engine in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.trainer.config import TrainConfig
    from tandem.trainer.sharding import is_sharded, load_model

    config = TrainConfig(model_name_or_path=model, dataset_name=dataset, reward_funcs=reward_funcs, reward_weights=reward_weights,
                         max_completion_length=max_completion_length, temperature=temperature, max_prompt_length=max_prompt_length, seed=seed)  # fmt: skip
    config.validate()
    reward_fns = config.load_rewards()
    if (Path(model) / "adapter_config.json").is_file():  # a LoRA checkpoint: its base model with the adapters
        from tandem.trainer.lora import from_checkpoint

        lm = from_checkpoint(Path(model))
    elif is_sharded(Path(model)):  # a sharded (fsdp) checkpoint, gathered in this process
        lm = load_model(Path(model))
    else:
        lm = AutoModelForCausalLM.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        return evaluate_model(lm, tokenizer, dataset, reward_fns, config, num_generations, greedy, pass_threshold)
    finally:
        rewards_lib.close_rewards(reward_fns)


def evaluate_model(lm, tokenizer, dataset, reward_fns, config, num_generations: int, greedy: bool, pass_threshold: float, prefix: str = "eval") -> dict:
    """eval/* (under `prefix`) of the model `lm` on the prompts of `dataset` (a name or a
    data.GivenDataset), with the transformers engine in this process and the config's sampling,
    prompt options and seed."""
    from tandem.engines.engine import TransformersEngine, eos_token_ids
    from tandem.trainer.setup import PromptOptions, load_prompts

    options = PromptOptions(config.dataset_split, config.dataset_config, config.max_prompt_length, config.prompt_truncation, config.max_completion_length, {})
    table, _ = load_prompts(dataset, tokenizer, options, getattr(lm.config, "max_position_embeddings", None))
    engine = TransformersEngine(lm, eos_token_ids(tokenizer, lm.generation_config, config.model_name_or_path), tokenizer.pad_token_id, tokenizer=tokenizer)
    return evaluate(engine, tokenizer, table, reward_fns, config.sampling_params(), num_generations, greedy, config.seed, pass_threshold, prefix=prefix)


def prefix(name: str) -> str:
    """The metrics' prefix of an eval dataset: eval, or with several, eval_NAME (TRL's eval_NAME_*)."""
    return f"eval_{name}" if name else "eval"


class Evaluator:
    """Evaluation during training: eval/* of the run's engine with the weights live between two
    rounds, on each eval dataset (`tables`: by name; one unnamed, or several named, each under
    eval_NAME/*). Rank 0 evaluates; with a sharded colocated engine every rank does (each of its
    forwards is a collective)."""

    def __init__(self, engine, tokenizer, tables: dict[str, PromptTable], reward_fns, params: SamplingParams, num_generations: int, greedy: bool,
                 seed: int, pass_threshold: float, dist, every_rank: bool, rollouts: Rollouts | None = None):  # fmt: skip
        self.engine, self.tokenizer, self.tables, self.reward_fns, self.params = engine, tokenizer, tables, reward_fns, params
        self.prompts = sum(len(t.prompt_ids) for t in tables.values())
        self.num_generations, self.greedy, self.seed, self.pass_threshold = num_generations, greedy, seed, pass_threshold
        self.dist, self.every_rank, self.rollouts = dist, every_rank, rollouts

    def run_collective(self, version: int) -> dict | None:
        """The eval/* metrics on rank 0 (None elsewhere); every rank waits for them."""
        def run() -> dict | None:
            if not (self.dist.is_main or self.every_rank):
                return None
            if self.every_rank:
                self.dist.enter("evaluation (sharded engine)")
            results = {}
            with self.dist.accelerator.autocast():
                for name, table in self.tables.items():
                    results |= evaluate(self.engine, self.tokenizer, table, self.reward_fns, self.params, self.num_generations, self.greedy,
                                        self.seed, self.pass_threshold, min_version=version, rollouts=self.rollouts, prefix=prefix(name))  # fmt: skip
            return results

        results = together_collective(self.dist, "evaluation", run)  # a server that fails rank 0's stops every rank
        return results if self.dist.is_main else None
