"""The in-memory index: every visible name, its attributes and its checksum.

It is built from the backing directory at mount time (``BackingStore.scan``), so a restart loses
nothing, and from then on every change goes through the daemon, which keeps it in step. Lookups
and stats (misses included) are answered from here without touching the disk.

Inode numbers are the daemon's own: 1 is the root, the rest count up and are never reused
while the daemon runs. A node that leaves the tree (unlink, rename over it) stays reachable by
inode number while the kernel still knows it (lookup count) or a file handle holds it.

Regular files are the chunks: counted, charged against the capacity and ordered for eviction.
Symlinks, fifos, sockets and device nodes are in the tree like on any filesystem, but are none
of that. A file with hard links has one primary name (``parent``, ``name``: where the index
counts it) and its other names in ``links``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator

from kvfs.buffers import on_disk
from kvfs.eviction import LRU, EvictionPolicy

ROOT_INO = 1
# What a write to a backing file changes: its inode, size and mtime (``store.file_stamp``).
Stamp = tuple[int, int, int]


class Node:
    """One file or directory. Sizes and times are those of the published (backing) version."""

    __slots__ = (
        "atime_ns",
        "blocks",
        "checksum",
        "children",
        "ctime_ns",
        "gid",
        "hits",
        "ino",
        "last_read_ns",
        "links",
        "lookups",
        "meta",
        "mode",
        "mtime_ns",
        "name",
        "on_backing",
        "open_count",
        "parent",
        "passthrough_opens",
        "pinned",
        "rdev",
        "rewritten",
        "size",
        "subdirs",
        "target",
        "tree_bytes",
        "tree_files",
        "uid",
        "verified_as",
        "version",
    )

    def __init__(self, ino: int, name: bytes, mode: int, uid: int = 0, gid: int = 0) -> None:
        self.ino = ino
        self.name = name
        self.parent: Node | None = None
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.size = 0
        self.blocks = 0  # 512-byte units, as the backing filesystem reports them
        self.atime_ns = self.mtime_ns = self.ctime_ns = 0
        self.checksum: str | None = None
        self.last_read_ns = 0  # persisted with the file, so recency survives a restart
        self.hits = 0
        self.pinned = False  # exempt from eviction (on a directory: everything below it)
        # Published again in place since the kernel may have cached its pages: readers then
        # bypass the page cache, which per inode cannot hold two versions.
        self.rewritten = False
        # Its backing file as its bytes were last checked (its inode, size and mtime:
        # ``store.file_stamp``) since the daemon started: at its own publish, a read that matched
        # the checksum, or a scrub. --verify first-read lets the kernel read it in passthrough
        # while the file stays so. None: not checked yet.
        self.verified_as: Stamp | None = None
        # Bumped as each publish of new bytes under its name begins: a reader's open that saw
        # it change may hold another version than the one it read the checksum of.
        self.version = 0
        # On directories: published files and bytes below, kept exact, so per-namespace
        # reports need no walk; and a namespace's parsed config.json, if it has one.
        self.tree_files = 0
        self.tree_bytes = 0
        self.meta: dict[str, object] | None = None
        # Whether the backing store holds this node's bytes: at its path while it is in the tree,
        # in .kvfs/unlinked/<ino> once it left the tree but the kernel may still open it.
        self.on_backing = False
        self.children: dict[bytes, Node] | None = {} if stat.S_ISDIR(mode) else None
        self.subdirs = 0  # on directories: how many children are directories (for st_nlink)
        self.links: list[tuple[Node, bytes]] = []  # names besides (parent, name): hard links
        self.target = b""  # what a symlink points to
        self.rdev = 0  # a device node's device
        self.lookups = 0  # the kernel's lookup count (see pyfuse3's forget)
        self.open_count = 0
        self.passthrough_opens = 0  # of open_count: handles the kernel reads or writes itself

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def is_file(self) -> bool:
        """A regular file: a chunk, or at least what the capacity counts."""
        return stat.S_ISREG(self.mode)

    @property
    def nlink(self) -> int:
        if self.children is not None:
            return 2 + self.subdirs
        return 1 + len(self.links)

    @property
    def attached(self) -> bool:
        return self.ino == ROOT_INO or self.parent is not None

    def __repr__(self) -> str:
        return f"Node({self.ino}, {self.name!r})"


class Index:
    """The tree of nodes plus the inode table. Single-threaded: the daemon's event loop owns it."""

    def __init__(
        self, root_mode: int = stat.S_IFDIR | 0o755, policy: EvictionPolicy[int] | None = None
    ) -> None:
        self.root = Node(ROOT_INO, b"", root_mode)
        self.by_ino: dict[int, Node] = {ROOT_INO: self.root}
        self._next_ino = ROOT_INO + 1
        self.files = 0
        self.dirs = 0
        # Called with each node that leaves the inode table (the daemon frees its bytes).
        self.on_release: Callable[[Node], None] = lambda node: None
        # Every file in the tree, in eviction order; kept in step by attach/detach/publish.
        self.policy = policy or LRU()
        self.bytes = 0  # sum of published file sizes
        self.charged = 0  # the same in whole 4 KiB blocks: what counts against the capacity
        self.pins: set[Node] = set()  # nodes pinned themselves (few): pinned bytes, no walk

    def new_node(self, name: bytes, mode: int, uid: int = 0, gid: int = 0) -> Node:
        node = Node(self._next_ino, name, mode, uid, gid)
        self._next_ino += 1
        self.by_ino[node.ino] = node
        return node

    def get(self, ino: int) -> Node | None:
        return self.by_ino.get(ino)

    @staticmethod
    def child(parent: Node, name: bytes) -> Node | None:
        assert parent.children is not None
        return parent.children.get(name)

    def attach(self, parent: Node, name: bytes, node: Node, track: bool = True) -> None:
        """Put a node in the tree; ``track=False`` leaves it to ``restore_policy`` (start-up)."""
        assert parent.children is not None and name not in parent.children
        node.parent, node.name = parent, name
        parent.children[name] = node
        if node.is_dir:
            self.dirs += 1
            parent.subdirs += 1
        elif node.is_file:
            self.files += 1
            self._count(node, +1)
            if track:
                self.policy.insert(node.ino, node.size)

    def link(self, node: Node, parent: Node, name: bytes) -> None:
        """Give an attached file one more name (a hard link); it is counted once."""
        assert parent.children is not None and name not in parent.children and node.attached
        parent.children[name] = node
        node.links.append((parent, name))
        self.policy.remove(node.ino)  # a file with several names is never evicted

    def unlink(self, parent: Node, name: bytes) -> Node:
        """Remove one name; the node leaves the tree with its last one."""
        assert parent.children is not None
        node = parent.children[name]
        if not node.links:
            self.detach(node)
            return node
        if (parent, name) in node.links:
            node.links.remove((parent, name))
            del parent.children[name]
        else:  # its primary name: another takes its place
            new_parent, new_name = node.links.pop(0)
            del parent.children[name]
            self._propagate(parent, -1, -node.size)
            node.parent, node.name = new_parent, new_name
            self._propagate(new_parent, 1, node.size)
        if not node.links:
            self.policy.insert(node.ino, node.size)
        return node

    def detach(self, node: Node) -> None:
        """Take a node out of the tree; it lives on while the kernel or a handle holds it."""
        parent = node.parent
        assert parent is not None and parent.children is not None
        if node.is_dir:
            self.dirs -= 1
        elif node.is_file:
            self.files -= 1
            self._count(node, -1)
            self.policy.remove(node.ino)
        if node.is_dir:
            parent.subdirs -= 1
        del parent.children[node.name]
        node.parent = None
        self.release_if_unused(node)

    def move(self, old_parent: Node, old_name: bytes, new_parent: Node, new_name: bytes) -> None:
        """Rename one name of a node (of a hard-linked file: that name only)."""
        assert old_parent.children is not None
        node = old_parent.children[old_name]
        assert new_parent.children is not None and new_name not in new_parent.children
        del old_parent.children[old_name]
        new_parent.children[new_name] = node
        if (old_parent, old_name) in node.links:
            node.links[node.links.index((old_parent, old_name))] = (new_parent, new_name)
            return
        if node.is_dir:
            old_parent.subdirs -= 1
            new_parent.subdirs += 1
            files, size = node.tree_files, node.tree_bytes
        else:
            files, size = (1, node.size) if node.is_file else (0, 0)
        self._propagate(old_parent, -files, -size)
        node.parent, node.name = new_parent, new_name
        self._propagate(new_parent, files, size)

    def set_published(self, node: Node, size: int, blocks: int) -> None:
        """Record a new published version's size, keeping the totals exact."""
        if node.attached and node.is_file:
            self._count(node, -1)
        node.size, node.blocks = size, blocks
        if node.attached and node.is_file:
            self._count(node, +1)
            if not node.links:
                self.policy.insert(node.ino, size)

    def restore_policy(self) -> None:
        """Order every file for eviction by its persisted last read (start-up)."""
        files = (node for node in self.walk_files() if not node.links)
        for node in sorted(files, key=lambda n: (n.last_read_ns, n.ino)):
            self.policy.restore(node.ino, node.size, node.hits)

    def read(self, node: Node, now_ns: int) -> None:
        """A reader loaded the node's bytes: it counts as a hit and as recent."""
        node.hits += 1
        node.last_read_ns = now_ns
        self.policy.access(node.ino)

    def set_pinned(self, node: Node, pinned: bool) -> None:
        node.pinned = pinned
        (self.pins.add if pinned else self.pins.discard)(node)

    def pinned_bytes(self) -> int:
        """Bytes of the published files that eviction may not take (pinned, or under a pinned
        directory), each counted once."""
        total = 0
        for node in list(self.pins):
            if node.parent is None and node is not self.root:  # left the tree
                self.pins.discard(node)
            elif not (node.parent is not None and self.pinned(node.parent)):
                total += node.tree_bytes if node.is_dir else node.size if node.on_backing else 0
        return total

    @staticmethod
    def pinned(node: Node) -> bool:
        """Whether the node or a directory above it is pinned."""
        current: Node | None = node
        while current is not None:
            if current.pinned:
                return True
            current = current.parent
        return False

    def forget(self, ino: int, count: int) -> None:
        node = self.by_ino.get(ino)
        if node is not None:
            node.lookups = max(0, node.lookups - count)
            self.release_if_unused(node)

    def release_if_unused(self, node: Node) -> None:
        unused = not node.attached and node.lookups == 0 and node.open_count == 0
        if unused and self.by_ino.pop(node.ino, None) is not None:
            self.on_release(node)

    @staticmethod
    def paths(node: Node) -> list[bytes]:
        """Every name of an attached node, its primary first."""
        return [Index.path(node)] + [
            os.path.join(Index.path(parent), name) for parent, name in node.links
        ]

    @staticmethod
    def path(node: Node) -> bytes:
        """The node's path relative to the root (b"" for the root); the node must be attached."""
        parts: list[bytes] = []
        while node.parent is not None:
            parts.append(node.name)
            node = node.parent
        return b"/".join(reversed(parts))

    @staticmethod
    def is_ancestor(node: Node, other: Node) -> bool:
        """Whether ``node`` is ``other`` or one of its ancestors."""
        current: Node | None = other
        while current is not None:
            if current is node:
                return True
            current = current.parent
        return False

    def walk_files(self, top: Node | None = None) -> Iterator[Node]:
        """Every regular file below ``top`` (once, by its primary name)."""
        stack = [top or self.root]
        while stack:
            node = stack.pop()
            if node.children is not None:
                stack.extend(
                    c for n, c in node.children.items() if c.parent is node and c.name == n
                )
            elif node.is_file:
                yield node

    def _count(self, node: Node, sign: int) -> None:
        self.bytes += sign * node.size
        self.charged += sign * on_disk(node.size)
        self._propagate(node.parent, sign, sign * node.size)

    @staticmethod
    def _propagate(directory: Node | None, files: int, size: int) -> None:
        while directory is not None:
            directory.tree_files += files
            directory.tree_bytes += size
            directory = directory.parent
