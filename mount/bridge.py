"""Trio-side helpers: await backing-store jobs, bound waits by a deadline, budget memory,
and keep one request's failure from ending the daemon."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio
from pyfuse3 import FUSEError

from kvfs.io_queues import DualQueuePool, Queue

log = logging.getLogger(__name__)
T = TypeVar("T")


def contained(name: str, handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap a FUSE handler so that whatever it raises fails that request only.

    pyfuse3 ends its main loop, and so the daemon and every client's mount, on any exception
    that is not a FUSEError. An OSError keeps its errno; anything else is a bug in kvfs, or
    input it did not foresee: logged with its traceback, and EIO for that one request.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await handler(*args, **kwargs)
        except FUSEError:
            raise
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed: EIO for this request", name)
            raise FUSEError(errno.EIO) from None

    return wrapper


class NeedsIO(Exception):
    """Raised by a request answered inline, in the kernel session's receive loop (``lookup_now``,
    ``create_now``...), that cannot be answered without waiting: it is served in a task."""


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

    def post(self, queue: Queue, fn: Callable[..., object], *args: Any) -> None:
        """Run a job that nobody awaits (a discard, a close): its end does not wake the loop,
        which a delivery costs; a failure is logged from the pool."""
        self.pool.submit(queue, functools.partial(fn, *args), log_failure)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(Queue.READ, fn, *args).wait()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(Queue.WRITE, fn, *args).wait()


def log_failure(_: object, error: BaseException | None) -> None:
    """The pool's callback for a job nobody awaits."""
    if isinstance(error, OSError):
        log.warning("background I/O failed: %s", error)
    elif error is not None:
        log.error("background I/O failed", exc_info=error)


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


class Lock:
    """A trio.Lock whose acquire passes through the scheduler only when it must wait: trio
    makes every acquire a schedule point, which cost each request a trip round the event
    loop for a lock it almost always finds free. Waiters still take it in turn."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


class NamespaceLock:
    """The namespace lock: held alone across a change of names (the index and the backing
    store changed together, a name checked free and then taken), or shared by what takes no
    name another holder may have checked (a publish under the file's own name, a reader's open,
    a change made in memory at once). Waiters are served in turn: a shared acquirer queues
    behind a waiting exclusive one. Like ``Lock``, an acquire passes through the scheduler
    only when it must wait."""

    def __init__(self) -> None:
        self._shared = 0  # holders sharing it
        self._alone = False
        self._waiters: deque[tuple[bool, trio.Event]] = deque()  # (alone, granted)

    def locked(self) -> bool:
        """Held alone: what a change made in memory, without the lock, must not pass."""
        return self._alone

    async def __aenter__(self) -> None:
        await self._acquire(alone=True)

    async def __aexit__(self, *exc_info: object) -> None:
        self._release(alone=True)

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        await self._acquire(alone=False)
        try:
            yield
        finally:
            self._release(alone=False)

    def _free_for(self, alone: bool) -> bool:
        return not self._alone and (not alone or self._shared == 0)

    async def _acquire(self, alone: bool) -> None:
        if not self._waiters and self._free_for(alone):
            self._take(alone)
            return
        waiter = (alone, trio.Event())
        self._waiters.append(waiter)
        try:
            await waiter[1].wait()
        except BaseException:
            if waiter[1].is_set():  # granted as it was cancelled: give it on
                self._release(alone)
            else:
                self._waiters.remove(waiter)
                self._grant()  # those behind it may go now
            raise

    def _take(self, alone: bool) -> None:
        if alone:
            self._alone = True
        else:
            self._shared += 1

    def _release(self, alone: bool) -> None:
        if alone:
            self._alone = False
        else:
            self._shared -= 1
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._free_for(self._waiters[0][0]):
            alone, granted = self._waiters.popleft()
            self._take(alone)
            granted.set()


class ByteBudget:
    """Bytes of buffered file data; acquirers wait until enough is released.

    No single file may need more than the whole budget (the caller refuses it with EFBIG):
    a writer would then wait for bytes it holds itself.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._released = trio.Event()

    async def acquire(self, amount: int) -> None:
        assert amount <= self.capacity
        while self.used + amount > self.capacity:
            await self._released.wait()
        self.used += amount

    def release(self, amount: int) -> None:
        self.used -= amount
        self._released.set()
        self._released = trio.Event()
