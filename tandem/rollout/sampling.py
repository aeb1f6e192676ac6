"""Logits processing and reproducible per-sequence sampling."""

import functools

import torch

from tandem.algo import selective_log_softmax_into

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finaliser: a stable integer hash (Python's hash() is not meant for seeds)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019, eq. 2) on tokens already in the sequence.

    logits: (N, V) float, seen: (N, V) bool -> (N, V)
    """
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Set to -inf the tokens that top-k, top-p (nucleus) or min-p sampling exclude. (N, V) -> (N, V)"""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        floor = min_p * probs.max(dim=-1, keepdim=True).values  # (N, 1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # (N, V)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Workspace:
    """What a decode loop samples in, allocated once per call and reused at every step: a fresh
    (N, V) tensor is fresh pages to fault in, 7 ms against 0.2 for 8 rows of 151,936 with the
    CLI's allocator settings (tandem/cli.py: _return_freed_memory). It holds the probabilities,
    the noise and its doubles, and the scores divided by the temperature. A step uses the first
    rows, as many as it samples (finished rows leave the batch)."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.probs = torch.empty((rows, width), device=device)
        self.scores = torch.empty((rows, width), device=device)
        self.noise = torch.empty((rows, width), device=device)  # where the rows' generators draw it (row_generators)
        self.uniform = torch.empty(width, dtype=torch.float64)


def row_generators(seeds: list[int], device: torch.device) -> list[torch.Generator]:
    """Each row's generator, seeded with its seed: on a GPU a CUDA generator, so its noise is drawn
    there (drawn on the CPU, 8 rows of 151,936 values would take about 7 ms of every decode step,
    and a copy); elsewhere the CPU's. A row's tokens then depend on its seed and on the kind of
    device, as its numerics already do."""
    where = device if device.type == "cuda" else torch.device("cpu")
    return [torch.Generator(where).manual_seed(seed) for seed in seeds]


def scaled_into(logits: torch.Tensor, temperature: float, work: Workspace) -> torch.Tensor:
    """algo.scaled(logits, temperature), (N, V), in `work`'s scores: the same values."""
    return logits if temperature == 1.0 else torch.div(logits, temperature, out=work.scores[: len(logits)])


def chosen_logprobs(scaled: torch.Tensor, tokens: torch.Tensor, work: Workspace) -> torch.Tensor:
    """algo.token_logprobs of `tokens` (N,) under softmax(scaled), where scaled (N, V) is
    scaled_into(logits, temperature, work) of float32 logits: the same values, computed with
    `work`'s probabilities as scratch (call it after sampling). Alone, 8 rows of 151,936 at
    temperature 0.7 with the CLI's allocator settings: 0.8-1.0 ms against 3.9-5.3 for
    token_logprobs."""
    return selective_log_softmax_into(scaled, tokens, work.probs[: len(scaled)])  # (N,)


def sample(logits: torch.Tensor, generators: list[torch.Generator], work: Workspace | None = None) -> torch.Tensor:
    """Draw one token per row with that row's own generator. logits: (N, V) -> (N,)

    Uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability
    p_i. Each row draws V values from its own generator, so a sequence's sample depends only on
    its seed and its logits, not on which other sequences share the batch.
    """
    n, width = logits.shape
    work = work or Workspace(n, width, logits.device)
    probs = torch.softmax(logits.float(), dim=-1, out=work.probs[:n])  # (N, V)
    noise = exponential_noise(width, generators, work)  # (N, V)
    return torch.argmax(probs.div_(noise.to(probs.device)), dim=-1)  # (N,)


def exponential_noise(width: int, generators: list[torch.Generator], work: Workspace | None = None) -> torch.Tensor:
    """Row i: `width` draws of Exp(1) from generators[i]. (N, width) where the generators are (all
    on one device), in `work` where given. On a GPU each row is one exponential_ of its own.

    torch's exponential_ draws them one at a time on one core (17 ns each, here: 20 ms of a 95 ms
    decode step of 8 rows at the Qwen2.5-0.5B shape's vocabulary of 151,936). Where it computes
    -log1p(-u) in double of the uniform doubles its generator gives (_exponential_by_uniform),
    the same values come from uniform_ and vectorized ops at a third of the time, with the
    generator left in the same state. All in the calling thread: spread over Python threads,
    whose vectorized ops each start a team of OpenMP threads of their own, the draws made every
    op of a decode step slower (128 against 97 ms a step, 8 rows at that shape in bf16)."""
    work = work or Workspace(len(generators), width, generators[0].device)
    noise = work.noise[: len(generators)]
    if noise.device.type != "cpu" or not _exponential_by_uniform():
        for row, generator in zip(noise, generators):
            row.exponential_(generator=generator)
        return noise
    for row, generator in zip(noise, generators):
        row.copy_(_exponential_from_uniform(work.uniform, generator))  # rounded to float as exponential_ rounds
    return noise


def _exponential_from_uniform(buffer: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """-log1p(-u) of the uniform doubles `generator` draws, in `buffer` (float64)."""
    return buffer.uniform_(generator=generator).neg_().log1p_().neg_()


@functools.cache
def _exponential_by_uniform() -> bool:
    """Whether this torch's exponential_ on a CPU gives -log1p(-u) of uniform_'s doubles, rounded
    to float, for the same generator, leaving it in the same state (checked once, on 4,096 draws
    of a few seeds): then exponential_noise draws that way, else with exponential_ itself."""
    for seed in (0, 1, 2**47 + 5):
        want, mine = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        expected = torch.empty(4096).exponential_(generator=want)
        got = _exponential_from_uniform(torch.empty(4096, dtype=torch.float64), mine).float()
        if not (torch.equal(expected, got) and torch.equal(want.get_state(), mine.get_state())):
            return False
    return True
