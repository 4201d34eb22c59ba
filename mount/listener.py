"""What the mount does when the object layer tells it a file appeared or vanished: a KV event
for routers (chunk files only), and the kernel's caches (names, attributes, pages) told."""

from __future__ import annotations

from kvfs import namespaces
from kvfs.index import Index, Node
from kvfs.mount.events import MountEvents
from kvfs.mount.invalidator import Invalidator
from kvfs.mount.kernel_session import FuseSession, KernelSession
from kvfs.vllm_layout import block_of


class MountListener:
    """The object layer's ``Listener`` for a mounted tree."""

    def __init__(
        self,
        index: Index,
        invalidator: Invalidator,
        events: MountEvents | None,
        session: FuseSession,
    ) -> None:
        self.index = index
        self.invalidator = invalidator
        self.events = events
        self.session = session

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.invalidator.close()

    def stored(self, node: Node) -> None:
        self._chunk_event(node, stored=True)

    def removed(self, node: Node) -> None:
        self._chunk_event(node, stored=False)
        self._bytes_changed(node)

    def moved_away(self, node: Node) -> None:
        self._chunk_event(node, stored=False)  # the kernel's backing file is still these bytes

    def name_gone(self, parent: Node, name: bytes, node: Node) -> None:
        self.invalidator.entry(parent.ino, name, node.ino)

    async def name_gone_now(self, parent: Node, name: bytes, node: Node) -> None:
        await self.invalidator.entry_now(parent.ino, name, node.ino)

    def attributes_changed(self, node: Node) -> None:
        self.invalidator.attributes(node.ino)

    def content_changed(self, node: Node) -> None:
        self.invalidator.inode(node.ino)
        self._bytes_changed(node)

    def released(self, node: Node) -> None:
        self._bytes_changed(node)

    def _bytes_changed(self, node: Node) -> None:
        """No later open may pass through to the backing file the session kept for it."""
        if isinstance(self.session, KernelSession):
            self.session.forget_backing(node.ino)

    def _chunk_event(self, node: Node, stored: bool) -> None:
        """Tell routers a chunk appeared or went (only names that are chunk files)."""
        if self.events is None or node.parent is None:
            return
        block = block_of(node.name, node.parent.name)
        if block is None:
            return
        if stored:
            top = namespaces.top_level(node)
            config = namespaces.config_for(self.index, top) if top is not None else None
            self.events.chunk_stored(*block, namespaces.tokens_per_chunk(config) or 0)
        else:
            self.events.chunk_removed(*block)
