"""The group sampler: which prompts each generation round uses, on each rank."""

from dataclasses import dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # prompts of this epoch's permutation already handed out


class GroupSampler:
    """Deterministic stream of prompt indices, cut into rounds and sharded by rank.

    The stream is the concatenation of one seeded permutation of the dataset per epoch, so a
    round can take its last prompts from the next epoch: every round is full, no prompt is
    dropped, and a dataset whose size is not a multiple of the round size never leaves a rank
    with a short or empty tail. Each rank takes a contiguous slice of the round (its own whole
    groups; each prompt becomes `num_generations` completions downstream).
    """

    def __init__(self, num_prompts: int, prompts_per_rank: int, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if num_prompts < 1:
            raise ValueError("the sampler needs at least one prompt")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.num_prompts = num_prompts
        self.prompts_per_rank = prompts_per_rank
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.state = SamplerState()

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next_round(self) -> tuple[list[int], list[int]]:
        """The next round's prompts of the whole world; returns (this rank's indices, their slots).

        A slot is the prompt's position in the round across all ranks (0 .. world*B-1), used to
        derive seeds that do not depend on how the round is split between ranks.
        """
        total = self.prompts_per_rank * self.world_size
        taken: list[int] = []
        while len(taken) < total:
            perm = self._permutation(self.state.epoch)
            need = total - len(taken)
            chunk = perm[self.state.position : self.state.position + need]
            taken += chunk
            self.state.position += len(chunk)
            if self.state.position >= self.num_prompts:
                self.state = SamplerState(self.state.epoch + 1, 0)
        lo = self.rank * self.prompts_per_rank
        return taken[lo : lo + self.prompts_per_rank], list(range(lo, lo + self.prompts_per_rank))

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state was saved for seed={state['seed']} and {state['num_prompts']} prompts, "
                f"this run has seed={self.seed} and {self.num_prompts}; resume with the same seed and dataset"
            )
        self.state = SamplerState(state["epoch"], state["position"])
