"""The records that carry a completion from the engine to the loss."""

from dataclasses import asdict, dataclass, field, replace

FINISH_REASONS = ("stop", "length", "error")
# Bounds that keep logits / temperature and the penalised logits finite in float32 (and bf16).
TEMPERATURE_RANGE = (1e-2, 1e2)
REPETITION_PENALTY_RANGE = (1e-2, 1e2)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. Field names follow vLLM's SamplingParams."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Constrained decoding: what the answer must be, in llguidance's Lark dialect (rollout/grammar.py);
    # None for free text
    grammar: str | None = None

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (_within(self.temperature, TEMPERATURE_RANGE), "temperature", f"must be in {list(TEMPERATURE_RANGE)} (0.01 is near-greedy)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)"),
            (0 <= self.min_p < 1, "min_p", "must be in [0, 1)"),
            (_within(self.repetition_penalty, REPETITION_PENALTY_RANGE), "repetition_penalty", f"must be in {list(REPETITION_PENALTY_RANGE)} (1.0 disables it)"),
            (self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()), "grammar", "must be a grammar's text or None"),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name}={getattr(self, name)!r} {fix}")

    def to_dict(self) -> dict:
        return asdict(self)


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]  # False for NaN


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one sequence."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token, log softmax(logits / temperature)
    finish_reason: str  # one of FINISH_REASONS
    version: int = 0  # policy version of the weights that generated it
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (vLLM's); 0 for an engine without one


@dataclass
class Rollout:
    """One completion with everything the loss and the logs need; nothing downstream guesses these."""

    prompt_index: int  # row of the dataset
    group_id: int  # the prompt slot this completion belongs to; its G completions share it
    prompt_ids: list[int]
    completion_ids: list[int]
    behav_logprobs: list[float]  # per completion token, from the engine that sampled it (0.0 on inserted tokens)
    finish_reason: str
    version: int  # policy version of the weights that generated it (of a multi-turn one, its oldest turn's)
    extra: dict = field(default_factory=dict)  # dataset columns, passed to reward functions
    # Multi-turn: 1 on the model's tokens, 0 on inserted ones (tool results, observations,
    # template glue), which are out of the loss, the KL and the entropy. None: all the model's.
    loss_mask: list[int] | None = None
    turns: dict | None = None  # multi-turn: messages, tool calls, versions of its turns (multiturn.Trajectory.info)
    # Partial rollouts: the version of each of the model's tokens (loss mask 1), run-length coded
    # as [version, count] pairs in order (a sequence carried across weight updates). None: every
    # token is of `version` (of a multi-turn one, of its turn: turns["versions"]).
    token_versions: list[list[int]] | None = None
    # An agent's trajectory of several rows (one per history it rewrote, rollout/agents.py): the
    # rows before this one, each a dict of prompt_ids, completion_ids, behav_logprobs, loss_mask
    # and version. They train with this rollout's reward and advantage (rows()).
    earlier: list[dict] | None = None
    logged: dict | None = None  # what reward functions gave log_extra for it (TRL's): column -> value, for completions.jsonl

    def rows(self) -> list["Rollout"]:
        """What trains: the earlier rows, then this one; one sequence of the loss's reduction, and
        one sample: every row ends as the trajectory did (truncated, failed or finished)."""
        if not self.earlier:
            return [self]
        last = replace(self, earlier=None)
        return [replace(last, turns=None, token_versions=None, **row) for row in self.earlier] + [last]

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model produced (the ones the loss counts)."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def newest_version(self) -> int:
        return self.token_versions[-1][0] if self.token_versions else self.version

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def failed(self) -> bool:
        """The engine ended it on an error (a vLLM abort): an unfinished text, never trained as
        a finished one. It gets no reward (NaN, left out of its group's statistics, advantage 0)
        and no loss tokens."""
        return self.finish_reason == "error"

    def in_loss(self, mask_truncated: bool) -> bool:
        """Whether its tokens enter the loss: not failed, and not truncated when those are masked."""
        return not (self.failed or (mask_truncated and self.truncated))
