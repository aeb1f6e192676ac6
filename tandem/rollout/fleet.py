"""Several rollout servers as one fleet: how a call's sequences are shared among the replicas that
are up (a Balance), which replica holds a sequence's prefix (affinity), and which replicas are
down. Only decisions and state: the HTTP to each replica is the client's (tandem.rollout.client).

A completion's tokens depend on its prompt, seed and weights alone (docs/async.md), so which
replica serves it changes none of them: shares may follow the replicas' measured speed."""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tandem")
HOMES_KEPT = 1 << 16  # the most served prompts remembered (the oldest are forgotten first)
_MOD = (1 << 61) - 1  # the prefix hash's modulus (a Mersenne prime)


class Balance(Protocol):
    """How many of a call's `n` sequences each replica serves; told how each request went."""

    def shares(self, n: int, urls: list[str]) -> list[int]: ...

    def observe(self, url: str, tokens: int, seconds: float) -> None: ...


class EvenSplit:
    """Equal shares, whatever the replicas' speed: a replica at half speed holds every call."""

    def shares(self, n: int, urls: list[str]) -> list[int]:
        k = len(urls)
        return [round((i + 1) * n / k) - round(i * n / k) for i in range(k)]

    def observe(self, url: str, tokens: int, seconds: float) -> None:
        pass


class SpeedWeighted:
    """Shares in proportion to each replica's completion tokens per second in its recent requests
    (an exponential average): replicas that answered in unequal times get shares that make them
    answer together. Where time grows with a batch's rows (compute-bound), a replica at half speed
    settles at half a share; where it does not (memory-bound decoding, whose step costs about the
    same for 4 rows as for 8), a slow replica's share shrinks call by call towards none, which is
    then the fastest split: the others take its rows at little cost. A replica left without a share
    doubles its rate (up to the others' mean) at each call it sits out, so one that recovered is
    tried again. A replica not measured yet counts as the mean of those that are."""

    def __init__(self, smoothing: float = 0.5):
        self.smoothing = smoothing
        self.rate: dict[str, float] = {}  # url -> completion tokens per second

    def shares(self, n: int, urls: list[str]) -> list[int]:
        known = [self.rate[u] for u in urls if u in self.rate]
        mean = sum(known) / len(known) if known else 1.0
        weights = [self.rate.get(u, mean) for u in urls]
        exact = [n * w / sum(weights) for w in weights]
        counts = [int(e) for e in exact]
        for i in sorted(range(len(urls)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:  # largest remainders
            counts[i] += 1
        for url, count in zip(urls, counts):
            if count == 0 and url in self.rate:
                self.rate[url] = min(2 * self.rate[url], mean)
        return counts

    def observe(self, url: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate[url] = rate if url not in self.rate else (1 - self.smoothing) * self.rate[url] + self.smoothing * rate


BALANCES = {"speed": SpeedWeighted, "even": EvenSplit}


@dataclass
class Down:
    since: float  # time.monotonic()
    why: str


class Fleet:
    """The replicas' state, shared by the client's threads: which are up, where each prefix lives,
    what happened (the `events` counters, logged as metrics)."""

    def __init__(self, urls: list[str], balance: Balance):
        self.urls, self.balance = urls, balance
        self.down: dict[str, Down] = {}
        self.homes: dict[tuple[int, int], str] = {}  # a served prompt's (length, hash) -> the replica that served it last
        self.events = {"down": 0, "readded": 0, "reissued": 0}  # replicas taken out, put back; sequences generated again elsewhere
        self._changed = threading.Condition()

    def up(self) -> list[str]:
        with self._changed:
            return [u for u in self.urls if u not in self.down]

    def is_up(self, url: str) -> bool:
        return url not in self.down

    def mark_down(self, url: str, why: str) -> None:
        with self._changed:
            if url not in self.down:
                self.down[url] = Down(time.monotonic(), why)
                self.events["down"] += 1
                self._changed.notify_all()
                log.warning(f"rollout server {url} is taken out of the fleet ({why}); the others do its work until it answers again")

    def mark_up(self, url: str) -> None:
        with self._changed:
            if self.down.pop(url, None) is not None:
                self.events["readded"] += 1
                self._changed.notify_all()

    def plan(self, prompts: list[list[int]], indices: list[int]) -> list[tuple[str, list[int]]]:
        """`indices` (of `prompts`) shared among the replicas up: each replica's share by the
        balance, filled first with the sequences whose prefix it holds (the longest prompt it
        served that the sequence begins with), then in order."""
        urls = self.up()
        if len(urls) == 1:
            return [(urls[0], list(indices))]
        quota = dict(zip(urls, self.balance.shares(len(indices), urls)))
        parts: dict[str, list[int]] = {u: [] for u in urls}
        rest = []
        for i in indices:
            home = None
            for key in _prefixes(prompts[i]):
                home = self.homes.get(key, home)
            if home in quota and len(parts[home]) < quota[home]:
                parts[home].append(i)
            else:
                rest.append(i)
        it = iter(rest)
        for url in urls:
            parts[url] += [next(it) for _ in range(quota[url] - len(parts[url]))]
        return [(url, sorted(part)) for url, part in parts.items() if part]

    def served(self, url: str, prompts: list[list[int]], tokens: int, seconds: float) -> None:
        """`url` answered for `prompts`, `tokens` completion tokens in `seconds`."""
        with self._changed:
            self.balance.observe(url, tokens, seconds)
            if len(self.urls) == 1:
                return
            for p in prompts:
                *_, key = _prefixes(p)  # the whole prompt's
                self.homes.pop(key, None)  # re-inserted last: the dict's order is the age
                self.homes[key] = url
            while len(self.homes) > HOMES_KEPT:
                del self.homes[next(iter(self.homes))]

    def wait_for_one(self, timeout: float) -> str | None:
        """Wait up to `timeout` seconds for a replica to be up; None once one is, else what
        became of each."""
        with self._changed:
            if self._changed.wait_for(lambda: len(self.down) < len(self.urls), timeout):
                return None
            now = time.monotonic()
            return "; ".join(f"{u} down for {now - d.since:.0f}s ({d.why})" for u, d in self.down.items())



def _prefixes(tokens: list[int]):
    """(length, hash) of every prefix of `tokens`, shortest first: one pass, each hash from the last."""
    h = 0
    for n, token in enumerate(tokens, 1):
        h = (h * 1_000_003 + token + 1) % _MOD
        yield n, h
