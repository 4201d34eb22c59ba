"""Tell the kernel to forget what the daemon changed behind its back.

pyfuse3's invalidation calls write to /dev/fuse and may block until the kernel is done, which can
deadlock if done from a request handler. So they run on one background thread, fed by a queue.
"""

from __future__ import annotations

import logging
import queue
import threading

import pyfuse3

log = logging.getLogger(__name__)


class Invalidator:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, bytes | None, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvfs-invalidate", daemon=True)
        self._thread.start()

    def attributes(self, ino: int) -> None:
        """The inode's attributes changed (size, st_blocks, times)."""
        self._queue.put((ino, None, 0))

    def entry(self, parent_ino: int, name: bytes, deleted_ino: int = 0) -> None:
        """A name vanished (eviction, quarantine); ``deleted_ino`` also notifies watchers."""
        self._queue.put((parent_ino, name, deleted_ino))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ino, name, deleted = item
            try:
                if name is None:
                    pyfuse3.invalidate_inode(ino, attr_only=True)
                else:
                    pyfuse3.invalidate_entry(ino, name, deleted)
            except OSError as err:  # the kernel already forgot it: nothing to do
                log.debug("invalidate %s %r: %s", ino, name, err)
