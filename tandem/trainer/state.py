"""TrainState: the one owner of where a run is. Everything else reads it; only the loop moves it,
through after_step and after_round, and a checkpoint holds it as trainer_state.json."""

import uuid
from dataclasses import asdict, dataclass, field


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (logged as "step"), skipped ones included
    version: int = 0  # policy version of the trainer's weights: rounds trained, pushes made
    round: int = 0  # the next generation round to train
    sampler: dict = field(default_factory=dict)  # the sampler's position after the last trained round
    skipped_steps: int = 0  # steps not taken for a NaN or inf loss or gradient norm
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the run on its rollout servers; a resume keeps it

    def after_step(self, skipped: bool) -> None:
        self.step += 1
        self.skipped_steps += int(skipped)

    def after_round(self, round_index: int, sampler_state: dict) -> None:
        """The round is trained: the next one follows it, and the weights are one version newer."""
        self.round = round_index + 1
        self.sampler = sampler_state
        self.version += 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_checkpoint(cls, saved: dict) -> "TrainState":
        """From trainer_state.json (its older names: global_step, policy_version)."""
        return cls(
            step=saved["global_step"],
            version=saved["policy_version"],
            round=saved["round"],
            sampler=saved["sampler"],
            skipped_steps=saved.get("skipped_steps", 0),
            run_id=saved.get("run_id") or uuid.uuid4().hex,
        )
