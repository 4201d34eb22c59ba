"""Trio-side helpers: await backing-store jobs, bound waits by a deadline, budget memory."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

from kvfs.io_queues import DualQueuePool, Queue

T = TypeVar("T")


class Future(Generic[T]):
    """A result that several tasks may await; set once, from the event loop."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def set(self, result: T | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]


class IO:
    """Runs blocking backing-store calls on the dual-queue pool without blocking the loop."""

    def __init__(self, pool: DualQueuePool) -> None:
        self.pool = pool
        self._token = trio.lowlevel.current_trio_token()

    def submit(self, queue: Queue, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()

        def deliver(result: Any, error: BaseException | None) -> None:
            # RunFinishedError: the daemon is shutting down and nobody waits any more.
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(future.set, result, error)

        self.pool.submit(queue, functools.partial(fn, *args), deliver)
        return future

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(Queue.READ, fn, *args).wait()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(Queue.WRITE, fn, *args).wait()


class Detached:
    """Runs operations as tasks of their own, so a caller may stop waiting (deadline) while
    the operation itself still completes and keeps the index and backing store in step."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def start(self, fn: Callable[[], Awaitable[T]]) -> Future[T]:
        future: Future[T] = Future()

        async def run() -> None:
            try:
                result = await fn()
            except BaseException as exc:
                if isinstance(exc, trio.Cancelled):
                    raise
                future.set(None, exc)
            else:
                future.set(result, None)

        self._nursery.start_soon(run)
        return future


class ByteBudget:
    """Bytes of buffered file data; acquirers wait until enough is released.

    One holder may exceed the budget when it is the only one, so a file larger than the whole
    budget still goes through (alone) instead of waiting forever.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._released = trio.Event()

    async def acquire(self, amount: int) -> None:
        while self.used and self.used + amount > self.capacity:
            await self._released.wait()
        self.used += amount

    def release(self, amount: int) -> None:
        self.used -= amount
        self._released.set()
        self._released = trio.Event()
