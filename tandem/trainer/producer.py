"""The rollout producer: turns the sampler's next prompts into scored Rollout records.

This is the synchronous producer; a round is generated when the trainer asks for it.
"""

import time
from dataclasses import dataclass

import torch

from tandem import rewards as rewards_lib
from tandem.data import GroupSampler
from tandem.rollout.engine import Engine
from tandem.rollout.types import Rollout, SamplingParams

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a stable integer hash (Python's hash() is not meant for seeds)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def completion_seed(seed: int, round_index: int, slot: int, generation: int) -> int:
    """Seed of one completion, from where it sits in the run, not from which rank or batch made it."""
    return _mix(_mix(_mix(_mix(seed) ^ round_index) ^ slot) ^ generation)


@dataclass
class PromptTable:
    """The dataset after prompt encoding: what the producer needs of each row."""

    prompts: list  # the raw prompt (str or messages), as reward functions receive it
    prompt_ids: list[list[int]]
    columns: dict[str, list]  # every other dataset column
    conversational: list[bool]


@dataclass
class Round:
    index: int
    rollouts: list[Rollout]  # this rank's, its groups contiguous: (B_rank * G)
    rewards: torch.Tensor  # (N_rank, F), NaN where a function returned None
    completions: list  # decoded completions as the reward functions saw them
    generate_seconds: float
    reward_seconds: float


class SyncProducer:
    """Generates and scores round r when asked, with the engine's current weights."""

    def __init__(
        self,
        table: PromptTable,
        sampler: GroupSampler,
        engine: Engine,
        tokenizer,
        reward_fns: list[rewards_lib.NamedReward],
        params: SamplingParams,
        num_generations: int,
        seed: int,
    ):
        self.table = table
        self.sampler = sampler
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fns = reward_fns
        self.params = params
        self.num_generations = num_generations
        self.seed = seed
        self.round_index = 0

    def next_round(self) -> Round:
        r = self.round_index
        indices, slots = self.sampler.next_round()
        G = self.num_generations
        prompt_ids = [self.table.prompt_ids[i] for i in indices for _ in range(G)]
        seeds = [completion_seed(self.seed, r, s, g) for s in slots for g in range(G)]

        t0 = time.perf_counter()
        outs = self.engine.generate(prompt_ids, self.params, seeds)
        t1 = time.perf_counter()
        rollouts = [
            Rollout(
                prompt_index=indices[k // G],
                group_id=r * self.sampler.prompts_per_rank * self.sampler.world_size + slots[k // G],
                prompt_ids=prompt_ids[k],
                completion_ids=out.token_ids,
                behav_logprobs=out.logprobs,
                finish_reason=out.finish_reason,
                version=out.version,
            )
            for k, out in enumerate(outs)
        ]
        table, completions = self.score(rollouts)
        t2 = time.perf_counter()
        self.round_index += 1
        return Round(r, rollouts, table, completions, t1 - t0, t2 - t1)

    def score(self, rollouts: list[Rollout]) -> tuple[torch.Tensor, list]:
        texts = self.tokenizer.batch_decode([ro.completion_ids for ro in rollouts], skip_special_tokens=True)
        completions = [
            [{"role": "assistant", "content": t}] if self.table.conversational[ro.prompt_index] else t
            for ro, t in zip(rollouts, texts)
        ]
        rows = [ro.prompt_index for ro in rollouts]
        columns = {name: [values[i] for i in rows] for name, values in self.table.columns.items()}
        table = rewards_lib.score(
            self.reward_fns,
            prompts=[self.table.prompts[i] for i in rows],
            completions=completions,
            completion_ids=[ro.completion_ids for ro in rollouts],
            max_completion_length=self.params.max_tokens,
            **columns,
        )
        return table, completions
