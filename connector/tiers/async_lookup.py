"""Batched, asynchronous existence checks for tiers whose lookups cost I/O.

The scheduler asks key by key and must never wait. The first ask for a key queues it and
answers "not known yet" (the tier says RETRY); at the end of the step the queued keys go, as
one batch, to a thread of their own, which checks them (``access`` of thousands of paths per
prompt, mostly misses, is the fs tier's hot path); by the next step the answers are there.

Answers are remembered: a hit until a load of it fails (``mark``), a miss for ``miss_ttl``
seconds, so that chunks another instance publishes on shared storage are seen soon. A check
that raises counts as misses; one that hangs leaves its keys unknown, and the tiering manager's
lookup deadline turns them into misses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

Check = Callable[[list[bytes]], list[bool]]


class AsyncLookup:
    def __init__(
        self, check: Check, name: str, miss_ttl: float = 1.0, max_answers: int = 1 << 20
    ) -> None:
        self._check = check
        self._miss_ttl = miss_ttl
        self._max_answers = max_answers
        self._answers: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._queued: list[bytes] = []
        self._asked: set[bytes] = set()  # queued or being checked
        self._results: deque[tuple[list[bytes], list[bool]]] = deque()  # from the thread
        self._batches: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self.checked = 0  # keys checked so far (a metric)
        self._thread = threading.Thread(target=self._run, name=f"kvfs-{name}-lookup", daemon=True)
        self._thread.start()

    def lookup(self, key: bytes) -> bool | None:
        """True or False if known, None if the answer comes after the next flush."""
        self._take_results()
        answer = self._answers.get(key)
        if answer is not None:
            present, when = answer
            if present or time.monotonic() - when < self._miss_ttl:
                return present
            del self._answers[key]
        if key not in self._asked:
            self._asked.add(key)
            self._queued.append(key)
        return None

    def flush(self) -> None:
        """Send the keys asked since the last flush to be checked."""
        if self._queued:
            batch, self._queued = self._queued, []
            self._batches.put(batch)

    def mark(self, keys: Iterable[bytes], present: bool) -> None:
        """What the tier learned itself: a store made keys present, a load found them gone."""
        self._take_results()
        now = time.monotonic()
        for key in keys:
            self._remember(key, present, now)

    def shutdown(self) -> None:
        self._batches.put(None)
        self._thread.join(timeout=5)
        # The check is its tier's bound method, and the tier holds this: let go of it, so the
        # tier and the host region its slots view are freed now, not at a cycle collection.
        del self._check

    def _remember(self, key: bytes, present: bool, now: float) -> None:
        self._answers[key] = (present, now)
        self._answers.move_to_end(key)
        while len(self._answers) > self._max_answers:
            self._answers.popitem(last=False)

    def _take_results(self) -> None:
        now = time.monotonic()
        while self._results:
            keys, present = self._results.popleft()
            for key, found in zip(keys, present, strict=True):
                self._asked.discard(key)
                self._remember(key, found, now)

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            try:
                found = self._check(batch)
            except Exception:
                log.exception("a lookup batch of %d keys failed: counted as misses", len(batch))
                found = [False] * len(batch)
            self.checked += len(batch)
            self._results.append((batch, found))
