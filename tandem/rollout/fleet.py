"""Several rollout servers as one fleet: how a call's sequences are shared among the replicas that
are up (a Balance), which replica holds a sequence's prefix (affinity), and which replicas are
down. Only decisions and state: the HTTP to each replica is the client's (tandem.rollout.client).

A completion's tokens depend on its prompt, seed and weights alone (docs/async.md), so which
replica serves it changes none of them: shares may follow the replicas' measured speed."""

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tandem")
HOMES_KEPT = 1 << 16  # the most served prompts remembered (the oldest are forgotten first)
_MOD = (1 << 61) - 1  # the prefix hash's modulus (a Mersenne prime)


class Balance(Protocol):
    """How many of a call's `n` sequences each replica serves; told how each request went: its
    rows, its decode steps (its longest completion) and its seconds."""

    def shares(self, n: int, urls: list[str]) -> list[int]: ...

    def observe(self, url: str, rows: int, steps: int, seconds: float) -> None: ...


class EvenSplit:
    """Equal shares, whatever the replicas' speed: a replica at half speed holds every call."""

    def shares(self, n: int, urls: list[str]) -> list[int]:
        k = len(urls)
        return [round((i + 1) * n / k) - round(i * n / k) for i in range(k)]

    def observe(self, url: str, rows: int, steps: int, seconds: float) -> None:
        pass


class Timed:
    """Shares that make the replicas answer together, from the times they took. A decode step of
    r rows takes a + b*r seconds on a replica: a is what every step costs (reading the weights,
    dispatch), b what each row adds. Each replica's a and b are fitted to its last KEPT requests
    (their seconds per step), and a call's rows go where they make the slowest predicted step
    shortest. Where a step costs about the same for 4 rows as for 8 (memory-bound decoding: a
    dominates), a replica at half speed gets no rows: its step alone would take longer than the
    others' with its rows added. Where steps grow with the rows (b dominates) it gets about half a
    share. Until a replica's requests differ in rows, its time is taken as proportional to them
    (a = 0); one not measured yet counts as the mean of those that are. A replica left without
    rows is tried again, as that mean, after it sat out 4 calls, then 8, 16, up to 64: one that
    recovered comes back, and one still slow costs two slow calls each time."""

    KEPT = 4

    def __init__(self):
        self.seen: dict[str, deque[tuple[int, float]]] = {}  # url -> (rows, seconds per step) of its last requests
        self.idle: dict[str, int] = {}  # url -> calls it sat out in a row
        self.wait: dict[str, int] = {}  # url -> calls it sits out before it is tried again

    def observe(self, url: str, rows: int, steps: int, seconds: float) -> None:
        if rows > 0 and steps > 0 and seconds > 0:
            self.seen.setdefault(url, deque(maxlen=self.KEPT)).append((rows, seconds / steps))

    def fit(self, url: str) -> tuple[float, float] | None:
        """(a, b) by least squares over the replica's requests, both >= 0; None if none."""
        seen = self.seen.get(url)
        if not seen:
            return None
        rows, step = sum(r for r, _ in seen) / len(seen), sum(t for _, t in seen) / len(seen)
        spread = sum((r - rows) ** 2 for r, _ in seen)
        if spread == 0:
            return 0.0, step / rows
        b = max(sum((r - rows) * (t - step) for r, t in seen) / spread, 0.0)
        return max(step - b * rows, 0.0), max(b, 1e-12)

    def shares(self, n: int, urls: list[str]) -> list[int]:
        fits = [self.fit(u) for u in urls]
        known = [f for f in fits if f is not None]
        mean = (sum(a for a, _ in known) / len(known), sum(b for _, b in known) / len(known)) if known else (0.0, 1.0)
        model = [f or mean for f in fits]

        def rows_within(t: float) -> list[int]:  # the most rows each replica decodes in a step of t seconds
            return [min(n, math.floor((t - a) / b + 1e-9)) if t >= a + b else 0 for a, b in model]

        lo, hi = 0.0, max(a + b * n for a, b in model)
        for _ in range(60):  # the shortest step in which the replicas hold all n rows
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if sum(rows_within(mid)) >= n else (mid, hi)
        counts = rows_within(hi)
        while sum(counts) > n:  # one row less where the predicted step is longest
            i = max((i for i in range(len(urls)) if counts[i]), key=lambda i: model[i][0] + model[i][1] * counts[i])
            counts[i] -= 1
        while sum(counts) < n:  # rows the bisection's rounding left out (steps flat in their rows): where the step stays shortest
            i = min(range(len(urls)), key=lambda i: model[i][0] + model[i][1] * (counts[i] + 1))
            counts[i] += 1
        for url, count in zip(urls, counts):
            self.idle[url] = 0 if count else self.idle.get(url, 0) + 1
            if self.idle[url] >= self.wait.setdefault(url, 4):  # tried again at the next call, as the mean
                self.seen.pop(url, None)
                self.idle[url], self.wait[url] = 0, min(2 * self.wait[url], 64)
        return counts


BALANCES = {"speed": Timed, "even": EvenSplit}


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
        with self._changed:  # served() changes the balance's measurements from the replicas' threads (an RLock: up() takes it too)
            urls = self.up()
            if len(urls) <= 1:
                return [(url, list(indices)) for url in urls]
            quota = dict(zip(urls, self.balance.shares(len(indices), urls)))
        parts: dict[str, list[int]] = {u: [] for u in urls}
        rest = []
        for i in indices:
            home = None
            for key in _prefixes(prompts[i]) if self.homes else ():
                home = self.homes.get(key, home)
            if home in quota and len(parts[home]) < quota[home]:
                parts[home].append(i)
            else:
                rest.append(i)
        it = iter(rest)
        for url in urls:
            parts[url] += [next(it) for _ in range(quota[url] - len(parts[url]))]
        return [(url, sorted(part)) for url, part in parts.items() if part]

    def served(self, url: str, prompts: list[list[int]], steps: int, seconds: float) -> None:
        """`url` answered for `prompts` in `seconds`, its longest completion `steps` tokens."""
        with self._changed:
            self.balance.observe(url, len(prompts), steps, seconds)
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
