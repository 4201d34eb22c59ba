"""Two bounded groups of I/O worker threads: reads first, and neither starves.

Reads are on the engine's critical path (time to first token); writes are the background
cascade. Each group has its own threads and its own queue. A read worker takes reads first and
helps with writes only when no read waits; a write worker does the opposite. So a burst of
writes never delays a read behind it, and a burst of reads still leaves the write workers to
the writes.

``submit`` never blocks. The callback runs on the worker thread with the job's result or
exception; callers bridge it to their own event loop (see ``kvfs.mount.bridge``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

Callback = Callable[[Any, BaseException | None], None]


class Queue(Enum):
    READ = "read"
    WRITE = "write"


class DualQueuePool:
    def __init__(self, read_threads: int, write_threads: int, name: str = "kvfs-io") -> None:
        self._queues: dict[Queue, deque[tuple[Callable[[], Any], Callback]]] = {
            Queue.READ: deque(),
            Queue.WRITE: deque(),
        }
        self._cond = threading.Condition()
        self._closed = False
        self.busy = {Queue.READ: 0, Queue.WRITE: 0}  # jobs running, per queue they came from
        self._threads = [
            threading.Thread(
                target=self._work, args=(own,), name=f"{name}-{own.value}{i}", daemon=True
            )
            for own, count in ((Queue.READ, read_threads), (Queue.WRITE, write_threads))
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, queue: Queue, job: Callable[[], Any], callback: Callback) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("I/O pool is shut down")
            self._queues[queue].append((job, callback))
            self._cond.notify()

    def depth(self, queue: Queue) -> int:
        """Jobs waiting in one queue (not counting those running)."""
        return len(self._queues[queue])

    def shutdown(self) -> None:
        """Stop taking jobs, finish the queued ones, and join the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _take(self, own: Queue) -> tuple[Queue, Callable[[], Any], Callback] | None:
        other = Queue.WRITE if own is Queue.READ else Queue.READ
        with self._cond:
            while True:
                for queue in (own, other):
                    if self._queues[queue]:
                        job, callback = self._queues[queue].popleft()
                        self.busy[queue] += 1
                        return queue, job, callback
                if self._closed:
                    return None
                self._cond.wait()

    def _work(self, own: Queue) -> None:
        while (taken := self._take(own)) is not None:
            queue, job, callback = taken
            try:
                result, error = job(), None
            except BaseException as exc:  # handed to the caller, who decides
                result, error = None, exc
            with self._cond:
                self.busy[queue] -= 1
            callback(result, error)
