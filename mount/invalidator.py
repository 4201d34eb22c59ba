"""Tell the kernel to forget what the daemon changed behind its back.

pyfuse3's invalidation calls write to /dev/fuse and may block until the kernel is done, which can
deadlock if done from a request handler. So they run on one background thread, fed by a queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

import trio

from kvfs.mount.kernel_session import FuseSession

log = logging.getLogger(__name__)


# What to invalidate: (inode, None, 0) its attributes, (inode, None, 1) its attributes and
# cached data, (parent, name, deleted inode) a name; and whom to tell when it is done.
_Item = tuple[int, bytes | None, int, Callable[[], None] | None]

# How long a request waits for the kernel to drop a name. It can only be slow while a request
# that holds the parent directory's lock is itself waiting for the daemon.
WAIT_FOR_KERNEL = 5.0


class Invalidator:
    def __init__(self, session: FuseSession) -> None:
        self._session = session
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvfs-invalidate", daemon=True)
        self._thread.start()

    def attributes(self, ino: int) -> None:
        """The inode's attributes changed (size, st_blocks, times)."""
        self._queue.put((ino, None, 0, None))

    def inode(self, ino: int) -> None:
        """The inode's content changed: its cached pages go too."""
        self._queue.put((ino, None, 1, None))

    def entry(self, parent_ino: int, name: bytes, deleted_ino: int = 0) -> None:
        """A name vanished (eviction, quarantine); ``deleted_ino`` also notifies watchers."""
        self._queue.put((parent_ino, name, deleted_ino, None))

    async def entry_now(self, parent_ino: int, name: bytes, deleted_ino: int = 0) -> None:
        """``entry``, and wait (in trio, never blocking the loop) until the kernel has dropped
        the name, so that what the caller answers next can rely on it."""
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def tell() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._queue.put((parent_ino, name, deleted_ino, tell))
        with trio.move_on_after(WAIT_FOR_KERNEL) as scope:
            await done.wait()
        if scope.cancelled_caught:
            log.warning("the kernel took over %.0fs to drop a name", WAIT_FOR_KERNEL)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ino, name, extra, done = item
            try:
                if name is None:
                    self._session.invalidate_inode(ino, attr_only=not extra)
                else:
                    self._session.invalidate_entry(ino, name, extra)
            except OSError as err:  # the kernel already forgot it: nothing to do
                log.debug("invalidate %s %r: %s", ino, name, err)
            if done is not None:
                done()
