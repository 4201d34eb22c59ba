"""Index changes for a backing directory shared with other daemons (``--shared HOST_ID``).

Other hosts publish and remove files behind this daemon's index: a name it lacks may be on
the backing directory (``adopt`` it, found by a lookup), and a name it published may have
been taken first by another host (``describe`` the file that kept the name). Design and what
is not built yet: docs/research/fleet-design.md.
"""

from __future__ import annotations

from kvfs.index import Index, Node
from kvfs.store import Found, fill_times

# How long the kernel may cache a miss on a shared mount: another host may publish the name
# any moment, and until the negative entry lapses this host would not ask.
MISS_TIMEOUT = 1.0


def adopt(index: Index, parent: Node, name: bytes, found: Found) -> Node:
    """A file or directory another host made joins the index, as ``scan`` would have added
    it at mount: a file is checked against its checksum xattr at its first read."""
    st = found.st
    node = index.new_node(name, st.st_mode, st.st_uid, st.st_gid)
    fill_times(node, st)
    node.on_backing = True
    if node.is_file:
        node.size, node.blocks = st.st_size, st.st_blocks
        node.checksum = found.checksum
        node.last_read_ns, node.hits = found.last_read_ns, found.hits
    index.set_pinned(node, found.pinned)
    index.attach(parent, name, node)
    return node


def describe(index: Index, node: Node, found: Found) -> None:
    """The node now stands for the file another host published under its name first."""
    st = found.st
    node.mode, node.uid, node.gid = st.st_mode, st.st_uid, st.st_gid
    fill_times(node, st)
    node.on_backing = True
    node.checksum = found.checksum
    node.verified_as = None  # checked at its first read, like any file found on the store
    index.set_published(node, st.st_size, st.st_blocks)
